"""``pagedllm router``: one OpenAI endpoint in front of data-parallel replicas.

Each request is hashed with the engines' own block-hash chain (same tokenizer, the
replicas' block size, the request's ``cache_salt``) and sent to the replica whose prefix
cache holds most of it (``core/routing.py``), unless that replica is much busier than the
idlest. The router's picture of every replica's cache comes from the replica's cache
events, so it predicts the cached tokens each replica will report. By default each
replica pushes them as its engine logs them (``GET /v1/cache/events/stream``, SSE: after
a step's schedule and after the step), and the view is one message behind the replica's
index, not one poll; ``cache_events="poll"`` reads ``GET /v1/cache/events`` every
``poll_interval`` instead (and after each request it proxied), as the router also does
for a replica without the stream, and between two streams::

    per replica:  poll (health, catch-up: events or a snapshot) -> open the stream
                  -> apply each batch (seq numbers: only what is new; a gap or another
                     epoch: back to a poll, which answers a snapshot) -> stream ends or
                     is silent past poll_timeout (no keep-alive) -> poll again

Routing never waits on a feed: it reads the view as it stands. Each answer says where
the replica's event log stood when the request arrived (``arrival_event_seq``) and when
it looked the prefix up (``cache_event_seq``); the router replays its view to both points
and counts the lookup replay (``replayed_cached_tokens``): it equals what the replica
reports unless the two disagree on the hashes themselves. A prediction made at routing
time can miss what changed between routing and lookup; the router says where: a miss
whose replay at arrival already matches the report happened *before arrival* (the view
was behind, or the index changed while the request travelled), any other *in the queue*
(a pin given up, a pending block's owner preempted).

A replica that fails (connection refused or lost mid-stream) fails only the requests it
was serving: a non-streaming request that never reached it is retried on another replica,
a stream in progress ends with an error event and ``data: [DONE]``; the replica is marked
unhealthy and gets no traffic until its events endpoint answers again.

Routes: the OpenAI ones (proxied), /health, /metrics (router counters per replica),
/v1/router (the same as JSON).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    generate_latest,
)
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from pagedllm.core.hashing import hash_request_blocks
from pagedllm.core.routing import (
    CACHE_EVENT_FEEDS,
    ReplicaCacheView,
    ReplicaState,
    RoutingPolicy,
    make_policy,
    predicted_cached_tokens,
)
from pagedllm.server.cache_events import EventsReply, parse_events_reply
from pagedllm.server.errors import APIError
from pagedllm.server.sse import DONE

logger = logging.getLogger(__name__)

PROXIED_HEADERS = ("authorization", "x-request-id", "content-type")
PENDING_TTL_S = 30.0  # a routed prompt not confirmed by events this long is forgotten
POLL_TIMEOUT_S = 5.0  # a replica whose events poll (or stream) is silent longer: unhealthy


@dataclass(slots=True)
class Replica:
    """The router's books on one replica (event-loop state, not shared across threads)."""

    url: str
    view: ReplicaCacheView = field(default_factory=ReplicaCacheView)
    healthy: bool = False
    load: int = 0
    kv_usage: float = 0.0
    block_size: int | None = None
    num_requests: int = 0
    num_failed: int = 0
    predicted_cached_tokens: int = 0
    replayed_cached_tokens: int = 0
    num_unreplayed: int = 0  # answers the view could not replay (no or too old a seq)
    reported_cached_tokens: int = 0
    reported_prompt_tokens: int = 0
    missed_before_arrival_tokens: int = 0  # |predicted - reported| of mispredicted requests
    missed_in_queue_tokens: int = 0  # ... split by where the index changed (module doc)
    streaming: bool = False  # its event stream is open
    has_stream: bool = True  # False: the replica answered 404 (an older server): polled
    view_time: float = 0.0  # when the view was last known current (a read, a keep-alive)
    refused: bool = False  # its last events read answered 401 (the router's key is wrong)


@dataclass(frozen=True, slots=True)
class Route:
    replica: Replica
    predicted_cached_tokens: int  # from the view when routed (pending blocks included)
    block_hashes: tuple[bytes, ...]
    num_tokens: int  # the prompt's (0: one the router could not read)
    block_size: int | None
    takes_prefix_hit: bool = True  # False: prompt logprobs asked for, so the engine computes all


class RouterMetrics:
    """The router's Prometheus registry (one per app)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        labels = ["replica"]
        r = self.registry
        self.requests = Counter(
            "pagedllm_router_requests", "requests routed", [*labels, "outcome"], registry=r
        )
        self.predicted = Counter(
            "pagedllm_router_predicted_cached_tokens",
            "prompt tokens the router expected the replica to find cached",
            labels,
            registry=r,
        )
        self.replayed = Counter(
            "pagedllm_router_replayed_cached_tokens",
            "prompt tokens the router's view held at the replica's prefix lookup (cache_event_seq)",
            labels,
            registry=r,
        )
        self.reported = Counter(
            "pagedllm_router_reported_cached_tokens",
            "cached prompt tokens the replica reported (usage.prompt_tokens_details)",
            labels,
            registry=r,
        )
        self.prompt = Counter(
            "pagedllm_router_prompt_tokens",
            "prompt tokens the replica reported",
            labels,
            registry=r,
        )
        self.missed = Counter(
            "pagedllm_router_missed_cached_tokens",
            "|predicted - reported| cached tokens of mispredicted requests, by where the "
            "replica's index changed (before_arrival, in_queue)",
            [*labels, "where"],
            registry=r,
        )
        self.healthy = Gauge(
            "pagedllm_router_replica_healthy", "1 while the replica answers", labels, registry=r
        )
        self.streaming = Gauge(
            "pagedllm_router_replica_event_stream",
            "1 while the replica's cache events stream is open",
            labels,
            registry=r,
        )
        self.load = Gauge(
            "pagedllm_router_replica_in_flight", "requests in flight", labels, registry=r
        )
        self.kv_usage = Gauge(
            "pagedllm_router_replica_kv_usage", "KV usage last reported", labels, registry=r
        )
        self.cached_blocks = Gauge(
            "pagedllm_router_replica_cached_blocks",
            "block hashes the router knows the replica holds",
            labels,
            registry=r,
        )

    def render(self, replicas: Sequence[Replica]) -> bytes:
        for replica in replicas:
            self.healthy.labels(replica.url).set(int(replica.healthy))
            self.streaming.labels(replica.url).set(int(replica.streaming))
            self.load.labels(replica.url).set(replica.load)
            self.kv_usage.labels(replica.url).set(replica.kv_usage)
            self.cached_blocks.labels(replica.url).set(len(replica.view.hashes))
        return generate_latest(self.registry)


class Router:
    """Routing state and the replica feed; every method runs on the event loop."""

    def __init__(
        self,
        replica_urls: Sequence[str],
        policy: RoutingPolicy,
        tokenizer: Any,
        *,
        client: httpx.AsyncClient | None = None,
        poll_interval: float = 0.1,
        poll_timeout: float = POLL_TIMEOUT_S,
        cache_events: str = "stream",
        refresh_older_than: float | None = None,
        replica_api_key: str | None = None,
    ) -> None:
        """``cache_events``: "stream" (pushed by the replicas) or "poll". With
        ``refresh_older_than`` (seconds), a request first re-reads the events of every
        replica whose view is older than that and not streamed (a round trip each).
        ``replica_api_key``: the key the replicas were started with (``--api-key``); the
        router's own reads send it (proxied requests carry their client's header)."""
        if not replica_urls:
            raise ValueError("the router needs at least one --replica URL")
        if cache_events not in CACHE_EVENT_FEEDS:
            raise ValueError(
                f"cache_events must be one of {', '.join(CACHE_EVENT_FEEDS)}, got {cache_events!r}"
            )
        self.replicas = [Replica(url.rstrip("/")) for url in replica_urls]
        self.policy = policy
        self.tokenizer = tokenizer
        self.client = client or httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0))
        self.poll_interval = poll_interval
        self.poll_timeout = poll_timeout
        self.cache_events = cache_events
        self.refresh_older_than = refresh_older_than
        self.feed_headers = (
            {"authorization": f"Bearer {replica_api_key}"} if replica_api_key else {}
        )
        self.metrics = RouterMetrics()
        self._poller: asyncio.Task | None = None

    # ---- the replicas' feed -------------------------------------------------------

    async def refresh(self, replica: Replica) -> None:
        """Read the replica's new cache events (or a snapshot); mark it healthy or not."""
        params: dict[str, Any] = {"since": replica.view.next_seq}
        if replica.view.epoch is not None:
            params["epoch"] = replica.view.epoch
        try:
            # The proxy's client has no read timeout (streams may run for minutes); a poll
            # has one, so a replica that hangs is marked unhealthy instead of stalling.
            # (asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancel that
            # lands as its awaitable finishes, and stop() then waits on the feed forever.)
            async with asyncio.timeout(self.poll_timeout):
                response = await self.client.get(
                    f"{replica.url}/v1/cache/events", params=params, headers=self.feed_headers
                )
            if response.status_code == 401:
                self._refused(replica)
                return
            response.raise_for_status()
            reply = parse_events_reply(response.json())
        except (httpx.HTTPError, ValueError, TimeoutError) as exc:
            if replica.healthy:
                reason = str(exc) or f"no answer in {self.poll_timeout:g} s"
                logger.warning("replica %s stopped answering: %s", replica.url, reason)
            replica.healthy = False
            return
        self._take(replica, reply)

    def _refused(self, replica: Replica) -> None:
        """The replica refused the router's key: it gets no traffic, and the log says why
        once (every poll would repeat it)."""
        if not replica.refused:
            given = "a wrong key" if self.feed_headers else "no key"
            logger.error(
                "replica %s refused the router's cache-event read (401, %s): start the "
                "router with --replica-api-key set to the replicas' --api-key",
                replica.url,
                given,
            )
        replica.refused = True
        replica.healthy = False

    def _take(self, replica: Replica, reply: EventsReply) -> bool:
        """Apply a read to the view; False when it does not continue it (the next poll
        asks for a snapshot)."""
        view = replica.view
        try:
            if reply.snapshot is not None:
                # a snapshot asked for before the stream moved the view past it: stale
                if reply.epoch != view.epoch or reply.next_seq >= view.next_seq:
                    view.reset(reply.epoch, reply.next_seq, reply.snapshot)
            elif reply.batch is not None:
                view.apply(reply.batch)
        except ValueError:
            view.epoch = None
            return False
        replica.block_size = reply.block_size
        replica.kv_usage = reply.kv_usage
        replica.healthy = True
        replica.refused = False
        replica.view_time = time.monotonic()
        view.expire_pending(replica.view_time - PENDING_TTL_S)
        return True

    async def _read_stream(self, replica: Replica) -> None:
        """Follow the replica's event stream until it ends, breaks, falls silent for
        ``poll_timeout`` (then the replica is marked unhealthy) or leaves the view's
        sequence (then the next poll takes a snapshot)."""
        params: dict[str, Any] = {
            "since": replica.view.next_seq,
            "heartbeat": min(60.0, self.poll_timeout / 4),
        }
        if replica.view.epoch is not None:
            params["epoch"] = replica.view.epoch
        request = self.client.build_request(
            "GET",
            f"{replica.url}/v1/cache/events/stream",
            params=params,
            headers=self.feed_headers,
        )
        response: httpx.Response | None = None
        try:
            async with asyncio.timeout(self.poll_timeout):
                response = await self.client.send(request, stream=True)
            if response.status_code == 404:
                logger.info("replica %s has no event stream: polling it", replica.url)
                replica.has_stream = False
                return
            response.raise_for_status()
            replica.streaming = True
            lines = response.aiter_lines()
            while True:
                async with asyncio.timeout(self.poll_timeout):
                    line = await anext(lines)
                replica.view_time = time.monotonic()
                if line.startswith("data: "):
                    reply = parse_events_reply(json.loads(line[6:]))
                    if not self._take(replica, reply):
                        return
        except StopAsyncIteration:
            return  # the replica ended it (shutting down, or this reader fell behind)
        except TimeoutError:
            logger.warning(
                "replica %s: cache events silent for %g s", replica.url, self.poll_timeout
            )
            replica.healthy = False
        except (httpx.HTTPError, ValueError) as exc:
            logger.warning("replica %s: cache event stream lost: %s", replica.url, exc)
        finally:
            replica.streaming = False
            if response is not None:
                await response.aclose()

    async def refresh_all(self) -> None:
        await asyncio.gather(*(self.refresh(r) for r in self.replicas))

    async def refresh_stale(self) -> None:
        """With ``refresh_older_than``: re-read every healthy replica's view that is
        older than that and not streamed (before routing a request)."""
        if self.refresh_older_than is None:
            return
        oldest = time.monotonic() - self.refresh_older_than
        stale = [r for r in self.replicas if r.healthy and not r.streaming and r.view_time < oldest]
        if stale:
            await asyncio.gather(*(self.refresh(r) for r in stale))

    def start(self) -> None:
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(self._poll_forever())

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        await self.client.aclose()

    async def _poll_forever(self) -> None:
        # One loop per replica: a slow or hung replica never delays the others' views.
        await asyncio.gather(*(self._follow(r) for r in self.replicas))

    async def _follow(self, replica: Replica) -> None:
        """The replica's feed for as long as the router runs: a poll (health, catch-up),
        then its event stream while it has one; polls every ``poll_interval`` otherwise."""
        while True:
            await self.refresh(replica)
            if self.cache_events == "stream" and replica.healthy and replica.has_stream:
                await self._read_stream(replica)
            await asyncio.sleep(self.poll_interval)

    # ---- routing ------------------------------------------------------------------

    def route(
        self,
        token_ids: Sequence[int] | None,
        cache_salt: str | None,
        *,
        takes_prefix_hit: bool = True,
    ) -> Route:
        """Choose a replica for a prompt (None: a prompt the router could not read).
        ``takes_prefix_hit=False``: a request the engine computes whole (it wants the
        prompt's logprobs): routed by its blocks all the same, none expected cached."""
        block_size = self.block_size()
        hashes: tuple[bytes, ...] = ()
        if token_ids and block_size:
            extra_keys = () if cache_salt is None else (cache_salt,)
            hashes = tuple(hash_request_blocks(token_ids, block_size, extra_keys))
        states = [
            ReplicaState(
                r.healthy, r.load, r.kv_usage, r.view.matched_blocks(hashes, with_pending=True)
            )
            for r in self.replicas
        ]
        replica = self.replicas[self.policy.choose(states)]
        predicted = 0
        if token_ids and block_size and takes_prefix_hit:
            matched = replica.view.matched_blocks(hashes, with_pending=True)
            predicted = predicted_cached_tokens(matched, block_size, len(token_ids))
        num_tokens = len(token_ids or ())
        return Route(replica, predicted, hashes, num_tokens, block_size, takes_prefix_hit)

    def block_size(self) -> int | None:
        """The replicas' block size (the hash chain needs it); None until one answered.
        Replicas with different block sizes cannot share a chain: refused."""
        sizes = {r.block_size for r in self.replicas if r.block_size is not None}
        if len(sizes) > 1:
            raise APIError(503, f"replicas disagree on block_size: {sorted(sizes)}")
        return next(iter(sizes), None)

    def prompt_token_ids(self, path: str, body: dict[str, Any]) -> list[int] | None:
        """The token ids the replica will see for this body, or None where the router
        cannot tell (a malformed body: the replica answers it)."""
        from pagedllm.server.chat import render_chat_prompt
        from pagedllm.server.protocol import ChatCompletionRequest, CompletionRequest

        try:
            if path.endswith("/chat/completions"):
                req = ChatCompletionRequest.model_validate(body)
                return render_chat_prompt(self.tokenizer, req).token_ids
            # Validated as the replica will: the hash chain packs token ids as int64.
            prompt = CompletionRequest.model_validate(body).prompt
            if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
                prompt = prompt[0]  # a batch goes to one replica: route by its first prompt
            if isinstance(prompt, str):
                return list(self.tokenizer.encode(prompt))
            if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                return list(prompt)
        except Exception:  # noqa: BLE001 - any unreadable body is the replica's to refuse
            return None
        return None

    def record(self, route: Route, outcome: str, usage: dict[str, Any] | None) -> None:
        replica = route.replica
        label = replica.url
        self.metrics.requests.labels(label, outcome).inc()
        if outcome != "ok":
            replica.num_failed += 1
            return
        if usage is None:
            return
        details = usage.get("prompt_tokens_details") or {}
        reported = int(details.get("cached_tokens") or 0)
        replayed = self._replayed(route, details.get("cache_event_seq"))
        if replayed is None:
            replica.num_unreplayed += 1
        else:
            replica.replayed_cached_tokens += replayed
            self.metrics.replayed.labels(label).inc(replayed)
            at_arrival = self._replayed(route, details.get("arrival_event_seq"))
            self._record_miss(route, reported, at_arrival)
        replica.predicted_cached_tokens += route.predicted_cached_tokens
        replica.reported_cached_tokens += reported
        replica.reported_prompt_tokens += int(usage.get("prompt_tokens") or 0)
        self.metrics.predicted.labels(label).inc(route.predicted_cached_tokens)
        self.metrics.reported.labels(label).inc(reported)
        self.metrics.prompt.labels(label).inc(int(usage.get("prompt_tokens") or 0))

    def _record_miss(self, route: Route, reported: int, at_arrival: int | None) -> None:
        """Count a misprediction where the replica's index changed: before the request
        arrived (its replay at arrival already says what the replica reported) or while
        it waited (anything else)."""
        miss = abs(route.predicted_cached_tokens - reported)
        if not miss or at_arrival is None:
            return
        replica = route.replica
        if at_arrival == reported:
            replica.missed_before_arrival_tokens += miss
            self.metrics.missed.labels(replica.url, "before_arrival").inc(miss)
        else:
            replica.missed_in_queue_tokens += miss
            self.metrics.missed.labels(replica.url, "in_queue").inc(miss)

    @staticmethod
    def _replayed(route: Route, event_seq: Any) -> int | None:
        """The cached tokens the view held where the replica looked the prompt up."""
        if not isinstance(event_seq, int) or not route.num_tokens or not route.block_size:
            return None
        if not route.takes_prefix_hit:
            return 0
        matched = route.replica.view.matched_blocks_at(route.block_hashes, event_seq)
        if matched is None:
            return None
        return predicted_cached_tokens(matched, route.block_size, route.num_tokens)

    def report(self) -> dict[str, Any]:
        now = time.monotonic()
        return {
            "policy": self.policy.name,
            "cache_events": self.cache_events,
            "block_size": self.block_size(),
            "replicas": [
                {
                    "url": r.url,
                    "healthy": r.healthy,
                    "event_stream": r.streaming,
                    "key_refused": r.refused,
                    "view_age_s": round(now - r.view_time, 4) if r.view_time else None,
                    "in_flight": r.load,
                    "kv_usage": r.kv_usage,
                    "cached_blocks": len(r.view.hashes),
                    "pending_blocks": len(r.view.pending),
                    "requests": r.num_requests,
                    "failed": r.num_failed,
                    "predicted_cached_tokens": r.predicted_cached_tokens,
                    "replayed_cached_tokens": r.replayed_cached_tokens,
                    "unreplayed_requests": r.num_unreplayed,
                    "reported_cached_tokens": r.reported_cached_tokens,
                    "reported_prompt_tokens": r.reported_prompt_tokens,
                    "missed_before_arrival_tokens": r.missed_before_arrival_tokens,
                    "missed_in_queue_tokens": r.missed_in_queue_tokens,
                }
                for r in self.replicas
            ],
        }

    def no_replica(self) -> APIError:
        """503 for a request no replica can take, saying when keys were refused."""
        refused = sum(r.refused for r in self.replicas)
        why = f" ({refused} refused the router's --replica-api-key)" if refused else ""
        return APIError(503, f"no healthy replica{why}", code="no_replica")

    # ---- proxying -----------------------------------------------------------------

    async def proxy(self, request: Request) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        if self.block_size() is None:
            await self.refresh_all()
        await self.refresh_stale()
        token_ids = self.prompt_token_ids(request.url.path, body)
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        headers = {k: v for k, v in request.headers.items() if k.lower() in PROXIED_HEADERS}
        stream = body.get("stream") is True
        # echo + logprobs asks for the prompt's logprobs: the engine then takes no prefix hit
        takes_hit = not (body.get("echo") is True and body.get("logprobs") is not None)
        tried: set[str] = set()
        while True:
            route = self._route_untried(token_ids, salt, takes_hit, tried)
            replica = route.replica
            outgoing = self.client.build_request(
                "POST", f"{replica.url}{request.url.path}", content=raw, headers=headers
            )
            replica.load += 1
            replica.view.add_pending(route.block_hashes, time.monotonic())
            try:
                upstream = await self.client.send(outgoing, stream=True)
            except httpx.HTTPError as exc:
                replica.load -= 1
                self._failed(replica, route, exc)
                tried.add(replica.url)
                continue  # it never reached the replica: another one may take it
            replica.num_requests += 1
            if stream and upstream.status_code == 200:
                return StreamingResponse(
                    self._relay(route, upstream),
                    status_code=200,
                    media_type=upstream.headers.get("content-type", "text/event-stream"),
                )
            return await self._whole(route, upstream)

    def _route_untried(
        self, token_ids: Any, salt: str | None, takes_hit: bool, tried: set[str]
    ) -> Route:
        for replica in self.replicas:
            if replica.url in tried:
                replica.healthy = False
        if not any(r.healthy for r in self.replicas):
            raise self.no_replica()
        return self.route(token_ids, salt, takes_prefix_hit=takes_hit)

    def _failed(self, replica: Replica, route: Route, exc: Exception) -> None:
        logger.warning("replica %s failed: %s", replica.url, exc)
        replica.healthy = False
        self.record(route, "error", None)

    async def _whole(self, route: Route, upstream: httpx.Response) -> Response:
        replica = route.replica
        try:
            content = await upstream.aread()
        except httpx.HTTPError as exc:
            self._failed(replica, route, exc)
            raise APIError(502, f"replica {replica.url} failed: {exc}") from None
        finally:
            replica.load -= 1
            await upstream.aclose()
        usage = None
        if upstream.status_code == 200:
            with contextlib.suppress(ValueError, AttributeError):
                usage = json.loads(content).get("usage")
            await self._catch_up(replica, usage)
        self.record(route, "ok" if upstream.status_code < 500 else "error", usage)
        media = upstream.headers.get("content-type", "application/json")
        return Response(content, status_code=upstream.status_code, media_type=media)

    async def _relay(self, route: Route, upstream: httpx.Response) -> AsyncIterator[bytes]:
        replica = route.replica
        usage: dict[str, Any] | None = None
        pending = b""
        outcome = "ok"
        try:
            async for chunk in upstream.aiter_raw():
                usage, pending = _read_usage(pending + chunk, usage)
                yield chunk
        except httpx.HTTPError as exc:
            outcome = "error"
            self._failed(replica, route, exc)
            message = f"replica {replica.url} failed mid-stream: {type(exc).__name__}"
            yield APIError(502, message, code="replica_failed").sse_event()
            yield DONE
        finally:
            replica.load -= 1
            await upstream.aclose()
        if outcome == "ok":
            await self._catch_up(replica, usage)
            self.record(route, outcome, usage)

    async def _catch_up(self, replica: Replica, usage: dict[str, Any] | None) -> None:
        """After a request: the view must reach the log positions its answer names, for
        the replays. A polled view reads them; a streamed one has them, unless the
        answer overtook the stream (two connections): then it reads them too."""
        details = (usage or {}).get("prompt_tokens_details") or {}
        seqs = [details.get(k) for k in ("cache_event_seq", "arrival_event_seq")]
        needed = max((s for s in seqs if isinstance(s, int)), default=0)
        if not replica.streaming or replica.view.next_seq < needed:
            await self.refresh(replica)


def _read_usage(data: bytes, usage: dict[str, Any] | None) -> tuple[dict[str, Any] | None, bytes]:
    """(the latest ``usage`` among the complete SSE events of ``data``, the unfinished
    tail): streams with ``stream_options.include_usage`` end with a usage event."""
    cut = data.rfind(b"\n\n")
    if cut < 0:
        return usage, data
    if b'"usage"' in data[:cut]:
        for line in data[:cut].split(b"\n"):
            if line.startswith(b"data: {") and b'"usage"' in line:
                with contextlib.suppress(ValueError, AttributeError):
                    usage = json.loads(line[6:]).get("usage") or usage
    return usage, data[cut + 2 :]


def create_router_app(
    replica_urls: Sequence[str],
    *,
    tokenizer: Any,
    policy: str = "prefix_aware",
    max_imbalance: int = 8,
    poll_interval: float = 0.1,
    poll_timeout: float = POLL_TIMEOUT_S,
    cache_events: str = "stream",
    refresh_older_than: float | None = None,
    replica_api_key: str | None = None,
    client: httpx.AsyncClient | None = None,
) -> FastAPI:
    """The router's app; ``client`` lets tests route through in-process replicas."""
    router = Router(
        replica_urls,
        make_policy(policy, max_imbalance=max_imbalance),
        tokenizer,
        client=client,
        poll_interval=poll_interval,
        poll_timeout=poll_timeout,
        cache_events=cache_events,
        refresh_older_than=refresh_older_than,
        replica_api_key=replica_api_key,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await router.refresh_all()
        router.start()
        yield
        await router.stop()

    app = FastAPI(title="pagedllm router", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.router = router

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await router.proxy(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await router.proxy(request)

    @app.get("/health")
    async def health() -> Response:
        if any(r.healthy for r in router.replicas):
            return JSONResponse({"status": "ok"})
        return router.no_replica().response()

    @app.get("/v1/router")
    async def report() -> Response:
        return JSONResponse(router.report())

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(router.metrics.render(router.replicas), media_type=CONTENT_TYPE_LATEST)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        return exc.response()

    return app
