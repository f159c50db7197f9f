"""Choosing a data-parallel replica for a request: by the engines' own prefix hashes.

The router keeps, per replica, the set of block hashes that replica's prefix cache holds,
fed by the replica's cache events (``core/cache_events.py``), and hashes each prompt with
the same chain the engines use (``core.hashing.hash_request_blocks``: same token ids, block
size and ``cache_salt``). A replica's expected prefix hit is then the run of the prompt's
leading hashes found in its set, capped as the engine caps it (``num_tokens - 1``)::

    prompt      [b0][b1][b2][b3][..]      hashes h0 h1 h2 h3 (full blocks only)
    replica A   {h0, h1, h7}             -> 2 blocks expected cached
    replica B   {h5}                     -> 0

Blocks just routed to a replica but not yet confirmed by its events count as ``pending``:
the next request of the same tenant follows the first, and expects those blocks cached
(the engine's in-flight sharing makes it wait a step for them rather than compute them
again). A pending hash the events never confirm is forgotten after a while.

A prediction made at routing time can still miss: the replica may evict a block before
the request reaches its scheduler (the view hears of it a message later when the
replica pushes its events, a poll later when it is polled), or a pending block's owner
may be preempted. So the engine reports where its event log stood when it
looked the prefix up (``cache_event_seq``), and the view replays its last events back to
that point (``matched_blocks_at``): the same hashes, the same log, the same hit, by
construction. The router counts both: what it predicted when it routed, and the replay
that checks the hashing itself::

    seq    40 +h0   41 +h1   42 -h1   43 +h9        view now: {h0, h9}, next_seq 44
    engine looked [h0 h1 ..] up at seq 42 (before -h1): index held h0, h1 -> 2 blocks
    matched_blocks_at([h0, h1], 42) undoes 42 and 43 -> 2

Pure Python: the server's router and the planner's multi-replica simulator share it.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from pagedllm.core.cache_events import REMOVED, STORED, CacheEvents

ROUTING_POLICIES = ("prefix_aware", "round_robin", "least_loaded")
# How a router hears of a replica's cache events: pushed as they happen, or polled.
CACHE_EVENT_FEEDS = ("stream", "poll")


def predicted_cached_tokens(num_matched_blocks: int, block_size: int, num_tokens: int) -> int:
    """Tokens an engine would take from its cache given this many matched leading blocks:
    full blocks only, at most ``num_tokens - 1`` tokens (one token is always computed)."""
    if num_tokens <= 0:
        return 0
    return min(num_matched_blocks, (num_tokens - 1) // block_size) * block_size


class ReplicaCacheView:
    """The router's picture of one replica's prefix cache: a set of block hashes kept
    in step with the replica's event log (``apply``), plus hashes routed there but not
    yet confirmed (``pending``, dropped when confirmed or when ``expire_pending`` says),
    and the last ``max_history`` events applied (``matched_blocks_at`` replays them)."""

    def __init__(self, max_history: int = 1 << 16) -> None:
        self.hashes: set[bytes] = set()
        self.pending: dict[bytes, float] = {}  # hash -> time it was routed
        self.epoch: str | None = None
        self.next_seq = 0
        # events [next_seq - len(history), next_seq), oldest first
        self.history: deque[tuple[str, bytes]] = deque(maxlen=max_history)

    def apply(self, batch: CacheEvents) -> None:
        """Replay a batch of the replica's events. It may overlap what was applied (two
        reads in flight): only events from ``next_seq`` on count. A gap or another epoch
        raises ``ValueError``: take a snapshot."""
        if batch.epoch != self.epoch or batch.first_seq > self.next_seq:
            raise ValueError(
                f"events {batch.epoch}:{batch.first_seq} do not continue "
                f"{self.epoch}:{self.next_seq}; take a snapshot"
            )
        if batch.next_seq <= self.next_seq:
            return  # nothing new
        for kind, block_hash in batch.events[self.next_seq - batch.first_seq :]:
            self.history.append((kind, block_hash))
            if kind == STORED:
                self.hashes.add(block_hash)
                self.pending.pop(block_hash, None)
            elif kind == REMOVED:
                self.hashes.discard(block_hash)
        self.next_seq = batch.next_seq

    def reset(self, epoch: str, next_seq: int, hashes: Iterable[bytes]) -> None:
        """Start over from a snapshot: every hash the replica's index holds now."""
        self.epoch, self.next_seq = epoch, next_seq
        self.hashes = set(hashes)
        self.history.clear()
        for block_hash in self.hashes:
            self.pending.pop(block_hash, None)

    def add_pending(self, block_hashes: Sequence[bytes], now: float) -> None:
        for block_hash in block_hashes:
            if block_hash not in self.hashes:
                self.pending[block_hash] = now

    def expire_pending(self, older_than: float) -> None:
        """Forget pending hashes routed before ``older_than`` that never showed up."""
        self.pending = {h: t for h, t in self.pending.items() if t >= older_than}

    def matched_blocks(self, block_hashes: Sequence[bytes], *, with_pending: bool) -> int:
        """How many leading hashes of the chain this replica holds."""
        count = 0
        for block_hash in block_hashes:
            if block_hash in self.hashes or (with_pending and block_hash in self.pending):
                count += 1
            else:
                break
        return count

    def matched_blocks_at(self, block_hashes: Sequence[bytes], seq: int) -> int | None:
        """How many leading hashes of the chain the replica's index held after its events
        before ``seq``: the view with its later events undone. None when ``seq`` is not
        within the events this view remembers (too old, or not read yet)."""
        first = self.next_seq - len(self.history)
        if not first <= seq <= self.next_seq:
            return None
        wanted = set(block_hashes)
        held_at_seq: dict[bytes, bool] = {}  # the first later event on a hash says
        for kind, block_hash in itertools.islice(self.history, seq - first, None):
            if block_hash in wanted and block_hash not in held_at_seq:
                held_at_seq[block_hash] = kind == REMOVED
        count = 0
        for block_hash in block_hashes:
            if not held_at_seq.get(block_hash, block_hash in self.hashes):
                break
            count += 1
        return count


@dataclass(frozen=True, slots=True)
class ReplicaState:
    """What a policy sees of one replica when it chooses."""

    healthy: bool
    load: int  # requests routed there and not finished (the router's own count)
    kv_usage: float  # fraction of its KV blocks in use, as last reported
    matched_blocks: int  # leading prompt blocks its cache holds (confirmed or pending)


class RoutingPolicy(Protocol):
    """Picks a replica index among the healthy ones."""

    name: str

    def choose(self, replicas: Sequence[ReplicaState]) -> int: ...


def _healthy(replicas: Sequence[ReplicaState]) -> list[int]:
    healthy = [i for i, r in enumerate(replicas) if r.healthy]
    if not healthy:
        raise ValueError("no healthy replica")
    return healthy


def _least_loaded(replicas: Sequence[ReplicaState], candidates: list[int]) -> int:
    return min(candidates, key=lambda i: (replicas[i].load, replicas[i].kv_usage, i))


class RoundRobin:
    """Each healthy replica in turn (the baseline that ignores caches)."""

    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, replicas: Sequence[ReplicaState]) -> int:
        healthy = _healthy(replicas)
        return healthy[next(self._counter) % len(healthy)]


class LeastLoaded:
    """Fewest requests in flight, then lowest KV usage (the load-only baseline)."""

    name = "least_loaded"

    def choose(self, replicas: Sequence[ReplicaState]) -> int:
        return _least_loaded(replicas, _healthy(replicas))


@dataclass(frozen=True, slots=True)
class PrefixAware:
    """Longest expected prefix hit, unless that would overload a replica.

    When the busiest healthy replica has more than ``max_imbalance`` requests beyond the
    idlest, and the prefix choice is that busy, the request goes to the least loaded one
    instead (SGLang's cache-aware router balances the same way). Without any hit, or
    between equal hits, the least loaded replica wins: a new tenant's first request
    lands where there is room, and the next ones follow it.
    """

    max_imbalance: int = 8
    name: str = "prefix_aware"

    def choose(self, replicas: Sequence[ReplicaState]) -> int:
        healthy = _healthy(replicas)
        best = max(replicas[i].matched_blocks for i in healthy)
        idlest = _least_loaded(replicas, healthy)
        if best == 0:
            return idlest
        matched = [i for i in healthy if replicas[i].matched_blocks == best]
        choice = _least_loaded(replicas, matched)
        if replicas[choice].load - replicas[idlest].load > self.max_imbalance:
            return idlest
        return choice


def make_policy(name: str, *, max_imbalance: int = 8) -> RoutingPolicy:
    """A routing policy by name (``ROUTING_POLICIES``)."""
    if name == "prefix_aware":
        return PrefixAware(max_imbalance)
    if name == "round_robin":
        return RoundRobin()
    if name == "least_loaded":
        return LeastLoaded()
    raise ValueError(f"unknown routing policy {name!r}; choose from {', '.join(ROUTING_POLICIES)}")
