import math

import pytest

from pagedllm.core.traces import TRACE_KINDS, make_trace, trace_summary


def test_seeded_and_reproducible():
    assert make_trace("sharegpt", 20, seed=3) == make_trace("sharegpt", 20, seed=3)
    assert make_trace("sharegpt", 20, seed=3) != make_trace("sharegpt", 20, seed=4)


@pytest.mark.parametrize(
    ("kind", "mean_in", "mean_out"), [("sharegpt", 161, 338), ("alpaca", 19, 58)]
)
def test_means_near_the_papers(kind, mean_in, mean_out):
    summary = trace_summary(make_trace(kind, 4000, seed=0))
    assert summary["mean_input_len"] == pytest.approx(mean_in, rel=0.1)
    assert summary["mean_output_len"] == pytest.approx(mean_out, rel=0.1)


@pytest.mark.parametrize("kind", TRACE_KINDS)
def test_requests_fit_max_model_len(kind):
    for r in make_trace(kind, 500, seed=1, max_model_len=256, max_tokens_slack=2.0):
        assert r.num_prompt_tokens >= 1 and r.output_len >= 1
        assert r.output_len <= r.max_tokens
        assert r.num_prompt_tokens + r.max_tokens <= 256


def test_shared_prefix_and_poisson_arrivals():
    trace = make_trace(
        "uniform",
        400,
        seed=2,
        request_rate=20.0,
        shared_prefix_len=32,
        shared_prefix_fraction=0.5,
        n=4,
        input_range=(5, 10),
    )
    heads = [r.prompt_token_ids[:32] for r in trace if r.num_prompt_tokens > 32]
    shared = max(set(heads), key=heads.count)
    assert 0.35 < heads.count(shared) / len(trace) < 0.65
    times = [r.arrival_time for r in trace]
    assert times == sorted(times)
    assert trace_summary(trace)["duration_s"] == pytest.approx(400 / 20.0, rel=0.2)
    assert all(r.n == 4 for r in trace)
    assert all(r.arrival_time == 0.0 for r in make_trace("alpaca", 5, request_rate=math.inf))


def test_invalid_arguments():
    with pytest.raises(ValueError, match="kind"):
        make_trace("lmsys", 1)
    with pytest.raises(ValueError, match="shared_prefix_fraction"):
        make_trace("sharegpt", 1, shared_prefix_fraction=2.0)
    with pytest.raises(ValueError, match="input_range"):
        make_trace("uniform", 1, input_range=(5, 2))
