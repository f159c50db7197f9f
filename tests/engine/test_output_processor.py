"""The one output assembler (``engine/output_processor.py``), fed hand-built core deltas:
groups of ``n``, stop strings across token boundaries, and streamed reads that add up to
the final output."""

from __future__ import annotations

from typing import Any

import pytest

from pagedllm.core.outputs import TokenLogprob
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.outputs import RequestDelta, SequenceDelta
from pagedllm.sampling_params import SamplingParams


def _ids(tokenizer: Any, text: str) -> tuple[int, ...]:
    return tuple(tokenizer.encode(text))


def _delta(request_id: str, *seqs: SequenceDelta, finished: bool = False) -> RequestDelta:
    return RequestDelta(request_id, seqs, finished)


def _start(tokenizer: Any, request_id: str = "r", **params: Any) -> tuple[OutputProcessor, Any]:
    processor = OutputProcessor(tokenizer)
    state = processor.add_request(request_id, "hi", _ids(tokenizer, "hi"), SamplingParams(**params))
    return processor, state


def test_a_group_of_n_finishes_when_its_last_sequence_does(tokenizer):
    processor, state = _start(tokenizer, n=3, max_tokens=4)
    [stop_id] = _ids(tokenizer, "d")
    processor.process(
        _delta("r", *(SequenceDelta(i, _ids(tokenizer, "ab"[: i % 2 + 1])) for i in (2, 0, 1)))
    )
    assert [c.index for c in state.output().outputs] == [0, 1, 2]
    processor.process(_delta("r", SequenceDelta(1, (), finish_reason="length")))
    assert not state.finished and "r" in processor.requests
    processor.process(
        _delta(
            "r",
            SequenceDelta(0, _ids(tokenizer, "c"), finish_reason="length"),
            SequenceDelta(2, _ids(tokenizer, "d"), finish_reason="stop", stop_reason=stop_id),
        )
    )
    output = state.output()
    assert state.finished and output.finished and "r" not in processor.requests
    # The stop token that ended sample 2 is not in its text (as in vLLM).
    assert [c.text for c in output.outputs] == ["ac", "ab", "a"]
    assert [c.finish_reason for c in output.outputs] == ["length", "length", "stop"]
    assert output.outputs[2].stop_reason == stop_id
    assert state.take_stopped() == []  # the core finished them all itself


def test_a_stop_string_split_over_tokens_ends_the_sequence_once(tokenizer):
    processor, state = _start(tokenizer, n=2, stop=["xyz"], max_tokens=20)
    processor.process(_delta("r", SequenceDelta(0, _ids(tokenizer, "abx")), SequenceDelta(1, ())))
    # While running, the text holds back what a stop string could take back.
    assert state.output().outputs[0].text == "a"
    processor.process(_delta("r", SequenceDelta(0, _ids(tokenizer, "y"))))
    processor.process(_delta("r", SequenceDelta(0, _ids(tokenizer, "zq"))))
    assert state.take_stopped() == [(0, "xyz")] and state.take_stopped() == []
    first = state.output().outputs[0]
    assert (first.text, first.finish_reason, first.stop_reason) == ("ab", "stop", "xyz")
    # Up to the token that completed the stop string: "q" came in the same step (several
    # tokens a step: verified drafts) and is dropped, as it would not have been made.
    assert first.token_ids == _ids(tokenizer, "abxyz")
    # The core ran a step more before it heard: nothing changes.
    processor.process(_delta("r", SequenceDelta(0, _ids(tokenizer, "more"))))
    assert state.output().outputs[0] == first and not state.finished
    processor.process(_delta("r", SequenceDelta(1, _ids(tokenizer, "w"), finish_reason="length")))
    assert state.finished and state.output().outputs[1].text == "w"


def test_include_stop_str_in_output_keeps_the_stop_string(tokenizer):
    processor, state = _start(tokenizer, stop=["cd", "zz"], include_stop_str_in_output=True)
    for text in ("ab", "c", "de"):
        processor.process(_delta("r", SequenceDelta(0, _ids(tokenizer, text))))
    output = state.output()
    assert output.finished and output.outputs[0].text == "abcd"
    assert output.outputs[0].stop_reason == "cd"
    assert state.take_stopped() == [(0, "cd")]


def test_a_stop_string_wins_over_the_cores_finish_in_the_same_step(tokenizer):
    processor, state = _start(tokenizer, stop=["b"])
    processor.process(_delta("r", SequenceDelta(0, _ids(tokenizer, "ab"), finish_reason="length")))
    output = state.output().outputs[0]
    assert (output.text, output.finish_reason, output.stop_reason) == ("a", "stop", "b")
    assert state.take_stopped() == []  # the core has finished it already


def test_streamed_reads_add_up_to_the_final_output(tokenizer):
    processor, state = _start(tokenizer, n=2, logprobs=1, stop=["!!"])
    text = "héllo wörld!!"  # multi-byte characters cut across tokens, and a stop string
    ids = _ids(tokenizer, text)
    reads = []
    for i, token in enumerate(ids):
        lp = TokenLogprob(token, -0.5, 1, (token,), (-0.5,))
        seqs = [SequenceDelta(0, (token,), (lp,))]
        if i < 3:
            seqs.append(SequenceDelta(1, (token,), (lp,), "length" if i == 2 else None))
        processor.process(_delta("r", *seqs))
        if i % 3 == 0 and (read := state.read()) is not None:
            reads.append(read)
        if state.finished:
            break
    while (read := state.read()) is not None:
        reads.append(read)
    assert reads[-1].finished
    final = state.output()
    for completion in final.outputs:
        choices = [c for r in reads for c in r.choices if c.index == completion.index]
        assert "".join(c.text for c in choices) == completion.text
        assert sum((c.token_ids for c in choices), ()) == completion.token_ids
        assert [p for c in choices for p in c.logprobs] == completion.logprobs
        assert [c.finish_reason for c in choices if c.finish_reason] == [completion.finish_reason]
    assert final.outputs[0].text == "héllo wörld"
    assert final.outputs[1].text == tokenizer.decode(ids[:3])
    assert final.outputs[0].cumulative_logprob == -0.5 * len(final.outputs[0].token_ids)


def test_an_aborted_request_is_forgotten(tokenizer):
    processor, _ = _start(tokenizer)
    processor.abort_request("r")
    assert processor.process(_delta("r", SequenceDelta(0, (1,)))) is None


@pytest.mark.parametrize("stop", [(), ("zz",)])  # without and with stop strings
def test_the_stop_token_that_ends_a_sequence_stays_out_of_its_text(tokenizer, stop):
    """As vLLM: EOS or a ``stop_token_ids`` token ends the text before it, even when
    special tokens are kept; ``include_stop_str_in_output`` keeps it."""
    eos = tokenizer.eos_token_id
    for keep, expected in ((False, "ab"), (True, "ab" + tokenizer.decode([eos]))):
        processor, state = _start(
            tokenizer, skip_special_tokens=False, include_stop_str_in_output=keep, stop=stop
        )
        processor.process(_delta("r", SequenceDelta(0, _ids(tokenizer, "a"))))
        done = SequenceDelta(0, (*_ids(tokenizer, "b"), eos), finish_reason="stop")
        processor.process(_delta("r", done, finished=True))
        assert state.output().outputs[0].text == expected
    # A complete grammar ends a sequence with "stop" and no reason on a token of its text.
    processor, state = _start(tokenizer, skip_special_tokens=False, stop=stop)
    processor.process(_delta("r", SequenceDelta(0, _ids(tokenizer, "ab"), finish_reason="stop")))
    assert state.output().outputs[0].text == "ab"
