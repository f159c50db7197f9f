"""The prefix cache's change log: which block hashes became findable and which stopped.

A replica's ``BlockPool`` writes one event when a full block is registered under its hash
(``stored``) and one when the hash leaves the index (``removed``: the block was evicted or
reused). A router reads the log from a sequence number on, so its picture of the
replica's cache is the replica's own hash chain, not a guess::

    seq:    0        1        2         3
            +h0      +h1      -h0       +h2        (log keeps the newest max_events)
    since(1) -> CacheEvents(events=((STORED,h1), (REMOVED,h0), (STORED,h2)), next_seq=4)

A reader that fell further behind than the log reaches (or saw another ``epoch``: the
replica restarted) gets ``None`` from ``since`` and asks for a snapshot instead.
"""

from __future__ import annotations

import itertools
import uuid
from collections import deque
from dataclasses import dataclass

STORED = "+"
REMOVED = "-"


@dataclass(frozen=True, slots=True)
class CacheEvents:
    """Events ``[first_seq, next_seq)`` of one log, oldest first."""

    epoch: str
    first_seq: int
    next_seq: int
    events: tuple[tuple[str, bytes], ...]


class CacheEventLog:
    """A bounded, append-only log of ``(kind, block_hash)`` with sequence numbers."""

    def __init__(self, max_events: int = 1 << 16) -> None:
        if max_events < 1:
            raise ValueError(f"max_events must be >= 1, got {max_events}")
        self.epoch = uuid.uuid4().hex[:12]
        self._events: deque[tuple[str, bytes]] = deque(maxlen=max_events)
        self.next_seq = 0

    def stored(self, block_hash: bytes) -> None:
        self._events.append((STORED, block_hash))
        self.next_seq += 1

    def removed(self, block_hash: bytes) -> None:
        self._events.append((REMOVED, block_hash))
        self.next_seq += 1

    @property
    def first_seq(self) -> int:
        """The oldest sequence number still in the log."""
        return self.next_seq - len(self._events)

    def since(self, seq: int) -> CacheEvents | None:
        """Events from ``seq`` on, or None when the log no longer reaches back that far
        (or ``seq`` lies in the future: a reader of another epoch)."""
        if seq < self.first_seq or seq > self.next_seq:
            return None
        # From the newest end: a reader that keeps up asks for the last few of many.
        events = tuple(itertools.islice(reversed(self._events), self.next_seq - seq))[::-1]
        return CacheEvents(self.epoch, seq, self.next_seq, events)
