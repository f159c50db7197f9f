"""Multi-step decoding (``num_scheduler_steps``): the same tokens, finish reasons and cache
state as one step per schedule, with several decode steps per schedule where it applies."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
import torch

from pagedllm.core.outputs import ScheduledSequence, SchedulerOutput
from pagedllm.engine.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.fake_runner import FakeModelRunner
from pagedllm.worker.input_batch import (
    build_input_batch,
    build_input_batch_reference,
    later_decode_steps,
)
from tests.engine.conftest import run_all

BASE = dict(block_size=4, max_model_len=64, num_blocks=256)


def record_steps(engine: LLMEngine) -> list[int]:
    """The ``num_steps`` of every output the runner executes from now on."""
    seen: list[int] = []
    execute = engine.runner.execute

    def recording(output: SchedulerOutput):
        seen.append(output.num_steps)
        return execute(output)

    engine.runner.execute = recording
    return seen


def run(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]]) -> dict[str, Any]:
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(str(i), prompt, params)
    final = run_all(engine)
    return {
        rid: [(c.token_ids, c.finish_reason, c.stop_reason, c.text) for c in out.outputs]
        for rid, out in final.items()
    }


def mixed_requests(stop_token: int | None = None) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(11)
    requests = []
    for i in range(7):
        prompt = [rng.randrange(256) for _ in range(rng.randint(1, 20))]
        stop = (stop_token,) if stop_token is not None and i % 2 else ()
        params = SamplingParams(
            temperature=0, max_tokens=rng.randint(1, 23), ignore_eos=True, stop_token_ids=stop
        )
        requests.append((prompt, params))
    return requests


def test_same_tokens_as_single_steps_with_stops_inside_a_window(
    model_engine: Callable[..., LLMEngine],
) -> None:
    single = run(model_engine(**BASE), mixed_requests())
    # A token that the odd requests generate a few tokens in: their stop lands mid-window.
    stop_token = next(
        tokens[3]
        for rid, [(tokens, *_)] in sorted(single.items())
        if int(rid) % 2 and len(tokens) > 6
    )
    single = run(model_engine(**BASE), mixed_requests(stop_token))
    assert any(c[0][1] == "stop" for c in single.values())
    engine = model_engine(**BASE, num_scheduler_steps=5)
    seen = record_steps(engine)
    multi = run(engine, mixed_requests(stop_token))
    assert multi == single
    assert max(seen) == 5 and seen.count(1) >= 1  # prompts ran as ordinary steps
    # Fewer runner calls than model steps: several decode steps per schedule.
    assert len(seen) < sum(seen)
    assert engine.get_stats().num_steps == sum(seen)


def test_prefix_cache_registers_the_blocks_filled_in_a_window(
    model_engine: Callable[..., LLMEngine],
) -> None:
    """Blocks made full by tokens generated several steps per schedule are hashed and
    found again: a second request whose prompt is the first one's full output hits them."""
    engine = model_engine(**BASE, num_scheduler_steps=6)
    params = SamplingParams(temperature=0, max_tokens=17, ignore_eos=True)
    first = run(engine, [([5, 6, 7], params)])
    tokens = [5, 6, 7, *first["0"][0][0]]
    engine.add_request("again", tokens, SamplingParams(temperature=0, max_tokens=2))
    run_all(engine)
    # 20 tokens: 4 full blocks of 4 of the first request's cache, the last held back for
    # the recomputed final prompt token.
    assert engine.get_stats().cache.prefix_hits_tokens == 16


def test_sampling_or_stop_strings_keep_one_step_per_schedule(
    model_engine: Callable[..., LLMEngine],
) -> None:
    requests = [
        ([1, 2, 3], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)),
        ([4, 5], SamplingParams(temperature=0.8, seed=3, max_tokens=8, ignore_eos=True)),
    ]
    single = run(model_engine(**BASE), requests)
    engine = model_engine(**BASE, num_scheduler_steps=4)
    seen = record_steps(engine)
    assert run(engine, requests) == single
    # One step per schedule while the sampled request runs, several after it ends (no).
    assert set(seen) == {1}
    engine = model_engine(**BASE, num_scheduler_steps=4)
    seen = record_steps(engine)
    stop_text = [([1, 2, 3], SamplingParams(temperature=0, max_tokens=8, stop=["zz"]))]
    run(engine, stop_text)
    assert set(seen) == {1}


def test_a_waiting_request_is_admitted_at_the_next_schedule(
    model_engine: Callable[..., LLMEngine],
) -> None:
    engine = model_engine(**BASE, num_scheduler_steps=8)
    seen = record_steps(engine)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    engine.add_request("a", [1, 2, 3], params)
    engine.step()  # the prompt
    engine.add_request("b", [4, 5, 6], params)
    engine.step()  # b waits: an ordinary step admits it
    assert seen == [1, 1]
    run_all(engine)
    assert max(seen) == 8


def test_later_decode_steps_equal_building_each_advanced_step() -> None:
    rng = random.Random(1)
    block_size = 4
    seqs = []
    for i in range(5):
        start = rng.randint(0, 30)
        table = tuple(rng.sample(range(100), (start + 6) // block_size + 1))
        seqs.append(ScheduledSequence(f"r{i}", (rng.randrange(50),), start, table, 1))
    later = later_decode_steps(build_input_batch(seqs, block_size), 6, block_size)
    assert len(later) == 5
    for j, (positions, meta) in enumerate(later, start=1):
        # The plain construction of step j: every sequence j tokens further.
        advanced = [
            ScheduledSequence(s.request_id, (0,), s.start_position + j, s.block_table, 1)
            for s in seqs
        ]
        want = build_input_batch_reference(advanced, block_size)
        assert positions.dtype == want.positions.dtype and torch.equal(positions, want.positions)
        for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
            a, b = getattr(meta, name), getattr(want.meta, name)
            assert a.dtype == b.dtype and torch.equal(a, b), name
        for name in ("query_lens_list", "seq_lens_list", "max_query_len", "max_seq_len"):
            assert getattr(meta, name) == getattr(want.meta, name), name


def test_runner_refuses_what_multi_step_does_not_take(
    model_engine: Callable[..., LLMEngine],
) -> None:
    runner = model_engine(**BASE).runner
    greedy = SamplingParams(temperature=0)
    short = ScheduledSequence("a", (1,), 3, (0,), 1, greedy)  # 4 slots: position 3 only
    with pytest.raises(ValueError, match="cannot hold 2 steps"):
        runner.execute(SchedulerOutput(scheduled=(short,), num_steps=2))
    sampled = ScheduledSequence("b", (1,), 0, (0,), 1, SamplingParams(temperature=1.0))
    with pytest.raises(ValueError, match="plain greedy"):
        runner.execute(SchedulerOutput(scheduled=(sampled,), num_steps=2))
    chunk = ScheduledSequence("c", (1, 2), 0, (0,), 1, greedy)
    with pytest.raises(ValueError, match="one-token decodes"):
        runner.execute(SchedulerOutput(scheduled=(chunk,), num_steps=2))


def test_config_refuses_bad_step_counts_and_runners_without_multi_step(tokenizer: Any) -> None:
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        EngineConfig(num_scheduler_steps=0)
    sampling = FakeModelRunner(16, 4, vocab_size=len(tokenizer), use_sampler=True)
    with pytest.raises(ValueError, match="num_scheduler_steps=4 needs a runner"):
        LLMEngine(EngineConfig(block_size=4, num_scheduler_steps=4), sampling, tokenizer)


def test_fake_runner_multi_step_matches_single_steps(
    fake_engine: Callable[..., LLMEngine],
) -> None:
    """The fake runner's multi-step (what the server tests stream through) checks every
    step's context through the block tables, as its single steps do."""
    requests = mixed_requests()
    single = run(fake_engine(num_blocks=64, block_size=4), requests)
    engine = fake_engine(num_blocks=64, block_size=4, num_scheduler_steps=3)
    seen = record_steps(engine)
    assert run(engine, requests) == single
    assert max(seen) == 3
