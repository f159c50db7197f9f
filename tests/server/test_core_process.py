"""The server with its engine core in a process of its own (what `pagedllm serve` runs):
every guarantee checked across the real process boundary, with the fake runner."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from pagedllm.engine.async_engine import AsyncEngine
from pagedllm.server.app import create_app
from pagedllm.testing import FakeEngineFactory
from pagedllm.worker.fake_runner import MISS_LOGPROB

from .conftest import ASGIStream, sse_events, wait_pool_free, wait_until, wait_until_sync


def _serve(
    tokenizer_dir: str,
    body: Callable[[Any, httpx.AsyncClient], Awaitable[Any]],
    *,
    max_queued_requests: int = 256,
    check_free: bool = True,
    **factory_kw: Any,
) -> Any:
    """Launch a core process, build the app around it, run ``body(app, client)``, check
    that no block leaked, and stop the core."""
    engine = AsyncEngine.launch(
        FakeEngineFactory(tokenizer_dir, **factory_kw), max_queued_requests=max_queued_requests
    )
    app = create_app(engine)

    async def main() -> Any:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=30) as c:
            try:
                result = await body(app, c)
                if check_free:
                    await wait_pool_free(engine)
                return result
            finally:
                await engine.shutdown()

    try:
        return asyncio.run(main())
    finally:
        assert not engine.host.is_alive()


def test_requests_metrics_and_reports_cross_the_process_boundary(tokenizer_dir):
    async def body(app, client):
        engine = app.state.engine
        assert engine.info.pid != os.getpid()
        payload = {"prompt": "hello", "max_tokens": 5, "temperature": 0, "n": 2}
        whole = (await client.post("/v1/completions", json=payload)).json()
        streamed = await client.post("/v1/completions", json={**payload, "stream": True})
        texts: dict[int, str] = {0: "", 1: ""}
        for event in sse_events(streamed.content):
            for choice in event["choices"]:
                texts[choice["index"]] += choice["text"]
        assert [c["text"] for c in whole["choices"]] == [texts[0], texts[1]]
        assert whole["usage"]["completion_tokens"] == 10
        cache = (await client.get("/v1/cache")).json()
        assert cache["blocks_total"] == 64 and cache["server"]["in_flight"] == 0
        blocks = (await client.get("/v1/cache/blocks")).json()
        assert len(blocks["state"]) == 64
        metrics = (await client.get("/metrics")).text
        assert "pagedllm_generation_tokens_total 20.0" in metrics
        assert (await client.get("/health")).json() == {"status": "ok"}

    _serve(tokenizer_dir, body)


def test_echoed_prompt_logprobs_cross_the_process_boundary(tokenizer_dir):
    """The prompt's logprobs travel in the core's deltas: whole and streamed alike, the
    first null, one entry per prompt token before the completion's."""
    prompt = "hello there"

    async def body(app, client):
        payload = {"prompt": prompt, "max_tokens": 2, "echo": True, "logprobs": 2}
        whole = (await client.post("/v1/completions", json=payload)).json()
        [choice] = whole["choices"]
        lp = choice["logprobs"]
        streamed = await client.post("/v1/completions", json={**payload, "stream": True})
        [first, *_] = [c for e in sse_events(streamed.content) for c in e["choices"]]
        return lp, first["logprobs"]

    whole, first = _serve(tokenizer_dir, body)
    n = len(prompt)  # one token a character
    assert whole["tokens"][:n] == list(prompt) and len(whole["tokens"]) == n + 2
    assert whole["token_logprobs"][0] is None and whole["top_logprobs"][0] is None
    assert all(lp in (0.0, MISS_LOGPROB) for lp in whole["token_logprobs"][1:n])
    assert all(len(top) == 2 for top in whole["top_logprobs"][1:n])  # the top-2 asked for
    assert {k: v[:n] for k, v in first.items()} == {k: v[:n] for k, v in whole.items()}


def test_disconnect_frees_blocks_before_the_next_step(tokenizer_dir):
    async def body(app, client):
        engine = app.state.engine
        payload = {"prompt": "a long story", "max_tokens": 100, "stream": True}
        asgi = ASGIStream(app, "/v1/completions", payload).start()
        assert await asgi.next_chunk()
        await asgi.disconnect()
        # The abort went out before this call; the core runs both before its next step.
        stats = await engine.get_stats()
        assert stats.cache.blocks_used == 0 and stats.num_unfinished_requests == 0
        assert stats.num_requests_aborted == 1 and stats.num_generation_tokens < 100

    _serve(tokenizer_dir, body, runner_kw={"step_delay_s": 0.02})


def test_full_queue_gets_429(tokenizer_dir):
    async def body(app, client):
        payload = {"prompt": "queued", "max_tokens": 2}
        first = asyncio.ensure_future(client.post("/v1/completions", json=payload))
        await wait_until(lambda: app.state.engine.num_queued > 0, what="the first request queued")
        refused = await client.post("/v1/completions", json=payload)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_full"
        assert (await first).status_code == 200

    _serve(tokenizer_dir, body, max_queued_requests=1, runner_kw={"step_delay_s": 0.3})


def test_a_failing_request_does_not_take_others_down(tokenizer_dir):
    async def body(app, client):
        def post(request_id: str) -> Any:
            return client.post(
                "/v1/completions",
                json={"prompt": "both", "max_tokens": 8},
                headers={"x-request-id": request_id},
            )

        bad, good = await asyncio.gather(post("bad"), post("good"))
        assert bad.status_code == 500 and bad.json()["error"]["code"] == "engine_error"
        assert good.status_code == 200 and good.json()["choices"][0]["finish_reason"] == "length"
        assert (await post("again")).status_code == 200

    _serve(tokenizer_dir, body, runner_kw={"fail_request_ids": {"cmpl-bad-0"}})


def test_killed_core_fails_requests_cleanly_and_health_says_so(tokenizer_dir):
    async def body(app, client):
        engine = app.state.engine
        payload = {"prompt": "doomed", "max_tokens": 100, "stream": True}
        asgi = ASGIStream(app, "/v1/completions", payload).start()
        assert await asgi.next_chunk()
        os.kill(engine.info.pid, signal.SIGKILL)
        rest = b""
        while (chunk := await asgi.next_chunk()) is not None:
            rest += chunk
        assert rest.endswith(b"data: [DONE]\n\n")
        assert b'"code":"engine_unavailable"' in rest and b"exited with code -9" in rest
        health = await client.get("/health")
        assert health.status_code == 503 and "exited" in health.json()["error"]["message"]
        late = await client.post("/v1/completions", json={"prompt": "late", "max_tokens": 2})
        assert late.status_code == 503
        assert (await client.get("/v1/cache")).status_code == 503
        assert engine.num_in_flight == 0 and engine.num_queued == 0

    _serve(tokenizer_dir, body, check_free=False, runner_kw={"step_delay_s": 0.02})


# A server that starts its engine core (slowly), prints the core's pid, then waits.
_SLOW_START = """
import sys, time
from pagedllm.engine.async_engine import _CoreProcess
from pagedllm.testing import FakeEngineFactory
factory = FakeEngineFactory(sys.argv[1], startup_s=120.0, building_marker=sys.argv[2])
core = _CoreProcess(factory)
core.start("ipc:///tmp/pagedllm-test-unused-in", "ipc:///tmp/pagedllm-test-unused-out")
print(core.process.pid, flush=True)
time.sleep(120)
"""


def test_a_core_still_starting_exits_when_its_server_is_killed(tokenizer_dir, tmp_path):
    """SIGKILL leaves the server no atexit: the core, still building its engine (no loop
    yet to notice), must end by itself instead of loading a model for nobody."""
    import subprocess
    import sys

    building = tmp_path / "building"
    server = subprocess.Popen(
        [sys.executable, "-c", _SLOW_START, tokenizer_dir, str(building)],
        stdout=subprocess.PIPE,
        text=True,
    )
    core_pid = None
    try:
        core_pid = int(server.stdout.readline())
        wait_until_sync(building.exists, 60, what="the core to begin building its engine")
        assert _running(core_pid)
        server.kill()
        server.wait(10)
        wait_until_sync(lambda: not _running(core_pid), 10, what="the core to end")
    finally:
        server.kill()
        if core_pid is not None and _running(core_pid):
            os.kill(core_pid, signal.SIGKILL)


def _running(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
