"""Structured outputs in the engine: the compiler (errors that name the feature and its path,
the cache, the time limit), the matchers' masks against a plain reference, and the engine
on the fake runner (forks, preemption, compiles off the step loop, aborts, beam search)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from pagedllm.engine.beam_search import beam_search
from pagedllm.engine.config import EngineConfig
from pagedllm.engine.llm import LLM
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.structured_outputs import (
    GrammarCompiler,
    GrammarError,
    Match,
    SequenceMatchers,
)
from pagedllm.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams
from pagedllm.worker.fake_runner import FakeModelRunner

from .conftest import run_all

S = StructuredOutputsParams
OBJECT = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99},
        "b": {"type": "string", "maxLength": 3},
        "c": {"enum": ["x", "yy"]},
    },
    "required": ["a", "b", "c"],
    "additionalProperties": False,
}


@pytest.fixture
def compiler(tokenizer: Any) -> Iterator[GrammarCompiler]:
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    yield compiler
    compiler.close()


@pytest.fixture
def grammar_engine(tokenizer: Any, engines: list[LLMEngine]) -> Callable[..., LLMEngine]:
    """An engine on the fake runner over the whole vocabulary (the grammar picks)."""

    def build(
        num_blocks: int = 64, host_blocks: int = 0, use_sampler: bool = False, **config: Any
    ) -> LLMEngine:
        runner = FakeModelRunner(
            num_blocks, 4, vocab_size=len(tokenizer), num_host_blocks=host_blocks,
            use_sampler=use_sampler,
        )  # fmt: skip
        config.setdefault("max_model_len", 256)
        engine = LLMEngine(EngineConfig(block_size=4, **config), runner, tokenizer)
        engines.append(engine)
        return engine

    return build


# ---------------------------------------------------------------- the compiler


@pytest.mark.parametrize(
    ("schema", "feature", "path"),
    [
        ({"properties": {"a": {"type": "array", "items": {"not": {}}}}}, '"not"',
         "/properties/a/items"),
        ({"properties": {"a": {"type": "string", "format": "colour"}}}, '"format": "colour"',
         "/properties/a"),
        ({"anyOf": [{"type": "integer"}, {"type": "strng"}]}, '"type": "strng"', "/anyOf/1"),
        ({"properties": {"r": {"$ref": "#/$defs/missing"}}}, '"$ref"', "/properties/r"),
        ({"properties": {"p": {"type": "string", "pattern": "(?<=a)b"}}}, '"pattern"',
         "/properties/p"),
        ({"$defs": {"d": {"dependentSchemas": {"a": {}}}}, "$ref": "#/$defs/d"},
         '"dependentSchemas"', "/$defs/d"),
    ],
)  # fmt: skip
def test_a_refused_schema_names_the_feature_and_its_path(
    compiler: GrammarCompiler, schema: dict[str, Any], feature: str, path: str
) -> None:
    with pytest.raises(GrammarError) as caught:
        compiler.compile(S(json=schema))
    message = str(caught.value)
    assert message.startswith("structured_outputs.json: unsupported JSON Schema feature")
    assert feature in message and f"at {path} " in message
    assert caught.value.message("response_format.json_schema.schema").startswith(
        "response_format.json_schema.schema: "
    )


@pytest.mark.parametrize(
    ("params", "field"),
    [(S(regex="(unclosed"), "structured_outputs.regex"),
     (S(grammar="start: missing_rule"), "structured_outputs.grammar")],
)  # fmt: skip
def test_a_refused_regex_or_grammar_names_its_field(
    compiler: GrammarCompiler, params: StructuredOutputsParams, field: str
) -> None:
    with pytest.raises(ValueError, match=f"^{field}: "):
        compiler.compile(params)


def test_the_same_spec_compiles_once(compiler: GrammarCompiler) -> None:
    first = compiler.compile(S(json=OBJECT))
    reordered = json.loads(json.dumps(OBJECT, sort_keys=True))  # same schema, other key order
    assert compiler.compile(S(json=json.dumps(reordered))) is first
    stats = compiler.stats()
    assert stats.num_compiled == 1 and stats.num_hits == 1
    assert compiler.compile(S(json=OBJECT, disable_any_whitespace=True)) is not first


WIDE = {  # about a second to compile on a shared 2-core machine
    "type": "object",
    "properties": {
        f"p{i}": {"type": "string", "pattern": f"^[a-z]{{1,{i % 50 + 2}}}[0-9]+x{i}$"}
        for i in range(3000)
    },
}


def test_a_slow_compile_is_refused_within_the_time_limit(tokenizer: Any) -> None:
    compiler = GrammarCompiler(tokenizer, time_limit_s=0.01)
    wide = WIDE
    try:
        started = time.perf_counter()
        with pytest.raises(GrammarError, match="did not compile within 0.01 s"):
            compiler.compile(S(json=wide))
        assert time.perf_counter() - started < 1.0
        started = time.perf_counter()
        with pytest.raises(GrammarError, match="did not compile within"):
            compiler.compile(S(json=wide))  # remembered: refused without compiling
        assert time.perf_counter() - started < 0.5  # hashing the schema's text only
    finally:
        compiler.close()


def test_the_engine_compiles_under_its_configured_limit(
    grammar_engine: Callable[..., LLMEngine],
) -> None:
    """``EngineConfig.grammar_compile_limit_s`` (``--grammar-compile-limit``) is the
    engine's compiler's limit; it must be a positive number of seconds."""
    engine = grammar_engine(grammar_compile_limit_s=0.01)
    assert engine.structured.compiler().time_limit_s == 0.01
    with pytest.raises(GrammarError, match="did not compile within 0.01 s"):
        engine.structured.check(SamplingParams(structured_outputs=S(json=WIDE)))
    for bad in (0, -1.0, True, "10"):
        with pytest.raises(ValueError, match="grammar_compile_limit_s must be positive"):
            EngineConfig(grammar_compile_limit_s=bad)


# ---------------------------------------------------------------- matchers and masks


def _allowed(mask: bytes, vocab: int) -> set[int]:
    return {t for t in range(vocab) if mask[t // 8] >> (t % 8) & 1}


def test_a_choice_mask_is_the_next_bytes_of_the_choices(
    compiler: GrammarCompiler, tokenizer: Any
) -> None:
    """Plain reference: with one token per byte, the allowed tokens after a prefix are the
    next bytes of the choices that extend it (EOS once the prefix is a whole choice)."""
    choices = ["cat", "car", "cart", "dog"]
    grammar = compiler.compile(S(choice=choices))
    matchers = SequenceMatchers()
    matchers.add("s", grammar)
    vocab = len(tokenizer)
    for prefix in ["", "c", "ca", "car", "cart"]:
        ids = tokenizer.encode(prefix) if prefix else []
        assert matchers.advance("s", ids) in (Match.RUNNING, Match.COMPLETE)
        from pagedllm.core.outputs import ScheduledSequence

        mask = matchers.bitmasks([ScheduledSequence("s", (0,), 0, ())])["s"]
        expected = {
            tokenizer.encode(c[len(prefix)])[0]
            for c in choices
            if c.startswith(prefix) and len(c) > len(prefix)
        }
        if prefix in choices:
            expected.add(tokenizer.eos_token_id)
        if prefix == "cart":
            break  # complete: nothing more allowed, the engine ends it there
        assert _allowed(mask, vocab) == expected, prefix
    assert matchers.advance("s", tokenizer.encode("cart")) is Match.COMPLETE


def test_a_json_mask_allows_exactly_the_tokens_the_matcher_accepts(
    compiler: GrammarCompiler, tokenizer: Any
) -> None:
    """Along a valid document, the mask's tokens are those that a copy of the matcher
    consumes (tried one by one), EOS included only at the end."""
    grammar = compiler.compile(S(json=OBJECT, disable_any_whitespace=True))
    document = tokenizer.encode('{"a":12,"b":"hi","c":"yy"}')
    vocab = len(tokenizer)
    eos = tokenizer.eos_token_id
    for i in [*range(0, len(document), 3), len(document)]:
        matcher = grammar.matcher()
        assert matcher.consume_tokens(document[:i])
        mask = matcher.compute_bitmask()
        accepted = set()
        for token in range(vocab):
            trial = matcher.deep_copy()
            if trial.consume_token(token) and not trial.is_error():
                accepted.add(token)
        assert _allowed(mask, vocab) == accepted, i
        assert (eos in accepted) == (i == len(document))


@pytest.fixture(scope="module")
def added_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The tiny tokenizer with Qwen2.5's tool-call tags added as ordinary (non-special)
    tokens, as Qwen2.5's own tokenizer has them: one token each for the whole tag."""
    from pagedllm.testing import make_tiny_tokenizer

    tokenizer = make_tiny_tokenizer(tmp_path_factory.mktemp("added"))
    tokenizer.add_tokens(["<tool_call>", "</tool_call>"])
    return tokenizer


@pytest.mark.parametrize(
    ("params", "text"),
    [(S(regex="<tool_call>[a-z]{1,3}</tool_call>"), "<tool_call>ab</tool_call>"),
     (S(choice=["<tool_call>", "<tool"]), "<tool_call>"),
     (S(json={"enum": ["<tool_call>x"]}), '"<tool_call>x"'),
     (S(regex=r"<\|im_start\|>[a-z]"), "<|im_start|>q")],
    ids=["regex", "choice", "json", "special-text"],
)  # fmt: skip
def test_a_spec_that_spells_an_added_token_takes_it_or_its_bytes(
    added_tokenizer: Any, params: StructuredOutputsParams, text: str
) -> None:
    """An added token's text in a grammar: every token the mask offers is consumed (the
    bug: the whole-tag token was offered, then refused), the added token itself and its
    text spelled byte by byte both reach the end. A special token's text (``<|im_start|>``)
    is text: its bytes, never the special token."""
    tokenizer = added_tokenizer
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    try:
        grammar = compiler.compile(params)
    finally:
        compiler.close()
    spelled = list(text.encode())  # one token per byte
    as_added = tokenizer.encode(text)  # the tags as one token each
    special = tokenizer.convert_tokens_to_ids("<|im_start|>")
    if special in as_added:
        assert not grammar.matcher().consume_token(special)
        as_added = spelled
    else:
        assert len(as_added) < len(spelled)
    for tokens in (as_added, spelled):
        matcher = grammar.matcher()
        for i, token in enumerate(tokens):
            mask = matcher.compute_bitmask()
            offered = _allowed(mask, len(tokenizer))
            for other in offered:
                assert matcher.deep_copy().consume_token(other), (text, i, other)
            assert matcher.consume_token(token), (text, i, matcher.get_error())
        assert tokenizer.eos_token_id in _allowed(matcher.compute_bitmask(), len(tokenizer))
    assert special not in _allowed(grammar.matcher().compute_bitmask(), len(tokenizer))


def test_a_matcher_is_rebuilt_from_the_output_tokens(compiler: GrammarCompiler) -> None:
    grammar = compiler.compile(S(regex="[ab]{4}"))
    matchers = SequenceMatchers()
    assert matchers.advance("child", [97], grammar) is Match.RUNNING  # made, then fed
    assert matchers.advance("child", [97, 98]) is Match.RUNNING
    assert matchers.advance("child", [98]) is Match.RUNNING  # shorter: rebuilt, not guessed
    assert matchers.advance("child", [98, 99]) is Match.REJECTED  # "c" is not allowed
    assert "child" in matchers
    matchers.release(["child"])
    assert len(matchers) == 0


# ---------------------------------------------------------------- the engine


def _texts(engine: LLMEngine) -> dict[str, list[tuple[str, str]]]:
    return {
        rid: [(c.text, c.finish_reason) for c in out.outputs]
        for rid, out in run_all(engine).items()
    }


@pytest.mark.parametrize("use_sampler", [False, True], ids=["deterministic", "sampled"])
def test_greedy_sampled_and_n_outputs_match_their_grammar(
    grammar_engine: Callable[..., LLMEngine], use_sampler: bool
) -> None:
    engine = grammar_engine(use_sampler=use_sampler)
    temperature = 1.0 if use_sampler else 0.0
    engine.add_request("json", "hello", SamplingParams(
        n=3, temperature=temperature, seed=1, max_tokens=100,
        structured_outputs=S(json=OBJECT, disable_any_whitespace=True),
    ))  # fmt: skip
    engine.add_request("choice", "hi", SamplingParams(max_tokens=30, structured_outputs=S(
        choice=["yes", "no"])))  # fmt: skip
    engine.add_request("regex", "hi", SamplingParams(max_tokens=30, structured_outputs=S(
        regex=r"[a-c]{3}@x\.com")))  # fmt: skip
    engine.add_request("free", "hi", SamplingParams(max_tokens=5))  # unconstrained beside
    texts = _texts(engine)
    for text, reason in texts["json"]:
        value = json.loads(text)
        assert reason == "stop" and set(value) == {"a", "b", "c"} and value["c"] in ("x", "yy")
    assert texts["choice"][0][0] in ("yes", "no") and texts["choice"][0][1] == "stop"
    assert texts["regex"][0][0].endswith("@x.com") and texts["regex"][0][1] == "stop"
    assert texts["free"][0][1] == "length"
    assert len(engine.structured.matchers) == 0


def test_preemption_and_swap_keep_the_matcher(grammar_engine: Callable[..., LLMEngine]) -> None:
    """A cache too small for all: requests are preempted (recompute and swap) and resumed;
    each ends with the tokens it has alone."""
    params = SamplingParams(
        temperature=0.0,
        max_tokens=60,
        structured_outputs=S(json=OBJECT, disable_any_whitespace=True),
    )
    alone = grammar_engine()
    alone.add_request("0", "prompt 0", params)
    expected = _texts(alone)["0"]
    for mode, host in (("recompute", 0), ("swap", 64)):
        engine = grammar_engine(
            num_blocks=24, host_blocks=host, preemption_mode=mode, max_model_len=96
        )
        for i in range(6):
            engine.add_request(str(i), f"prompt {i}", params)
        texts = _texts(engine)
        assert engine.get_stats().num_preemptions > 0, mode
        assert texts["0"] == expected
        for outputs in texts.values():
            json.loads(outputs[0][0])


def test_multi_step_leaves_constrained_requests_to_single_steps(
    grammar_engine: Callable[..., LLMEngine],
) -> None:
    engine = grammar_engine(num_scheduler_steps=4)
    engine.add_request("c", "x", SamplingParams(temperature=0.0, max_tokens=40,
                                                structured_outputs=S(choice=["alpha", "beta"])))  # fmt: skip
    engine.add_request("free", "x", SamplingParams(temperature=0.0, max_tokens=8))
    texts = _texts(engine)
    assert texts["c"] == [(texts["c"][0][0], "stop")] and texts["c"][0][0] in ("alpha", "beta")


def test_a_compile_never_holds_up_a_step(
    grammar_engine: Callable[..., LLMEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a grammar compiles, the other requests keep stepping; the constrained one
    is admitted once it is ready. Aborting one that waits leaves nothing behind."""
    engine = grammar_engine()
    gate = threading.Event()
    compile_grammar = GrammarCompiler._compile

    def slow(self: GrammarCompiler, key: str, params: StructuredOutputsParams) -> Any:
        gate.wait(10)
        return compile_grammar(self, key, params)

    monkeypatch.setattr(GrammarCompiler, "_compile", slow)
    engine.add_request("free", "x", SamplingParams(temperature=0.0, max_tokens=6))
    engine.add_request("c", "x", SamplingParams(max_tokens=20, structured_outputs=S(
        choice=["alpha", "beta"])))  # fmt: skip
    engine.add_request("gone", "x", SamplingParams(max_tokens=20, structured_outputs=S(
        regex="[0-9]+")))  # fmt: skip
    finished = {}
    for _ in range(7):
        started = time.perf_counter()
        for output in engine.step():
            finished[output.request_id] = output.finished
        assert time.perf_counter() - started < 0.5
    assert finished.get("free") and "c" not in finished
    engine.abort_request("gone")
    gate.set()
    texts = _texts(engine)
    assert texts["c"][0][0] in ("alpha", "beta")
    assert len(engine.structured.matchers) == 0 and not engine.structured.compiling


def test_a_refused_grammar_is_a_value_error_and_leaks_nothing(
    grammar_engine: Callable[..., LLMEngine],
) -> None:
    engine = grammar_engine()
    llm = LLM.from_engine(engine)
    bad = SamplingParams(structured_outputs=S(json={"type": "object", "not": {}}))
    with pytest.raises(ValueError, match=r'structured_outputs.json: .*"not" at /'):
        llm.generate(["a", "b"], bad, use_tqdm=False)
    assert not engine.has_unfinished_requests() and len(engine.structured.matchers) == 0
    with pytest.raises(ValueError, match="structured_outputs.json"):
        engine.add_request("x", "a", bad)  # compiled before: refused at once
    assert not engine.has_unfinished_requests()


def test_aborts_release_blocks_and_matchers(grammar_engine: Callable[..., LLMEngine]) -> None:
    engine = grammar_engine()
    params = SamplingParams(n=2, temperature=1.0, max_tokens=80,
                            structured_outputs=S(json=OBJECT, disable_any_whitespace=True))  # fmt: skip
    for i in range(4):
        engine.add_request(str(i), "go", params)
    for _ in range(5):
        engine.step()
    assert len(engine.structured.matchers) > 0
    engine.abort_request([str(i) for i in range(4)])
    assert len(engine.structured.matchers) == 0 and not engine.has_unfinished_requests()
    assert engine.kv.stats().blocks_used == 0


def test_without_a_tokenizer_structured_outputs_are_refused() -> None:
    engine = LLMEngine(EngineConfig(block_size=4, max_model_len=64), FakeModelRunner(16, 4))
    with pytest.raises(ValueError, match="needs a tokenizer"):
        engine.add_request("x", [1, 2], SamplingParams(structured_outputs=S(regex="a")))
    assert not engine.has_unfinished_requests()


def test_beam_search_keeps_a_matcher_per_beam(grammar_engine: Callable[..., LLMEngine]) -> None:
    engine = grammar_engine(use_sampler=True)
    choices = ["alpha", "beta", "gamma delta"]
    params = BeamSearchParams(beam_width=3, max_tokens=30, structured_outputs=S(choice=choices))
    (result,) = beam_search(engine, ["hello"], params)
    assert sorted(s.text for s in result.sequences) == sorted(choices)
    assert all(s.finish_reason == "stop" for s in result.sequences)
    assert len(engine.structured.matchers) == 0
