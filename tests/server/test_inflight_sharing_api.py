"""In-flight sharing as a server user sees it: /v1/cache and /metrics count the prompt
tokens that requests arriving together did not compute twice."""

from __future__ import annotations

from pagedllm.sampling_params import SamplingParams


def test_cache_report_and_metrics_count_the_prefix_shared_in_flight(make_harness):
    h = make_harness(num_blocks=64, block_size=4)
    engine = h.llm  # the core thread idles (nothing sent to it yet): drive it directly
    prefix = "abcdefghijklmnopqrstuvwxyzabcdefghijklmn"  # 40 tokens: ten full blocks
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    for i, tail in enumerate("xyz."):  # a burst: all four added before the first step
        engine.add_request(f"r{i}", prefix + tail, params)
    while engine.has_unfinished_requests():
        engine.step()

    async def body(client):
        report = (await client.get("/v1/cache")).json()["prefix_cache"]
        assert report["inflight_waits"] == 3
        assert report["inflight_shared_tokens"] == 3 * 40
        metrics = (await client.get("/metrics")).text
        assert "pagedllm_prefix_cache_inflight_shared_tokens_total 120.0" in metrics

    h.run(body)
