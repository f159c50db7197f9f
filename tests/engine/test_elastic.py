"""The elastic KV pool through the engine: resizes in the middle of generation change no
token; reports say what happened; the automatic policy grows and shrinks."""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from typing import Any

import pytest

from pagedllm.engine.elastic import ElasticPolicy, LoadView
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams
from tests.engine.conftest import run_all, run_with_resizes
from tests.engine.test_engine_fake import reference

BLOCK_BYTES = 4096  # FakeModelRunner's default kv_block_bytes


@pytest.mark.parametrize("seed", range(int(os.environ.get("PAGEDLLM_FUZZ_SEEDS", "10"))))
def test_random_resize_schedules_change_no_token(
    seed: int, fake_engine: Callable[..., LLMEngine], tokenizer: Any
) -> None:
    """Random arrivals, shrinks (sliced between steps, sometimes preempting) and grows:
    every finished completion equals the cache-free reference (the fake runner also
    raises at once if a context read back through a block table is wrong)."""
    rng = random.Random(seed)
    engine = fake_engine(
        num_blocks=rng.choice([24, 40, 64]),
        block_size=rng.choice([2, 4]),
        preemption_mode=rng.choice(["recompute", "swap", "auto"]),
        host_blocks=rng.choice([0, 30]),
        max_num_batched_tokens=rng.choice([8, 64]),
        max_model_len=40,
        compaction_step_fraction=rng.choice([0.01, 0.2, 5.0]),
    )
    stems = ["shared system words ", "other ", ""]
    expected: dict[str, tuple[list[int], int, int]] = {}
    reports = []
    for step in range(3000):
        if step < 80 and rng.random() < 0.3:
            rid = f"r{step}"
            ids = tokenizer.encode(rng.choice(stems) + "abc"[: rng.randint(1, 3)])[:20]
            max_tokens, n = rng.randint(1, 40 - len(ids)), rng.choice([1, 1, 2])
            try:
                engine.add_request(rid, ids, SamplingParams(max_tokens=max_tokens, n=n))
            except ValueError as exc:  # larger than the pool has become
                assert "KV blocks" in str(exc)
                continue
            expected[rid] = (ids, max_tokens, n)
        if step < 120 and rng.random() < 0.08:
            blocks = rng.randint(10, 80)
            engine.elastic.start(
                blocks * BLOCK_BYTES, preempt=rng.random() < 0.3, on_done=reports.append
            )
        for output in engine.step():
            if output.finished:
                ids, max_tokens, n = expected.pop(output.request_id)
                assert output.error is None
                for c in output.outputs:
                    assert list(c.token_ids) == reference(engine.runner, ids, max_tokens, c.index)
        engine.kv.check_invariants()
        assert engine.runner.num_blocks >= engine.kv.num_blocks
        if step >= 120 and not engine.has_unfinished_requests():
            break
    assert not expected and not engine.has_unfinished_requests()
    assert reports, "no resize ran"
    for report in reports:
        assert report.bytes_returned == (report.blocks_before - report.blocks_after) * BLOCK_BYTES
        if report.limited_by is None:
            assert report.blocks_after == report.blocks_requested
    assert engine.runner.num_blocks == engine.kv.num_blocks


def _prompt_blocks(engine: LLMEngine, prompts: list[list[int]]) -> None:
    for i, ids in enumerate(prompts):
        engine.add_request(f"p{i}", ids, SamplingParams(max_tokens=1))
    run_all(engine)


def test_cached_prefixes_survive_shrink_and_grow_while_they_fit(
    fake_engine: Callable[..., LLMEngine],
) -> None:
    engine = fake_engine(num_blocks=64, block_size=4)
    prompts = [[10 + i] * 12 + [1] for i in range(4)]  # 3 full blocks each
    _prompt_blocks(engine, prompts)
    cached = engine.kv.stats().blocks_cached_free
    assert cached == 12
    report = engine.elastic.resize(16 * BLOCK_BYTES)
    assert (report.blocks_before, report.blocks_after, report.blocks_requested) == (64, 16, 16)
    assert report.cached_blocks_before == report.cached_blocks_kept == 12
    assert report.cached_blocks_dropped == 0 and report.limited_by is None
    assert report.bytes_returned == 48 * BLOCK_BYTES
    assert engine.runner.num_blocks == engine.kv.num_blocks == 16
    grown = engine.elastic.resize(40 * BLOCK_BYTES)
    assert (grown.blocks_after, grown.bytes_returned) == (40, -24 * BLOCK_BYTES)
    # Every prompt is still a prefix hit, and its tokens are still right.
    for i, ids in enumerate(prompts):
        engine.add_request(f"again{i}", ids, SamplingParams(max_tokens=3))
    final = run_all(engine)
    for i, ids in enumerate(prompts):
        assert final[f"again{i}"].num_cached_tokens == 12
        assert list(final[f"again{i}"].outputs[0].token_ids) == reference(engine.runner, ids, 3)
    # Smaller than the cache: the least recently used prefixes go, the rest stay.
    report = engine.elastic.resize(7 * BLOCK_BYTES)
    assert report.blocks_after == 7 and report.cached_blocks_dropped == 5
    assert report.cached_blocks_kept == 7


def test_shrink_below_running_requests_stops_there_unless_asked_to_preempt(
    fake_engine: Callable[..., LLMEngine], tokenizer: Any
) -> None:
    engine = fake_engine(num_blocks=64, block_size=4, max_model_len=64)
    prompts = [tokenizer.encode(f"request number {i} says") for i in range(4)]
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, SamplingParams(max_tokens=20))
    for _ in range(3):
        engine.step()
    held = engine.kv.pool.num_used_blocks
    report = engine.elastic.resize(4 * BLOCK_BYTES)
    assert report.blocks_after == held + 4 and report.num_preempted == 0
    assert "running requests hold" in report.limited_by
    assert engine.get_stats().num_preemptions == 0
    report = engine.elastic.resize(12 * BLOCK_BYTES, preempt=True)
    assert report.num_preempted > 0 and report.blocks_after <= 16
    final = run_all(engine)
    for i, ids in enumerate(prompts):
        assert list(final[str(i)].outputs[0].token_ids) == reference(engine.runner, ids, 20)


def test_resize_rejects_bad_sizes(fake_engine: Callable[..., LLMEngine]) -> None:
    engine = fake_engine(num_blocks=16)
    with pytest.raises(ValueError, match="less than one block"):
        engine.elastic.resize(100)
    with pytest.raises(TypeError):
        engine.elastic.resize("1GiB")  # type: ignore[arg-type]
    assert engine.kv.num_blocks == 16


def test_automatic_mode_grows_under_load_and_shrinks_when_idle(
    fake_engine: Callable[..., LLMEngine], tokenizer: Any
) -> None:
    engine = fake_engine(
        num_blocks=8,
        block_size=4,
        max_model_len=64,
        kv_cache_memory=8 * BLOCK_BYTES,
        kv_cache_memory_max=64 * BLOCK_BYTES,
        elastic_idle_s=0.0,
    )
    prompts = [tokenizer.encode(f"a longer request {i} to fill the pool") for i in range(6)]
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, SamplingParams(max_tokens=16))
    final = run_all(engine)
    stats = engine.get_stats().elastic
    assert stats.num_grows >= 1 and stats.max_blocks == 64 and stats.min_blocks == 8
    assert max(e.blocks_after for e in stats.events) > 8
    for i, ids in enumerate(prompts):
        assert list(final[str(i)].outputs[0].token_ids) == reference(engine.runner, ids, 16)
    engine.elastic.idle_tick()  # idle: compact and shrink to what the prompt cache holds
    stats = engine.get_stats()
    packed = stats.cache.blocks_used + stats.cache.blocks_cached_free
    assert stats.cache.blocks_total == max(8, packed)
    assert stats.elastic.events[-1].kind == "shrink"


def test_policy_decisions() -> None:
    policy = ElasticPolicy(10, 50, idle_s=5.0)
    view = LoadView(
        num_blocks=10, num_used=9, num_cached=0, num_free=1, num_running=3, num_waiting=2,
        blocks_wanted=4, num_preemptions=0, idle=False,
    )  # fmt: skip
    assert policy.target(view, 0.0) == (20, "requests waiting for blocks")
    busy = LoadView(
        num_blocks=20, num_used=12, num_cached=3, num_free=5, num_running=3, num_waiting=0,
        blocks_wanted=0, num_preemptions=0, idle=False,
    )  # fmt: skip
    assert policy.target(busy, 1.0) is None
    idle = LoadView(
        num_blocks=20, num_used=0, num_cached=12, num_free=8, num_running=0, num_waiting=0,
        blocks_wanted=0, num_preemptions=0, idle=True,
    )  # fmt: skip
    assert policy.target(idle, 2.0) is None  # idle for 0 s
    assert policy.target(idle, 7.5) == (12, "idle for 5 s")
    preempting = LoadView(
        num_blocks=20, num_used=20, num_cached=0, num_free=0, num_running=3, num_waiting=1,
        blocks_wanted=1, num_preemptions=2, idle=False,
    )  # fmt: skip
    assert policy.target(preempting, 8.0) == (30, "preemption")
    with pytest.raises(ValueError):
        ElasticPolicy(10, 5)


def test_greedy_tokens_of_a_real_model_survive_resizes_mid_generation(
    model_engine: Callable[..., LLMEngine],
) -> None:
    """The tiny random Llama on the real runner (K/V copied between blocks, the arena's
    tail given back and grown again): token-identical to an undisturbed run."""
    prompts = [[(7 * i + j) % 90 + 3 for j in range(5 + 3 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=24, temperature=0.0)

    def run(resize: bool) -> list[tuple[int, ...]]:
        engine = model_engine(num_blocks=96, block_size=4, max_model_len=64)
        for i, ids in enumerate(prompts):
            engine.add_request(str(i), ids, params)
        schedule = {3: 40, 7: 96, 9: 30, 14: 120, 18: 36} if resize else {}
        final, _ = run_with_resizes(engine, schedule)
        if resize:
            assert engine.elastic.last_report is not None
            assert engine.runner.num_blocks == engine.kv.num_blocks
        return [tuple(final[str(i)].outputs[0].token_ids) for i in range(len(prompts))]

    assert run(resize=True) == run(resize=False)
