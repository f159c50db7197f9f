"""A replica's prefix-cache events for routers: polled as JSON, or pushed as they happen.

``GET /v1/cache/events?epoch=E&since=N`` answers the events from ``N`` on
(``core/cache_events``); when the log no longer reaches back to ``N`` or the epoch is not
the replica's (first call, or the replica restarted), a ``snapshot`` of every hash the
index holds::

    {"epoch": "…", "block_size": 16, "first_seq": 40, "next_seq": 42,
     "events": [["+", "9f…"], ["-", "03…"]],               # or "snapshot": ["9f…", …]
     "kv_usage": 0.31, "num_running": 3, "num_waiting": 0}

``GET /v1/cache/events/stream?epoch=E&since=N&heartbeat=S`` (Server-Sent Events): the same
answer first, then one ``data:`` event of the same shape per batch the engine core pushes
(after a step's schedule and after the step: ``engine/core.py``), and a ``: keep-alive``
comment after ``S`` quiet seconds, so a reader knows a silent stream from a dead one::

    router                     API process (CacheEventFeed)         engine core
    GET .../stream  ---------> subscribe, watch_events ----------->  pushes from now on
                    <--------- data: {events|snapshot up to N}      events_report(E, N)
                    <--------- data: {first_seq: M <= N, ...}  <--   ["events", batch]
                    <--------- : keep-alive   (S s without a batch)

Batches are contiguous and may overlap what came before (the reader applies only what is
new); a reader too slow to take them (``MAX_QUEUED_BATCHES`` behind) is cut off and
reconnects from its ``next_seq``. Hashes travel as hex. Both sides of the wire live here.
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pagedllm.core.cache_events import CacheEvents
from pagedllm.engine.reports import events_report

__all__ = ["CacheEventFeed", "EventsReply", "events_report", "parse_events_reply"]

MAX_QUEUED_BATCHES = 4096
KEEP_ALIVE = b": keep-alive\n\n"


@dataclass(frozen=True, slots=True)
class EventsReply:
    """A replica's answer, decoded: events that continue the reader's view, or a snapshot."""

    block_size: int
    batch: CacheEvents | None
    snapshot: tuple[bytes, ...] | None
    epoch: str
    next_seq: int
    kv_usage: float
    num_running: int
    num_waiting: int


def parse_events_reply(body: dict[str, Any]) -> EventsReply:
    """Decode ``events_report``'s JSON; ``ValueError`` for a malformed reply."""
    try:
        epoch, next_seq = str(body["epoch"]), int(body["next_seq"])
        batch = snapshot = None
        if "snapshot" in body:
            snapshot = tuple(bytes.fromhex(h) for h in body["snapshot"])
        else:
            events = tuple((str(kind), bytes.fromhex(h)) for kind, h in body["events"])
            batch = CacheEvents(epoch, int(body["first_seq"]), next_seq, events)
        return EventsReply(
            block_size=int(body["block_size"]),
            batch=batch,
            snapshot=snapshot,
            epoch=epoch,
            next_seq=next_seq,
            kv_usage=float(body.get("kv_usage", 0.0)),
            num_running=int(body.get("num_running", 0)),
            num_waiting=int(body.get("num_waiting", 0)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"malformed cache events reply: {exc!r}") from None


def events_frame(body: dict[str, Any]) -> bytes:
    """One SSE event carrying an events reply (``events_report``'s shape)."""
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


@dataclass(slots=True)
class _Subscriber:
    frames: deque[bytes] = field(default_factory=deque)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    cut_off: bool = False


class CacheEventFeed:
    """The engine core's pushed cache events, encoded once and fanned out to every open
    ``/v1/cache/events/stream`` (one per router, usually)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._subscribers: list[_Subscriber] = []
        self._watch: asyncio.Future[Any] | None = None  # the core asked to push, once

    async def stream(self, epoch: str | None, since: int, heartbeat: float) -> AsyncIterator[bytes]:
        """The SSE body: the reply to ``(epoch, since)``, then every pushed batch."""
        subscriber = _Subscriber()
        self._subscribers.append(subscriber)
        try:
            await asyncio.shield(self._watching())
            # after subscribing: every batch the core pushes from here on is queued
            yield events_frame(await self.engine.events_report(epoch, since))
            while not subscriber.cut_off:
                if not subscriber.frames:
                    subscriber.ready.clear()
                    try:  # asyncio.timeout: see Router.refresh on wait_for and cancels
                        async with asyncio.timeout(heartbeat):
                            await subscriber.ready.wait()
                    except TimeoutError:
                        yield KEEP_ALIVE
                    continue
                yield subscriber.frames.popleft()
        finally:
            self._subscribers.remove(subscriber)

    def _watching(self) -> asyncio.Future[Any]:
        """One ``watch_cache_events`` for all streams (asked again if it failed)."""
        watch = self._watch
        if watch is None or (watch.done() and (watch.cancelled() or watch.exception())):
            self._watch = asyncio.ensure_future(self.engine.watch_cache_events(self._on_batch))
        assert self._watch is not None
        return self._watch

    def _on_batch(self, batch: dict[str, Any]) -> None:
        if not self._subscribers:
            return
        frame = events_frame(batch)  # already the poll's shape (EngineCore.pending_events)
        for subscriber in self._subscribers:
            if len(subscriber.frames) >= MAX_QUEUED_BATCHES:
                subscriber.cut_off = True  # it reconnects from its next_seq
            else:
                subscriber.frames.append(frame)
            subscriber.ready.set()
