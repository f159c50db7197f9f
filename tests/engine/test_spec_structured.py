"""Speculative decoding under structured outputs: each scored position is masked by the
grammar after the drafts before it, drafts the grammar refuses (or that would end it
before the last) are never verified, and the outputs are those without drafts."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from pagedllm.engine.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams
from pagedllm.worker.fake_runner import FakeModelRunner

from .conftest import run_all
from .test_spec_decode_engine import ScriptedProposer

S = StructuredOutputsParams
OBJECT = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 5}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "automatic": False}


@pytest.fixture
def engine_of(tokenizer: Any, engines: list[LLMEngine]) -> Callable[..., LLMEngine]:
    def build(use_sampler: bool, **config: Any) -> LLMEngine:
        runner = FakeModelRunner(64, 4, vocab_size=len(tokenizer), use_sampler=use_sampler)
        engine = LLMEngine(
            EngineConfig(block_size=4, max_model_len=256, **config), runner, tokenizer
        )
        engines.append(engine)
        return engine

    return build


def requests(engine: LLMEngine, temperature: float) -> dict[str, Any]:
    engine.add_request("json", "hello", SamplingParams(
        n=2, temperature=temperature, seed=1, max_tokens=80,
        structured_outputs=S(json=OBJECT, disable_any_whitespace=True),
    ))  # fmt: skip
    engine.add_request("regex", "hi", SamplingParams(
        temperature=temperature, seed=2, max_tokens=30,
        structured_outputs=S(regex=r"[a-c]{6}@x\.com"),
    ))  # fmt: skip
    engine.add_request("free", "hi", SamplingParams(temperature=temperature, max_tokens=12))
    return run_all(engine)


@pytest.mark.parametrize("use_sampler", [False, True], ids=["greedy", "seeded"])
def test_drafts_under_a_grammar_give_the_same_outputs(engine_of, use_sampler) -> None:
    temperature = 1.0 if use_sampler else 0.0
    plain = requests(engine_of(use_sampler), temperature)
    reference = {
        f"{rid}#{c.index}" if c.index else rid: tuple(c.token_ids)
        for rid, out in plain.items()
        for c in out.outputs
    }
    engine = engine_of(use_sampler, speculative_config=SPEC)
    # Known continuations, every third guess spoiled, and junk past each output's end (a
    # draft that would run past a complete grammar must never be verified).
    extended = {rid: (*tokens, *tokens) for rid, tokens in reference.items()}
    engine.speculator.proposer = ScriptedProposer(extended, len(engine.tokenizer))
    got = requests(engine, temperature)
    if use_sampler:  # the "free" request is unseeded: its draws may differ
        got.pop("free"), plain.pop("free")
    for rid, out in plain.items():
        assert [(c.text, c.token_ids, c.finish_reason) for c in got[rid].outputs] == [
            (c.text, c.token_ids, c.finish_reason) for c in out.outputs
        ]
    for c in got["json"].outputs:
        assert set(json.loads(c.text)) == {"a", "b"}
    assert got["regex"].outputs[0].text.endswith("@x.com")
    stats = engine.get_stats().speculative
    assert stats.num_accepted_tokens > 0
    assert len(engine.structured.matchers) == 0
