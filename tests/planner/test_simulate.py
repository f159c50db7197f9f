"""The trace simulator drives the real Scheduler and KVCacheManager; figures checked by hand."""

from __future__ import annotations

import pytest

from pagedllm.planner.capacity import cache_geometry, fixed_workload, max_concurrency
from pagedllm.planner.simulate import CostModel, SimulationConfig, simulate
from pagedllm.planner.workloads import TraceEntry


def _config(num_blocks: int, **overrides) -> SimulationConfig:
    return SimulationConfig(num_blocks=num_blocks, block_size=16, max_model_len=1024, **overrides)


def test_internal_waste_is_the_last_block_slack_step_by_step():
    # 20-token prompt, 3 outputs: after the prefill 2 blocks hold 20 tokens (12 slack),
    # then 21 (11 slack), then the request finishes and holds nothing.
    result = simulate([TraceEntry(20, 3)], _config(8))
    assert [p["internal_waste_tokens"] for p in result.timeline] == [12, 11, 0]
    assert result.num_steps == 3
    assert result.num_preemptions == 0
    # The cost model: 10 ms + 0.05 ms per token; steps of 20, 1 and 1 tokens.
    times = [p["time"] for p in result.timeline]
    assert times[1] - times[0] == pytest.approx(0.01005)
    assert times[2] - times[1] == pytest.approx(0.01005)
    assert result.duration_s == pytest.approx(times[2])


def test_admitted_concurrency_is_what_the_planner_predicts():
    # 64-token sequences (60 prompt + 4 output) take 4 blocks of 16; 20 blocks hold 5.
    entries = [TraceEntry(60, 4) for _ in range(12)]
    result = simulate(entries, _config(20, arrival_rate=1e6))
    predicted = max_concurrency(cache_geometry(20 * 16 * 100, 100, 16), fixed_workload(64), 1024)
    assert predicted.paged == 5
    assert result.peak_running == predicted.paged
    assert result.mean_running_saturated == pytest.approx(predicted.paged)
    assert result.num_preemptions == 0
    assert result.queue_delay_p99_s > 0  # the last ones waited for blocks
    assert result.num_requests == 12


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_admission_by_prompt_then_growth_preempts(mode):
    # Prompts take 1 block each, so 4 are admitted; 50 tokens need 4 blocks each (16 > 10).
    entries = [TraceEntry(10, 40) for _ in range(4)]
    result = simulate(
        entries, _config(10, arrival_rate=1e6, preemption_mode=mode, num_host_blocks=10)
    )
    assert result.peak_running == 4
    assert result.num_preemptions > 0
    assert result.preemptions_by_mode[mode] == result.num_preemptions
    assert any(p["preempted"] for p in result.timeline)
    # Under pressure, the paged pool still never refuses memory it has: no external waste.
    assert all(p["external_waste_tokens"] in (0, None) for p in result.timeline)


def test_duplication_measured_without_prefix_caching_every_member_holds_a_copy():
    # Three requests sharing a 20-token prompt, prefix caching off: 60 prompt tokens
    # stored for 20 distinct ones once all three run.
    entries = [TraceEntry(30, 500, "sys", 20) for _ in range(3)]
    config = _config(200, arrival_rate=5.0, cost=CostModel(10.0, 0.0), enable_prefix_caching=False)
    result = simulate(entries, config)
    three = [
        p for p in result.timeline if p["num_running"] == 3 and p["duplicated_tokens"] is not None
    ]
    assert three
    assert {p["duplicated_tokens"] for p in three} == {40}
    assert {p["shared_saved_tokens"] for p in three} == {0}


def test_duplication_measured_staggered_arrivals_share_full_blocks():
    # Arrivals ~0.2 s apart, each request decodes for ~5 s: later ones hit the cached
    # full block; only the 4-token partial prompt block is copied per extra member.
    entries = [TraceEntry(30, 500, "sys", 20) for _ in range(3)]
    result = simulate(entries, _config(200, arrival_rate=5.0, cost=CostModel(10.0, 0.0)))
    three = [
        p for p in result.timeline if p["num_running"] == 3 and p["duplicated_tokens"] is not None
    ]
    assert three
    assert {p["duplicated_tokens"] for p in three} == {8}
    assert {p["shared_saved_tokens"] for p in three} == {32}


def test_bad_inputs():
    with pytest.raises(ValueError, match="arrival-rate"):
        simulate([TraceEntry(10, 1)], _config(8, arrival_rate=0))
    with pytest.raises(ValueError, match="empty"):
        simulate([], _config(8))
    with pytest.raises(ValueError, match="max_model_len"):
        simulate([TraceEntry(2000, 1)], _config(8))
