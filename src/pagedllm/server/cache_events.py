"""``GET /v1/cache/events``: a replica's prefix-cache events as JSON, and their reading.

A router asks ``?epoch=E&since=N`` and gets the events from ``N`` on (``core/cache_events``);
when the log no longer reaches back to ``N`` or the epoch is not the replica's (first
call, or the replica restarted), it gets a ``snapshot`` of every hash the index holds::

    {"epoch": "…", "block_size": 16, "first_seq": 40, "next_seq": 42,
     "events": [["+", "9f…"], ["-", "03…"]],               # or "snapshot": ["9f…", …]
     "kv_usage": 0.31, "num_running": 3, "num_waiting": 0}

Hashes travel as hex. Both sides of the wire live here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedllm.core.cache_events import CacheEvents
from pagedllm.engine.reports import events_report

__all__ = ["EventsReply", "events_report", "parse_events_reply"]


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
