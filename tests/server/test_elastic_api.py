"""POST /v1/cache/resize in-process and across the real process boundary; the elastic
pool in /v1/cache and /metrics; the automatic mode's idle shrink in the engine core."""

from __future__ import annotations

import asyncio

import httpx

from pagedllm.engine.async_engine import AsyncEngine
from pagedllm.sampling_params import SamplingParams
from pagedllm.server.app import create_app
from pagedllm.testing import FakeEngineFactory

from .conftest import sse_events, wait_pool_free, wait_until

BLOCK = 4096  # FakeModelRunner's kv_block_bytes


def test_resize_under_load_keeps_streams_exact_and_reports(make_harness):
    h = make_harness(num_blocks=64, engine_kw={"compaction_step_fraction": 0.01})
    prompts = [f"request {i} says hello" for i in range(4)]

    async def body(client: httpx.AsyncClient):
        payload = {"max_tokens": 24, "temperature": 0, "stream": True}
        streams = [
            asyncio.ensure_future(client.post("/v1/completions", json={**payload, "prompt": p}))
            for p in prompts
        ]
        await wait_until(lambda: h.runner.num_steps > 0, what="the requests' first step")
        shrink = await client.post("/v1/cache/resize", json={"kv_cache_memory": 24 * BLOCK})
        assert shrink.status_code == 200, shrink.text
        report = shrink.json()
        assert report["blocks_before"] == 64 and report["blocks_requested"] == 24
        assert report["blocks_after"] >= 24 and report["num_preempted"] == 0
        assert report["bytes_returned"] == (64 - report["blocks_after"]) * BLOCK
        for prompt, future in zip(prompts, streams, strict=True):
            text = "".join(e["choices"][0]["text"] for e in sse_events((await future).content))
            assert text == h.expected_text(prompt, 24)
        grow = (await client.post("/v1/cache/resize", json={"kv_cache_memory": "1MiB"})).json()
        assert grow["blocks_after"] == 256 and grow["bytes_returned"] < 0
        cache = (await client.get("/v1/cache")).json()
        assert cache["blocks_total"] == 256
        assert cache["elastic"]["bytes_total"] == 256 * BLOCK
        assert cache["elastic"]["last_resize"]["blocks_after"] == 256
        metrics = (await client.get("/metrics")).text.splitlines()
        (line,) = [m for m in metrics if m.startswith("pagedllm_kv_cache_bytes ")]
        assert float(line.split()[1]) == 256 * BLOCK

    h.run(body)


def test_a_shrink_whose_requests_ended_completes_while_its_report_is_polled(make_harness):
    """A shrink begun under load goes on in slices before steps; when its requests end
    (here: aborted) no step comes, and the route's polls, every 10 ms, must not keep the
    idle core from finishing it (they once did: the idle work waited for a quiet second)."""
    h = make_harness(num_blocks=64)
    h.llm.add_request("r", h.tokenizer.encode("request says hello"), SamplingParams(max_tokens=4))
    h.llm.step()
    resize_id = h.llm.elastic.start(8 * BLOCK)
    h.llm.abort_request("r")
    assert h.llm.elastic.resizing and not h.llm.scheduler.has_unfinished_requests()

    async def body(client: httpx.AsyncClient):
        await wait_until(
            lambda: h.engine.resize_report(resize_id), deadline_s=5, what="the shrink's report"
        )
        report = await h.engine.resize_report(resize_id)
        assert report.blocks_after == 8 and report.num_preempted == 0

    h.run(body)


def test_resize_rejects_bad_bodies_and_needs_the_key(make_harness):
    h = make_harness(api_key="sesame")
    auth = {"Authorization": "Bearer sesame"}

    async def body(client: httpx.AsyncClient):
        denied = await client.post("/v1/cache/resize", json={"kv_cache_memory": "1MiB"})
        assert denied.status_code == 401
        for bad in ({"kv_cache_memory": "lots"}, {"kv_cache_memory": 10}, {}, {"preempt": 1}):
            response = await client.post("/v1/cache/resize", json=bad, headers=auth)
            assert response.status_code == 400, bad
            assert response.json()["error"]["message"]
        # too big for a float, for an int64 (the wire), for the machine's free memory
        for size in ("9" * 400 + "GiB", 2**63, "1000000TiB"):
            body = {"kv_cache_memory": size}
            response = await client.post("/v1/cache/resize", json=body, headers=auth)
            assert response.status_code == 400, size
            assert response.json()["error"]["param"] == "kv_cache_memory", size
        ok = await client.post("/v1/cache/resize", json={"kv_cache_memory": "128KiB"}, headers=auth)
        assert ok.json()["blocks_after"] == 32

    h.run(body)


def test_resize_and_automatic_shrink_across_the_process_boundary(tokenizer_dir):
    engine = AsyncEngine.launch(
        FakeEngineFactory(
            tokenizer_dir,
            num_blocks=16,
            engine_kw={
                "kv_cache_memory": 16 * BLOCK,
                "kv_cache_memory_max": 128 * BLOCK,
                "elastic_idle_s": 0.0,
            },
        )
    )
    app = create_app(engine)

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=30) as c:
            try:
                payload = {"prompt": "x" * 60, "max_tokens": 40, "temperature": 0}
                outs = await asyncio.gather(
                    *(c.post("/v1/completions", json=payload) for _ in range(4))
                )
                assert all(o.status_code == 200 for o in outs)
                cache = (await c.get("/v1/cache")).json()
                assert cache["elastic"]["automatic"] and cache["elastic"]["grows"] >= 1

                # Idle: the core's idle tick shrinks the pool to the packed prompt cache.
                async def shrunk() -> bool:
                    return (await c.get("/v1/cache")).json()["elastic"]["shrinks"] > 0

                await wait_until(shrunk, what="the idle shrink")
                cache = (await c.get("/v1/cache")).json()
                packed = cache["blocks_used"] + cache["blocks_cached_free"]
                assert cache["blocks_total"] == max(16, packed)
                manual = await c.post("/v1/cache/resize", json={"kv_cache_memory": 64 * BLOCK})
                assert manual.json()["blocks_after"] == 64
                await wait_pool_free(engine)
            finally:
                await engine.shutdown()

    asyncio.run(main())


def test_resize_sizes_are_bytes_unless_they_name_a_unit():
    """The resize body reads sizes as the engine's flags do: a bare number is bytes, as a
    string or an int (the planner's bare GiB is its own rule)."""
    from pagedllm.server.protocol import CacheResizeRequest

    for size, want in [("1048576", 1 << 20), (1 << 20, 1 << 20), ("2GiB", 2 << 30)]:
        assert CacheResizeRequest(kv_cache_memory=size).kv_cache_memory == want
