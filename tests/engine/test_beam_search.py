"""Beam search on the paged cache against a cache-free reference (transformers)."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedllm.engine.beam_search import BeamSearchOutput, beam_search, beam_search_score
from pagedllm.engine.config import EngineConfig
from pagedllm.engine.llm import LLM
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import BeamSearchParams, SamplingParams
from pagedllm.worker.fake_runner import FakeModelRunner

EOS = 256  # the tiny checkpoint's EOS


def reference_beam_search(
    model_dir: Path, prompt: list[int], params: BeamSearchParams
) -> list[tuple[list[int], float]]:
    """Straight from the definition: full forward passes over every beam, no cache."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    width, penalty = params.beam_width, params.length_penalty

    def score(c: tuple[list[int], float]) -> float:
        return beam_search_score(c[0], c[1], EOS, penalty)

    beams: list[tuple[list[int], float]] = [(list(prompt), 0.0)]
    completed = []
    for _ in range(params.max_tokens):
        candidates = []
        for tokens, cum in beams:
            with torch.no_grad():
                logits = model(torch.tensor([tokens])).logits[0, -1].float()
            top = torch.log_softmax(logits, dim=-1).topk(2 * width)
            for token, logprob in zip(top.indices.tolist(), top.values.tolist(), strict=True):
                candidate = (tokens + [token], cum + logprob)
                if token == EOS and not params.ignore_eos:
                    completed.append(candidate)
                else:
                    candidates.append(candidate)
        beams = sorted(candidates, key=score, reverse=True)[:width]
    completed += beams
    return sorted(completed, key=score, reverse=True)[:width]


def prompt_ids(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(length)]


@pytest.mark.parametrize("num_blocks", [256, 9])
def test_beams_match_the_reference_and_share_blocks(
    num_blocks: int, tiny_model_dir: Path, model_engine: Callable[..., LLMEngine]
) -> None:
    params = BeamSearchParams(beam_width=3, max_tokens=8, length_penalty=0.7)
    prompts = [prompt_ids(1, 10), prompt_ids(2, 5)]
    engine = model_engine(block_size=4, num_blocks=num_blocks, max_model_len=36)
    samples: list[tuple[int, int]] = []

    def watch(e: LLMEngine) -> None:
        held_alone = sum(len(t) for t in e.kv.live_block_tables().values())
        samples.append((e.kv.stats().blocks_used, held_alone))
        e.kv.check_invariants()

    outputs = beam_search(engine, prompts, params, on_step=watch)
    for prompt, output in zip(prompts, outputs, strict=True):
        expected = reference_beam_search(tiny_model_dir, prompt, params)
        assert [list(s.tokens) for s in output.sequences] == [t for t, _ in expected]
        for seq, (_, cum) in zip(output.sequences, expected, strict=True):
            assert seq.cum_logprob == pytest.approx(cum, abs=1e-3)
            assert seq.output_token_ids == seq.tokens[len(prompt) :]
    # Beams share the blocks of their common prefix: fewer blocks than held alone.
    assert all(used <= alone for used, alone in samples)
    assert max(u for u, _ in samples) < max(a for _, a in samples)
    if num_blocks == 9:
        assert engine.get_stats().num_preemptions > 0


def test_llm_beam_search_and_validation(model_engine: Callable[..., LLMEngine]) -> None:
    engine = model_engine(block_size=4, num_blocks=64, max_model_len=40, max_num_seqs=4)
    llm = LLM.from_engine(engine)
    # max_num_seqs=4 with beam_width 2: two prompts per batch, three prompts in all.
    outs = llm.beam_search([prompt_ids(i, 6) for i in range(3)], BeamSearchParams(2, 4))
    assert [len(o.sequences) for o in outs] == [2, 2, 2]
    assert all(o.sequences[0].score >= o.sequences[1].score for o in outs)
    with pytest.raises(ValueError, match="beam_width"):
        llm.beam_search([prompt_ids(0, 6)], BeamSearchParams(5, 4))
    with pytest.raises(ValueError, match="max_model_len"):
        llm.beam_search([prompt_ids(0, 38)], BeamSearchParams(2, 4))
    with pytest.raises(ValueError, match="beam_width must be at least 1"):
        BeamSearchParams(0, 4)


def test_a_failing_beam_fails_the_search_and_frees_every_block() -> None:
    # "__beam-2" is a child of the first round: the step that runs it raises, the engine
    # retries its sequences alone and fails that one (failure isolation), the search stops.
    runner = FakeModelRunner(64, 4, use_sampler=True, fail_request_ids={"__beam-2"})
    engine = LLMEngine(EngineConfig(block_size=4, max_model_len=64), runner)
    with pytest.raises(RuntimeError, match="__beam-2.*InjectedFailure"):
        beam_search(engine, [prompt_ids(3, 9)], BeamSearchParams(beam_width=3, max_tokens=6))
    assert not engine.has_unfinished_requests() and not engine.scheduler.requests
    assert engine.kv.stats().blocks_used == 0
    engine.kv.check_invariants()
    # The engine serves on: another search (its ids fail no more) and a plain request.
    runner.fail_request_ids.clear()
    (output,) = beam_search(engine, [prompt_ids(3, 9)], BeamSearchParams(3, 6))
    assert len(output.sequences) == 3
    engine.add_request("plain", prompt_ids(4, 5), SamplingParams(max_tokens=3))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv.stats().blocks_used == 0


def test_the_speculator_never_drafts_for_beams() -> None:
    # Three tokens in all and a repetitive prompt: the n-gram proposer finds a draft for
    # every beam, if it is asked.
    def search(**config: Any) -> tuple[LLMEngine, list[BeamSearchOutput]]:
        runner = FakeModelRunner(64, 4, use_sampler=True, allowed_token_ids=[7, 8, 9])
        engine = LLMEngine(EngineConfig(block_size=4, max_model_len=64, **config), runner)
        return engine, beam_search(engine, [[7, 8, 9] * 4], BeamSearchParams(3, 6))

    spec = {"method": "ngram", "prompt_lookup_min": 1, "num_speculative_tokens": 3}
    _, plain = search()
    engine, speculative = search(speculative_config={**spec, "automatic": False})
    assert speculative == plain
    stats = engine.get_stats().speculative
    assert stats is not None and stats.num_verifications == 0
