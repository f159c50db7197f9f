"""The wire between the server and the engine core: every message round-trips through the
one codec, new fields need no codec code, and bad frames are refused with the caller's id."""

from __future__ import annotations

from dataclasses import dataclass, fields

import pytest

from pagedllm.core.outputs import TokenLogprob
from pagedllm.engine import messages as m
from pagedllm.engine.core import EngineCore
from pagedllm.engine.elastic import ResizeReport
from pagedllm.engine.messages import Codec, MessageError
from pagedllm.engine.outputs import RequestDelta, SequenceDelta
from pagedllm.sampling_params import SamplingParams


def _params() -> SamplingParams:
    """Every field away from its default."""
    return SamplingParams(
        n=2, temperature=0.5, top_p=0.9, top_k=5, min_p=0.1, seed=7, max_tokens=None,
        min_tokens=1, stop=("a", "bc"), stop_token_ids=(3, 4), ignore_eos=True,
        presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2, logprobs=3,
        prompt_logprobs=1, include_stop_str_in_output=True, skip_special_tokens=False,
        spaces_between_special_tokens=False, logit_bias={5: 1.5, 6: -100.0},
    )  # fmt: skip


def _delta(request_id: str = "r") -> RequestDelta:
    lp = TokenLogprob(5, -0.25, 1, (5, 6), (-0.25, -1.5))
    seqs = (
        SequenceDelta(0, (5, 9), (lp, lp)),
        SequenceDelta(1, (), None, "stop", "bc"),
        SequenceDelta(2, (7,), None, "stop", 4),
    )
    return RequestDelta(request_id, seqs, True, 16, "boom", 3, (None, lp), 2)


SAMPLES: list[object] = [
    m.AddRequests((m.RequestSpec("a", "text", _params(), 2, "salt"),
                   m.RequestSpec("b", [1, 2, 3], SamplingParams()))),
    m.GetStats(), m.GetCacheReport(), m.GetBlocksReport(), m.GetEventsReport("e", 4),
    m.GetEventsReport(None, 0), m.WatchEvents(), m.StartResize(1 << 20, True),
    m.GetResizeReport(3), m.GetCacheCapacityBlocks(), m.GetMaxNumTokens(),
    m.GetNumUnfinishedRequests(), m.FlushDiskTier(), m.ResetPrefixCache(),
    m.AbortRequests(("a", "b")), m.StopSequences("a", ((0, "x"), (2, "yz"))), m.Shutdown(),
    m.Ready(m.EngineInfo("dir", "name", 64, 100, 4, 32, 60, 1234, "hermes")),
    m.Deltas((_delta("a"), _delta("b"))), m.CacheEvents({"epoch": "e", "events": [["s", "ab"]]}),
    m.Raised("ValueError", "bad"), m.Dead("gone"),
]  # fmt: skip


def test_every_message_kind_has_a_sample_and_round_trips():
    assert {type(s) for s in SAMPLES} == set(m.MESSAGES) - {m.Returned}
    codec = Codec()
    for call_id, message in enumerate(SAMPLES):
        decoded = codec.decode(codec.encode(message, call_id))
        assert decoded == (message, call_id)
        assert type(decoded.message) is type(message)
    assert codec.decode(codec.encode(m.Shutdown())).call_id is None


def test_params_keep_types_and_checks_across_the_wire():
    codec = Codec()
    spec = m.RequestSpec("a", [1, 2], _params())
    (decoded,) = codec.decode(codec.encode(m.AddRequests((spec,)))).message.specs
    assert decoded == spec and decoded.params.logit_bias == {5: 1.5, 6: -100.0}
    assert isinstance(decoded.params.stop, tuple) and isinstance(
        decoded.params.stop_token_ids, tuple
    )
    assert decoded.params.all_stop_token_ids == frozenset({3, 4})
    # SamplingParams' own checks run on the core's side too; the caller's id survives.
    frame = codec.encode_value(
        (
            "AddRequests",
            9,
            {"specs": [{"request_id": "a", "prompt": [1], "params": {"top_p": 0.0}}]},
        )
    )
    with pytest.raises(MessageError, match="top_p must be in") as err:
        codec.decode(frame)
    assert err.value.call_id == 9


def test_an_undeclared_message_is_refused_with_its_callers_id():
    codec = Codec()
    with pytest.raises(MessageError, match="no message named 'tokenize'") as err:
        codec.decode(codec.encode_value(("tokenize", 4, [97])))
    assert err.value.call_id == 4
    with pytest.raises(MessageError, match="not a message frame"):
        codec.decode(codec.encode_value(["utility", 1, "blocks_report", []]))


@dataclass(frozen=True, slots=True)
class _Grammar:
    kind: str
    spec: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class _ParamsWithMore(SamplingParams):
    """SamplingParams as a feature grows it: a nested optional record, a tuple of them."""

    structured: _Grammar | None = None
    alternatives: tuple[_Grammar, ...] = ()


def test_new_nested_fields_need_no_codec_code():
    codec = Codec()
    params = _ParamsWithMore(temperature=0.0, structured=_Grammar("json", ("a",)),
                             alternatives=(_Grammar("regex"),))  # fmt: skip
    decoded = codec.decode_value(codec.encode_value(params), _ParamsWithMore)
    assert decoded == params and decoded.structured == _Grammar("json", ("a",))
    # An older sender (no new fields) decodes to the defaults; a newer one's extra
    # fields are ignored by an older reader.
    old = codec.decode_value(codec.encode_value(SamplingParams(n=3)), _ParamsWithMore)
    assert old.n == 3 and old.structured is None and old.alternatives == ()
    assert codec.decode_value(codec.encode_value(params), SamplingParams).temperature == 0.0


def test_answers_decode_into_each_calls_result_type():
    codec = Codec()
    numbers = {f.name: 1 for f in fields(ResizeReport) if f.name not in ("limited_by", "reason")}
    report = ResizeReport(**numbers, limited_by="running requests")
    answer = codec.decode(codec.encode(codec.returned(report), 5))
    assert answer.call_id == 5
    value_type = m.result_type(m.GetResizeReport)
    assert codec.decode_value(answer.message.value, value_type) == report
    assert m.result_type(m.AddRequests) is type(None)
    for call in m.CALLS:
        m.result_type(call)  # each names its result (Call[R])
    assert m.raised(KeyError("k")) == m.Raised("KeyError", "'k'")
    assert m.raised(MessageError("bad")).error_type == "ValueError"
    assert m.raised(RuntimeError("x")).error_type == "RuntimeError"


def test_the_core_handles_exactly_the_declared_messages(fake_engine):
    handled = set(EngineCore(fake_engine()).handlers)
    assert handled == {*m.CALLS, m.AbortRequests, m.StopSequences}
