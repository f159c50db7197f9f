"""The data-parallel router in process: fake-runner replicas behind ``create_router_app``.

Checks that the router predicts exactly the cached tokens each replica then reports,
that prefix-aware routing keeps a tenant on one replica (round robin does not), and that
a replica dying mid-stream fails only its own stream and gets no further traffic.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

from pagedllm.server.router import create_router_app

from .conftest import StreamingASGITransport, sse_events, wait_pool_free, wait_until

PREFIXES = [list(range(97, 97 + 20)), list(range(100, 100 + 20)), list(range(103, 103 + 20))]


class KillableTransport(httpx.AsyncBaseTransport):
    """An in-process replica whose connection can be cut: after ``kill()``, new requests
    fail to connect and a response being read raises ``ReadError`` after its first chunk."""

    def __init__(self, app: Any) -> None:
        self.inner = StreamingASGITransport(app)
        self.dead = False

    def kill(self) -> None:
        self.dead = True

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self.dead:
            raise httpx.ConnectError("replica is down", request=request)
        response = await self.inner.handle_async_request(request)
        return httpx.Response(
            response.status_code,
            headers=response.headers,
            stream=_DyingStream(response.stream, self),
            request=request,
        )


class _DyingStream(httpx.AsyncByteStream):
    def __init__(self, inner: Any, transport: KillableTransport) -> None:
        self.inner, self.transport = inner, transport

    async def __aiter__(self):
        sent = 0
        async for chunk in self.inner:
            # one SSE event at a time, so that a death can fall between two of them
            parts = chunk.split(b"\n\n")
            for i, part in enumerate(parts):
                piece = part + (b"\n\n" if i < len(parts) - 1 else b"")
                if self.transport.dead and sent:
                    raise httpx.ReadError("connection lost")
                if piece:
                    sent += 1
                    yield piece
                    await asyncio.sleep(0.005)

    async def aclose(self) -> None:
        await self.inner.aclose()


def _router(harnesses: list[Any], policy: str = "prefix_aware", **kw: Any) -> tuple[Any, list]:
    transports = [KillableTransport(h.app) for h in harnesses]
    mounts = {f"http://replica{i}": t for i, t in enumerate(transports)}
    client = httpx.AsyncClient(mounts=mounts, timeout=30)
    urls = [f"http://replica{i}" for i in range(len(harnesses))]
    app = create_router_app(
        urls, tokenizer=harnesses[0].tokenizer, policy=policy, client=client, **kw
    )
    return app, transports


def _run(router_app: Any, harnesses: list[Any], body: Any) -> Any:
    async def main() -> Any:
        transport = httpx.ASGITransport(app=router_app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://router", timeout=30
        ) as c:
            try:
                result = await body(c)
                for h in harnesses:
                    await wait_pool_free(h.engine)
                return result
            finally:
                await router_app.state.router.stop()  # its feeds, then its client
                for h in harnesses:
                    await h.engine.shutdown()

    return asyncio.run(main())


def _prompt(tenant: int, i: int) -> list[int]:
    return PREFIXES[tenant] + [110 + i, 111 + i, 112 + (i % 3)]


async def _complete(client: httpx.AsyncClient, prompt: list[int], **extra: Any) -> dict:
    body = {"prompt": prompt, "max_tokens": 3, "temperature": 0, **extra}
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_predicted_cached_tokens_equal_what_replicas_report(make_harness):
    harnesses = [make_harness(num_blocks=64, block_size=4) for _ in range(2)]
    app, _ = _router(harnesses)

    async def body(client: httpx.AsyncClient) -> dict:
        reported = []
        for i in range(4):
            for tenant in range(3):
                out = await _complete(client, _prompt(tenant, i))
                reported.append(out["usage"]["prompt_tokens_details"]["cached_tokens"])
        # cache_salt changes every block hash: no hit predicted, none reported
        out = await _complete(client, _prompt(0, 9), cache_salt="tenant-b")
        reported.append(out["usage"]["prompt_tokens_details"]["cached_tokens"])
        # the prompt's logprobs asked for: the engine computes it whole, no hit expected
        out = await _complete(client, _prompt(1, 9), echo=True, logprobs=1)
        reported.append(out["usage"]["prompt_tokens_details"]["cached_tokens"])
        return {"reported": reported, "router": (await client.get("/v1/router")).json()}

    result = _run(app, harnesses, body)
    replicas = result["router"]["replicas"]
    predicted = sum(r["predicted_cached_tokens"] for r in replicas)
    reported = sum(r["reported_cached_tokens"] for r in replicas)
    assert reported == sum(result["reported"]) and reported > 0
    assert predicted == reported
    for r in replicas:  # per replica, not only in total
        assert r["predicted_cached_tokens"] == r["reported_cached_tokens"]
    # after its first request every tenant's prompts hit their 20-token prefix
    assert result["reported"][3:12] == [20] * 9 and result["reported"][12:] == [0, 0]
    assert [r["replayed_cached_tokens"] for r in replicas] == [
        r["reported_cached_tokens"] for r in replicas
    ]


def test_replayed_cached_tokens_equal_reported_under_concurrency(make_harness):
    """Six requests in flight over small caches: a tenant's second request reaches its
    replica while the first still computes the prefix (in-flight sharing), and blocks
    are evicted between routing and admission. The router's view replayed to where each
    replica looked the prompt up (``cache_event_seq``) gives exactly the cached tokens
    the replica reports, per replica; the prediction made when routing may not."""
    from pagedllm.core.cache_events import REMOVED

    harnesses = [
        make_harness(
            num_blocks=16,
            block_size=4,
            max_model_len=64,
            engine_kw={"max_num_batched_tokens": 8},  # a prompt's prefill takes 3 steps
            runner_kw={"step_delay_s": 0.02},
        )
        for _ in range(2)
    ]
    app, _ = _router(harnesses, poll_interval=0.05)
    prefixes = [[97 + (5 * t + k) % 26 for k in range(20)] for t in range(5)]
    tenants = [0, 0, 1, 1, 2, 3, 4, 2, 0, 3, 1, 4, 4, 2, 3, 0, 1, 2, 3, 4]
    prompts = [prefixes[t] + [110 + i % 7, 111, 112 + i % 3] for i, t in enumerate(tenants)]

    async def body(client: httpx.AsyncClient) -> dict:
        limit = asyncio.Semaphore(6)

        async def one(prompt: list[int]) -> dict:
            async with limit:
                return await _complete(client, prompt, max_tokens=4)

        outs = await asyncio.gather(*(one(p) for p in prompts))
        cached = [o["usage"]["prompt_tokens_details"]["cached_tokens"] for o in outs]
        return {"cached": cached, "router": (await client.get("/v1/router")).json()}

    result = _run(app, harnesses, body)
    replicas = result["router"]["replicas"]
    assert sum(r["requests"] for r in replicas) == len(prompts)
    assert [r["unreplayed_requests"] for r in replicas] == [0, 0]
    for r in replicas:
        assert r["replayed_cached_tokens"] == r["reported_cached_tokens"]
    assert sum(r["reported_cached_tokens"] for r in replicas) == sum(result["cached"]) > 0
    # the workload has what the docstring says: evictions, and in-flight waits
    removed = 0
    for h in harnesses:
        log = h.llm.scheduler.kv.events
        removed += [kind for kind, _ in log.since(log.first_seq).events].count(REMOVED)
    assert removed > 0
    assert sum(h.llm.get_stats().num_inflight_waits for h in harnesses) > 0


def test_a_queued_request_keeps_the_prefix_the_router_predicted(make_harness):
    """A request routed on a fresh view waits in its replica's queue (one sequence at a
    time) while a long request grows and evicts, least recently used first. Its prefix
    was the LRU one: without pins it is evicted after routing and the prediction misses
    all of it; pinned on arrival it survives (the long request evicts another tenant's
    blocks instead), and the prediction made when routing is exact."""

    def cached(pin: bool) -> tuple[int, dict]:
        harness = make_harness(
            num_blocks=16,
            block_size=4,
            max_model_len=64,
            engine_kw={"max_num_seqs": 1, "pin_waiting_prefixes": pin},
            runner_kw={"step_delay_s": 0.01},
        )
        app, _ = _router([harness])

        async def body(client: httpx.AsyncClient) -> tuple[int, dict]:
            router = app.state.router
            for tenant in (0, 1):  # tenant 0's prefix first: the least recently used
                await _complete(client, _prompt(tenant, 0))
            long = asyncio.create_task(
                _complete(client, [120, 121, 122, 123], max_tokens=40, ignore_eos=True)
            )
            running = harness.llm.scheduler.stats
            await wait_until(lambda: running().num_running > 0, what="the long request to run")
            await router.refresh_all()  # the view is exact when the next one is routed
            out = await _complete(client, _prompt(0, 1))
            await long
            report = (await client.get("/v1/router")).json()["replicas"][0]
            return out["usage"]["prompt_tokens_details"]["cached_tokens"], report

        return _run(app, [harness], body)

    unpinned, report = cached(pin=False)
    assert unpinned == 0  # the long request's growth evicted the predicted prefix
    assert report["predicted_cached_tokens"] == report["reported_cached_tokens"] + 20
    pinned, report = cached(pin=True)
    assert pinned == 20
    assert report["predicted_cached_tokens"] == report["reported_cached_tokens"]
    assert report["replayed_cached_tokens"] == report["reported_cached_tokens"]


def test_prefix_aware_keeps_each_tenant_on_one_replica_round_robin_does_not(make_harness):
    def hit_tokens(policy: str) -> tuple[int, dict]:
        harnesses = [make_harness(num_blocks=64, block_size=4) for _ in range(2)]
        app, _ = _router(harnesses, policy)

        async def body(client: httpx.AsyncClient) -> tuple[int, dict]:
            total = 0
            for i in range(4):
                for tenant in range(3):
                    out = await _complete(client, _prompt(tenant, i))
                    total += out["usage"]["prompt_tokens_details"]["cached_tokens"]
            return total, (await client.get("/v1/router")).json()

        return _run(app, harnesses, body)

    aware, report = hit_tokens("prefix_aware")
    rr, _ = hit_tokens("round_robin")
    assert aware == 9 * 20  # every request after a tenant's first
    assert rr < aware
    assert all(r["healthy"] for r in report["replicas"])


def test_metrics_name_every_replica(make_harness):
    harnesses = [make_harness() for _ in range(2)]
    app, _ = _router(harnesses, "least_loaded")

    async def body(client: httpx.AsyncClient) -> str:
        await _complete(client, _prompt(0, 0))
        return (await client.get("/metrics")).text

    text = _run(app, harnesses, body)
    for i in range(2):
        assert f'pagedllm_router_replica_healthy{{replica="http://replica{i}"}} 1.0' in text
    assert 'pagedllm_router_requests_total{outcome="ok",replica="http://replica0"} 1.0' in text


def test_replica_dying_mid_stream_fails_only_its_requests(make_harness):
    harnesses = [make_harness(runner_kw={"step_delay_s": 0.01}) for _ in range(2)]
    app, transports = _router(harnesses, "round_robin")

    async def stream(client: httpx.AsyncClient, prompt: list[int]) -> bytes:
        body = {"prompt": prompt, "max_tokens": 12, "stream": True, "ignore_eos": True}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            return b"".join([chunk async for chunk in response.aiter_raw()])

    async def body(client: httpx.AsyncClient) -> dict:
        router = app.state.router
        await router.refresh_all()
        # round robin: the first stream goes to replica 0, the second to replica 1
        first = asyncio.create_task(stream(client, _prompt(0, 0)))
        await asyncio.sleep(0)
        second = asyncio.create_task(stream(client, _prompt(1, 0)))
        await wait_until(
            lambda: router.replicas[0].load > 0 and router.replicas[1].load > 0,
            what="a stream on each replica",
        )
        transports[0].kill()
        dead, alive = await first, await second
        later = [await _complete(client, _prompt(2, i)) for i in range(3)]
        report = (await client.get("/v1/router")).json()
        return {"dead": dead, "alive": alive, "later": later, "report": report}

    result = _run(app, harnesses, body)
    dead_events = sse_events(result["dead"])
    assert dead_events[-1]["error"]["code"] == "replica_failed"
    alive_events = sse_events(result["alive"])
    assert alive_events[-1]["choices"][0]["finish_reason"] == "length"
    text = "".join(e["choices"][0]["text"] for e in alive_events if e.get("choices"))
    assert text == harnesses[1].expected_text(_prompt(1, 0), 12)
    replicas = result["report"]["replicas"]
    assert replicas[0]["healthy"] is False and replicas[1]["healthy"] is True
    assert replicas[0]["requests"] == 1 and replicas[1]["requests"] == 4
    assert all(len(out["choices"][0]["text"]) for out in result["later"])


def test_no_healthy_replica_is_503(make_harness):
    harnesses = [make_harness()]
    app, transports = _router(harnesses)
    transports[0].kill()

    async def body(client: httpx.AsyncClient) -> httpx.Response:
        return await client.post("/v1/completions", json={"prompt": [97, 98], "max_tokens": 2})

    response = _run(app, harnesses, body)
    assert response.status_code == 503
    assert json.loads(response.text)["error"]["code"] == "no_replica"


def test_replicas_with_an_api_key_stream_their_events_to_a_router_given_the_key(make_harness):
    harnesses = [make_harness(api_key="secret") for _ in range(2)]
    app, _ = _router(harnesses, replica_api_key="secret")
    auth = {"authorization": "Bearer secret"}

    async def body(client: httpx.AsyncClient) -> tuple[list[int], dict, int]:
        cached = []
        for i in range(3):
            response = await client.post(
                "/v1/completions",
                json={"prompt": _prompt(0, i), "max_tokens": 2, "temperature": 0},
                headers=auth,
            )
            assert response.status_code == 200, response.text
            cached.append(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        # the client's own header is what a replica checks on a proxied request
        keyless = await client.post("/v1/completions", json={"prompt": [97], "max_tokens": 1})
        return cached, (await client.get("/v1/router")).json(), keyless.status_code

    cached, report, keyless_status = _run(app, harnesses, body)
    assert cached == [0, 20, 20]
    assert keyless_status == 401
    assert all(r["healthy"] and not r["key_refused"] for r in report["replicas"])
    assert sum(r["predicted_cached_tokens"] for r in report["replicas"]) == 40


def test_a_router_without_the_replicas_key_says_so_and_routes_nothing(make_harness, caplog):
    harnesses = [make_harness(api_key="secret")]
    app, _ = _router(harnesses)

    async def body(client: httpx.AsyncClient) -> tuple[httpx.Response, dict]:
        response = await client.post("/v1/completions", json={"prompt": [97], "max_tokens": 1})
        return response, (await client.get("/v1/router")).json()

    with caplog.at_level("ERROR", logger="pagedllm.server.router"):
        response, report = _run(app, harnesses, body)
    assert response.status_code == 503
    assert "refused the router's --replica-api-key" in response.json()["error"]["message"]
    assert report["replicas"][0]["key_refused"] and not report["replicas"][0]["healthy"]
    logged = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(logged) == 1 and "--replica-api-key" in logged[0]


def test_chat_prompts_are_routed_by_their_rendered_tokens(make_harness):
    harnesses = [make_harness(num_blocks=64, block_size=4) for _ in range(2)]
    app, _ = _router(harnesses)
    system = {"role": "system", "content": "You are a terse assistant for tenant one."}

    async def body(client: httpx.AsyncClient) -> list[int]:
        cached = []
        for question in ("hi", "why", "how"):
            messages = [system, {"role": "user", "content": question}]
            response = await client.post(
                "/v1/chat/completions", json={"messages": messages, "max_tokens": 2}
            )
            assert response.status_code == 200, response.text
            cached.append(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        report = (await client.get("/v1/router")).json()["replicas"]
        assert [r["predicted_cached_tokens"] for r in report] == [
            r["reported_cached_tokens"] for r in report
        ]
        assert sorted(r["requests"] for r in report) == [0, 3]  # one tenant, one replica
        return cached

    cached = _run(app, harnesses, body)
    assert cached[0] == 0 and cached[1] > 0 and cached[2] == cached[1]


class HangingEventsTransport(KillableTransport):
    """A replica whose cache-events endpoints stop answering (a hung or stopped process)
    once ``hung`` is set: a poll never answers, an open event stream sends nothing more
    (not even its keep-alives); completions would still be served."""

    def __init__(self, app: Any) -> None:
        super().__init__(app)
        self.hung = asyncio.Event()
        self.never = asyncio.Event()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        events = request.url.path.startswith("/v1/cache/events")
        if self.hung.is_set() and events:
            await self.never.wait()
        response = await super().handle_async_request(request)
        if not events:
            return response
        return httpx.Response(
            response.status_code,
            headers=response.headers,
            stream=_FreezingStream(response.stream, self),
            request=request,
        )


class _FreezingStream(httpx.AsyncByteStream):
    def __init__(self, inner: Any, transport: HangingEventsTransport) -> None:
        self.inner, self.transport = inner, transport

    async def __aiter__(self):
        async for chunk in self.inner:
            if self.transport.hung.is_set():
                await self.transport.never.wait()
            yield chunk

    async def aclose(self) -> None:
        await self.inner.aclose()


def test_a_hung_replica_is_marked_unhealthy_and_does_not_stall_the_others(make_harness):
    harnesses = [make_harness() for _ in range(2)]
    transports = [HangingEventsTransport(h.app) for h in harnesses]
    mounts = {f"http://replica{i}": t for i, t in enumerate(transports)}
    client = httpx.AsyncClient(mounts=mounts, timeout=30)
    app = create_router_app(
        ["http://replica0", "http://replica1"],
        tokenizer=harnesses[0].tokenizer,
        policy="round_robin",
        client=client,
        poll_interval=0.01,
        # Long enough that the answering replica's polls do not time out on a loaded
        # machine, short against the 5 s deadline below.
        poll_timeout=1.0,
    )

    async def body(client: httpx.AsyncClient) -> dict:
        # Before the poll timeout existed this hung for ever: fail instead.
        return await asyncio.wait_for(steps(client), 30)

    async def steps(client: httpx.AsyncClient) -> dict:
        router = app.state.router
        await router.refresh_all()
        assert all(r.healthy for r in router.replicas)
        transports[1].hung.set()
        router.start()
        # While replica 1 hangs, replica 0's view goes on following its events.
        seq_before = router.replicas[0].view.next_seq
        done = [await _complete(client, _prompt(0, i)) for i in range(2)]
        await wait_until(
            lambda: (
                not router.replicas[1].healthy and router.replicas[0].view.next_seq != seq_before
            ),
            5.0,
            what="the poller to pass the hung replica",
        )
        later = [await _complete(client, _prompt(1, i)) for i in range(3)]
        report = (await client.get("/v1/router")).json()
        await router.stop()
        return {"done": done, "later": later, "report": report}

    result = _run(app, harnesses, body)
    replicas = result["report"]["replicas"]
    assert replicas[0]["healthy"] is True and replicas[1]["healthy"] is False
    # Every request after the hang was noticed went to the replica that answers.
    assert replicas[0]["requests"] >= 3 + 1
    assert all(len(out["choices"][0]["text"]) for out in result["done"] + result["later"])


def test_a_silent_event_stream_marks_its_replica_unhealthy_routing_goes_on(make_harness):
    """Both views streamed; replica 1's stream then goes silent (no batch, no keep-alive):
    within the poll timeout the router stops trusting it and sends everything to replica
    0, whose stream keeps its view current meanwhile; no request waits on a feed."""
    harnesses = [make_harness() for _ in range(2)]
    transports = [HangingEventsTransport(h.app) for h in harnesses]
    mounts = {f"http://replica{i}": t for i, t in enumerate(transports)}
    client = httpx.AsyncClient(mounts=mounts, timeout=30)
    app = create_router_app(
        ["http://replica0", "http://replica1"],
        tokenizer=harnesses[0].tokenizer,
        policy="round_robin",
        client=client,
        poll_interval=0.01,
        poll_timeout=0.3,
    )

    async def body(client: httpx.AsyncClient) -> dict:
        return await asyncio.wait_for(steps(client), 30)

    async def steps(client: httpx.AsyncClient) -> dict:
        router = app.state.router
        router.start()
        await wait_until(
            lambda: all(r.streaming for r in router.replicas), what="every replica's event stream"
        )
        transports[1].hung.set()
        loop = asyncio.get_running_loop()
        started = loop.time()
        await wait_until(
            lambda: not router.replicas[1].healthy, what="the silent replica to be marked unhealthy"
        )
        noticed_s = loop.time() - started
        seq = router.replicas[0].view.next_seq
        later = [await _complete(client, _prompt(1, i)) for i in range(3)]
        log = harnesses[0].llm.kv.events
        await wait_until(
            lambda: router.replicas[0].view.next_seq == log.next_seq > seq,
            what="the view to catch up with the log",
        )
        report = (await client.get("/v1/router")).json()
        return {"later": later, "report": report, "noticed_s": noticed_s}

    result = _run(app, harnesses, body)
    replicas = result["report"]["replicas"]
    assert result["noticed_s"] < 2.0
    assert replicas[0]["healthy"] and replicas[0]["event_stream"]
    assert not replicas[1]["healthy"] and not replicas[1]["event_stream"]
    assert replicas[0]["requests"] == 3 and replicas[1]["requests"] == 0
    assert all(len(out["choices"][0]["text"]) for out in result["later"])


def _other_prompt(i: int) -> list[int]:
    """40 ids no tenant shares: 10 full blocks of 4, most of a 16-block cache."""
    return [65 + (7 * i + k) % 26 for k in range(40)]


def test_a_replicas_event_stream_keeps_a_view_exact_without_a_poll(make_harness):
    """``/v1/cache/events/stream``: a snapshot first, then every batch the engine logs
    (registrations and evictions), keep-alives while idle; a view fed by it alone ends
    equal to the replica's index."""
    from pagedllm.core.cache_events import REMOVED
    from pagedllm.core.routing import ReplicaCacheView
    from pagedllm.server.cache_events import parse_events_reply

    harness = make_harness(num_blocks=16, block_size=4, max_model_len=64)

    async def main() -> dict:
        transport = StreamingASGITransport(harness.app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://replica", timeout=30
        ) as client:
            bad = await client.get("/v1/cache/events/stream", params={"heartbeat": 0})
            assert bad.status_code == 400
            view, num_batches = ReplicaCacheView(), 0
            params = {"heartbeat": 0.05}
            async with client.stream("GET", "/v1/cache/events/stream", params=params) as stream:
                lines = stream.aiter_lines()

                async def next_reply() -> Any:
                    while True:
                        line = await asyncio.wait_for(anext(lines), 5)
                        if line.startswith("data: "):
                            return parse_events_reply(json.loads(line[6:]))

                first = await next_reply()
                assert first.snapshot == () and first.block_size == 4
                view.reset(first.epoch, first.next_seq, first.snapshot)
                for i in range(3):
                    for prompt in (_prompt(i, 0), _other_prompt(i)):
                        body = {"prompt": prompt, "max_tokens": 3}
                        assert (await client.post("/v1/completions", json=body)).is_success
                await wait_pool_free(harness.engine)
                log = harness.llm.kv.events
                while view.next_seq < log.next_seq:
                    view.apply((await next_reply()).batch)
                    num_batches += 1
                idle = [await asyncio.wait_for(anext(lines), 5) for _ in range(4)]
                assert ": keep-alive" in idle and not any(x.startswith("data") for x in idle)
                kinds = [kind for kind, _ in log.since(0).events]
                index = set(harness.llm.kv.pool.hashed_blocks().values())
            await harness.engine.shutdown()
            return {"view": view.hashes, "index": index, "kinds": kinds, "batches": num_batches}

    result = asyncio.run(main())
    assert result["view"] == result["index"] and result["index"]
    assert REMOVED in result["kinds"] and result["batches"] > 1


def test_a_streamed_view_is_current_when_routing_a_polled_one_a_poll_behind(make_harness):
    """Tenant 0's prefix is cached on the replica, then traffic the router never sees
    (straight to the replica) evicts it. Polled every 30 s, the router still believes
    the prefix is there: 20 tokens predicted, 0 reported, the miss counted *before
    arrival*. Streamed, its view follows the evictions with no poll and predicts 0."""

    def run(feed: str) -> dict:
        harness = make_harness(num_blocks=16, block_size=4, max_model_len=64)
        app, _ = _router([harness], cache_events=feed, poll_interval=30)

        async def body(client: httpx.AsyncClient) -> dict:
            router = app.state.router
            router.start()
            await _complete(client, _prompt(0, 0))
            log = harness.llm.kv.events
            if feed == "stream":  # pushed, so it may still be on its way after the answer
                await wait_until(
                    lambda: router.replicas[0].view.next_seq == log.next_seq,
                    what="the view to catch up with the log",
                )
            first_block = router.replicas[0].view.hashes.copy()
            direct = httpx.AsyncClient(
                transport=StreamingASGITransport(harness.app), base_url="http://replica"
            )
            for i in range(3):
                body = {"prompt": _other_prompt(i), "max_tokens": 3}
                assert (await direct.post("/v1/completions", json=body)).is_success
            await direct.aclose()
            index = set(harness.llm.kv.pool.hashed_blocks().values())
            assert first_block and not first_block & index  # tenant 0's blocks are gone
            if feed == "stream":
                await wait_until(
                    lambda: router.replicas[0].view.next_seq == log.next_seq,
                    what="the view to catch up with the log",
                )
            out = await _complete(client, _prompt(0, 1))
            report = (await client.get("/v1/router")).json()["replicas"][0]
            return {"cached": out["usage"]["prompt_tokens_details"]["cached_tokens"], **report}

        return _run(app, [harness], body)

    polled = run("poll")
    assert polled["cached"] == 0 and not polled["event_stream"]
    assert polled["predicted_cached_tokens"] == polled["reported_cached_tokens"] + 20
    assert polled["missed_before_arrival_tokens"] == 20 and polled["missed_in_queue_tokens"] == 0
    streamed = run("stream")
    assert streamed["cached"] == 0 and streamed["event_stream"]
    assert streamed["predicted_cached_tokens"] == streamed["reported_cached_tokens"]
    assert streamed["missed_before_arrival_tokens"] == streamed["missed_in_queue_tokens"] == 0
    assert streamed["replayed_cached_tokens"] == streamed["reported_cached_tokens"]


class ScriptedReplica:
    """A replica's two event endpoints, scripted by the test: its index (epoch,
    next_seq, hashes), a poll that answers a snapshot of it, and streams that send a
    snapshot and then whatever the test queues (None ends the stream)."""

    def __init__(self) -> None:
        from fastapi import FastAPI

        from pagedllm.server.cache_events import events_frame
        from pagedllm.server.sse import EventStreamResponse

        self.epoch, self.next_seq, self.hashes = "e1", 0, [b"\x01" * 32]
        self.frames: asyncio.Queue[dict | None] = asyncio.Queue()
        self.num_streams = 0
        self.app = FastAPI()

        @self.app.get("/v1/cache/events")
        async def poll() -> dict:
            return self.snapshot()

        @self.app.get("/v1/cache/events/stream")
        async def stream() -> Any:
            self.num_streams += 1

            async def frames() -> Any:
                yield events_frame(self.snapshot())
                while (batch := await self.frames.get()) is not None:
                    yield events_frame(batch)

            return EventStreamResponse(frames())

    def snapshot(self) -> dict:
        return {"epoch": self.epoch, "block_size": 4, "next_seq": self.next_seq,
                "snapshot": [h.hex() for h in self.hashes]}  # fmt: skip

    def batch(self, first_seq: int, events: list[tuple[str, bytes]]) -> dict:
        return {"epoch": self.epoch, "block_size": 4, "first_seq": first_seq,
                "next_seq": first_seq + len(events),
                "events": [[kind, h.hex()] for kind, h in events]}  # fmt: skip


def test_the_view_resyncs_from_a_snapshot_after_a_gap_and_after_a_restart():
    replica = ScriptedReplica()
    h = [bytes([i]) * 32 for i in range(1, 8)]
    client = httpx.AsyncClient(mounts={"http://replica0": StreamingASGITransport(replica.app)})
    app = create_router_app(["http://replica0"], tokenizer=None, client=client, poll_interval=0.01)

    async def main() -> None:
        router = app.state.router
        view = router.replicas[0].view
        router.start()
        try:
            await wait_until(
                lambda: router.replicas[0].streaming and view.hashes == {h[0]},
                what="the streamed view to hold the first hash",
            )
            # in sequence: applied
            replica.next_seq = 2
            replica.hashes = [h[0], h[1]]
            await replica.frames.put(replica.batch(0, [("+", h[1]), ("-", h[2])]))
            await wait_until(lambda: view.next_seq == 2, what="the view to reach event 2")
            assert view.hashes == {h[0], h[1]}
            # a gap (events 2-4 never came): the stream is dropped, a poll's snapshot
            # puts the view right, a new stream follows on
            replica.next_seq, replica.hashes = 6, [h[1], h[3], h[4]]
            await replica.frames.put(replica.batch(5, [("+", h[4])]))
            await wait_until(
                lambda: replica.num_streams == 2 and router.replicas[0].streaming,
                what="the router to resubscribe after the gap",
            )
            assert (view.hashes, view.next_seq) == ({h[1], h[3], h[4]}, 6)
            # the replica restarts (another epoch, its log from 0): the stream ends, the
            # next read is a snapshot of the new index
            replica.epoch, replica.next_seq, replica.hashes = "e2", 1, [h[5]]
            await replica.frames.put(None)
            await wait_until(
                lambda: view.epoch == "e2" and replica.num_streams == 3,
                what="the view to resync to the restarted replica",
            )
            assert (view.hashes, view.next_seq) == ({h[5]}, 1)
            assert router.replicas[0].healthy
        finally:
            await replica.frames.put(None)
            await router.stop()

    asyncio.run(main())


def test_a_token_id_past_int64_is_the_replicas_400_not_a_router_500(make_harness):
    """The router packs token ids as int64 for its hash chain; it reads a body as the
    replica will, so one it cannot pack goes on to the replica, which refuses it."""
    harnesses = [make_harness(num_blocks=64, block_size=4)]
    app, _ = _router(harnesses)

    async def body(client: httpx.AsyncClient) -> tuple[int, Any]:
        prompt = _prompt(0, 0) + [2**63]
        response = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
        return response.status_code, response.json()["error"]["param"]

    assert _run(app, harnesses, body) == (400, "prompt")
