"""The multi-replica simulator: real schedulers and block managers behind the router."""

from __future__ import annotations

import json

import pytest

from pagedllm.planner.replicas import (
    RouterSimConfig,
    read_routed_trace,
    shared_prefix_workload,
    simulate_router,
)


def test_prefix_aware_doubles_round_robin_hits_and_predicts_them():
    requests = shared_prefix_workload(8, 12, 256, 32, 8, arrival_rate=20.0)
    results = {
        policy: simulate_router(requests, RouterSimConfig(4, policy, num_blocks=60))
        for policy in ("prefix_aware", "round_robin", "least_loaded", "oracle")
    }
    aware, rr, oracle = results["prefix_aware"], results["round_robin"], results["oracle"]
    assert aware.hit_rate >= 2 * rr.hit_rate
    assert aware.hit_rate >= 0.95 * oracle.hit_rate
    assert abs(aware.predicted_cached_tokens - aware.cached_tokens) <= 0.05 * aware.cached_tokens
    assert sum(aware.requests_per_replica) == len(requests) == aware.num_requests


def test_trace_with_hash_ids(tmp_path):
    path = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 1000, "output_length": 2, "hash_ids": [0, 1]},
        {"timestamp": 10, "input_length": 1024, "output_length": 2, "hash_ids": [0, 1]},
        {"timestamp": 20, "prompt_token_ids": [5, 6, 7], "output_length": 1},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    requests = read_routed_trace(path, tokens_per_hash=32)
    assert len(requests[0].prompt_token_ids) == round(1000 * 32 / 512)
    assert requests[1].prompt_token_ids[:62] == requests[0].prompt_token_ids[:62]
    assert requests[2].prompt_token_ids == (5, 6, 7) and requests[2].arrival_time == 0.02
    result = simulate_router(requests, RouterSimConfig(2, "prefix_aware", num_blocks=64))
    assert result.cached_tokens == 48  # request 2 finds request 1's three full blocks
    path.write_text('{"timestamp": 0}')
    with pytest.raises(ValueError, match="t.jsonl:1"):
        read_routed_trace(path)
