"""Where the planner's lengths come from: JSONL traces and named distributions."""

from __future__ import annotations

import pytest

from pagedllm.planner.workloads import (
    TraceEntry,
    describe,
    read_trace,
    sample_distribution,
    trace_workload,
    write_trace,
)


def test_trace_round_trip_and_prefix_defaults(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(
        '{"prompt_tokens": 100, "output_tokens": 20}\n'
        "\n"
        '{"prompt_tokens": 300, "output_tokens": 5, "prefix_id": 7}\n'
        '{"prompt_tokens": 50, "output_tokens": 5, "prefix_id": "b", "prefix_tokens": 80}\n'
    )
    entries = read_trace(path, shared_prefix=200)
    assert entries == [
        TraceEntry(100, 20),
        TraceEntry(300, 5, "7", 200),  # prefix_tokens defaults to --shared-prefix
        TraceEntry(50, 5, "b", 50),  # never more than the prompt
    ]
    write_trace(tmp_path / "u.jsonl", entries)
    assert read_trace(tmp_path / "u.jsonl") == entries
    workload = trace_workload("t", entries)
    assert workload.lengths == (120, 305, 55)
    assert [workload.prefix_key(i) for i in range(3)] == [None, "7", "b"]
    assert describe(entries) == "mean 160 tokens (p50 120, p99 305, max 305)"


@pytest.mark.parametrize(
    "line",
    ['{"prompt_tokens": 10}', "not json", '{"prompt_tokens": 0, "output_tokens": 1}'],
)
def test_bad_trace_lines_name_the_line(tmp_path, line):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt_tokens": 1, "output_tokens": 1}\n' + line + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        read_trace(path)


def test_named_distributions_share_the_system_prompt_and_fit():
    entries = sample_distribution("sharegpt", 500, 2048, seed=1, shared_prefix=300)
    assert len(entries) == 500
    assert all(e.prefix_id == "system" and e.prefix_tokens == 300 for e in entries)
    assert all(e.prompt_tokens > 300 and e.num_tokens <= 2048 for e in entries)
    alpaca = sample_distribution("alpaca", 500, 2048, seed=1)
    mean = sum(e.num_tokens for e in alpaca) / len(alpaca)
    assert 50 < mean < 110  # Alpaca: 19 prompt + 58 output tokens on average
    assert sample_distribution("alpaca", 5, 2048, seed=3) == sample_distribution(
        "alpaca", 5, 2048, seed=3
    )
    with pytest.raises(ValueError, match="--dist"):
        sample_distribution("wikitext", 5, 2048)
    with pytest.raises(ValueError, match="--shared-prefix"):
        sample_distribution("sharegpt", 5, 256, shared_prefix=300)
