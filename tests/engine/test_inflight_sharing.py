"""A burst pays for its shared prefix once: the engine with in-flight sharing gives the
same tokens as the same requests sent one after another, and computes the prefix once."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams
from tests.engine.conftest import run_all

# One token a character: 76 tokens, 19 full blocks of 4, and every question differs from
# its first token, so only the prefix is shared (a shared partial block cannot be).
SYSTEM = "you are a helpful assistant. answer briefly, politely and in plain words.   "
QUESTIONS = [f"{c}{c}{c} is a question?" for c in "abcdefghijklmnopqrstuvwx"]  # 24


def burst(engine: LLMEngine, prompts: list[str], params: SamplingParams) -> dict[str, Any]:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    return run_all(engine)


def one_by_one(engine: LLMEngine, prompts: list[str], params: SamplingParams) -> dict[str, Any]:
    final = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
        final.update(run_all(engine))
    return final


def tokens(final: dict[str, Any]) -> dict[str, list[tuple[int, ...]]]:
    return {rid: [c.token_ids for c in out.outputs] for rid, out in final.items()}


@pytest.mark.parametrize("budget", [64, 2048])
def test_burst_computes_the_prefix_once_and_matches_one_by_one(
    fake_engine: Callable[..., LLMEngine], budget: int
) -> None:
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    prompts = [SYSTEM + q for q in QUESTIONS]
    config = {"num_blocks": 512, "max_num_batched_tokens": budget, "max_model_len": 256}
    alone = one_by_one(fake_engine(**config), prompts, params)
    engine = fake_engine(**config)
    together = burst(engine, prompts, params)
    assert tokens(together) == tokens(alone)
    prefix_blocks = len(engine.tokenize(SYSTEM)) // 4  # full blocks of the shared prefix
    cached = sum(out.num_cached_tokens for out in together.values())
    assert cached >= (len(prompts) - 1) * prefix_blocks * 4
    stats = engine.get_stats()
    assert stats.num_inflight_shared_tokens > 0
    # Prompt tokens computed: the prefix once, plus each request's own tail.
    computed_prompts = stats.num_computed_tokens - stats.num_generation_tokens
    off = fake_engine(enable_inflight_sharing=False, **config)
    burst(off, prompts, params)
    off_stats = off.get_stats()
    assert computed_prompts < off_stats.num_computed_tokens - off_stats.num_generation_tokens


def test_burst_duplication_waste_stays_low(fake_engine: Callable[..., LLMEngine]) -> None:
    """While the burst is in flight the shared blocks exist once (duplication ~ 0)."""
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    engine = fake_engine(num_blocks=512, max_num_batched_tokens=2048, max_model_len=256)
    assert len(engine.tokenize(SYSTEM)) % 4 == 0  # the prefix ends on a block boundary
    for i, q in enumerate(QUESTIONS):
        engine.add_request(f"r{i}", SYSTEM + q, params)
    peak = 0.0
    while engine.has_unfinished_requests():
        engine.step()
        waste = engine.get_stats().waste
        peak = max(peak, waste.duplication_fraction or 0.0)
    assert peak <= 0.02


def test_different_salts_never_share_in_flight(fake_engine: Callable[..., LLMEngine]) -> None:
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    engine = fake_engine(num_blocks=256, max_num_batched_tokens=2048, max_model_len=256)
    for i, q in enumerate(QUESTIONS[:4]):
        engine.add_request(f"r{i}", SYSTEM + q, params, cache_salt=f"tenant-{i}")
    final = run_all(engine)
    assert all(out.num_cached_tokens == 0 for out in final.values())
    assert engine.get_stats().num_inflight_waits == 0


def test_abort_of_the_first_request_mid_prefill_leaves_the_rest_whole(
    fake_engine: Callable[..., LLMEngine],
) -> None:
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    prompts = [SYSTEM + q for q in QUESTIONS[:6]]
    config = {"num_blocks": 256, "max_num_batched_tokens": 32, "max_model_len": 256}
    alone = one_by_one(fake_engine(**config), prompts, params)
    engine = fake_engine(**config)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    engine.step()  # r0 is part-way through the shared prefix
    engine.abort_request(["r0"])
    final = run_all(engine)
    del alone["r0"]
    assert "r0" not in final and tokens(final) == tokens(alone)


@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    heads=st.lists(st.integers(0, 3), min_size=2, max_size=8),
    budget=st.sampled_from([8, 24, 200]),
    block_size=st.sampled_from([1, 4, 16]),
)
def test_random_bursts_match_sharing_off(
    fake_engine: Callable[..., LLMEngine], heads: list[int], budget: int, block_size: int
) -> None:
    """Any mix of shared heads, budgets and block sizes: the same tokens with in-flight
    sharing on and off, every block returned (the autouse fixture checks)."""
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    stems = ["abc abc abc abc abc ", "abc abc xyz ", "hello there, ", "zz "]
    prompts = [stems[h] * 2 + str(i) for i, h in enumerate(heads)]
    config = {
        "num_blocks": 4096 // block_size,
        "block_size": block_size,
        "max_num_batched_tokens": budget,
        "max_model_len": 128,
    }
    on = burst(fake_engine(**config), prompts, params)
    off = burst(fake_engine(enable_inflight_sharing=False, **config), prompts, params)
    assert tokens(on) == tokens(off)
