"""Pins: the references waiting requests hold on their cached prefix.

A *pin* is one reference a waiting request holds on each block of its cached prefix
(taken when it arrives), so that eviction cannot take them while it waits behind
others: a pinned block is referenced, not cached-free. The pin ends when the request is
admitted (its table takes its own references first), leaves, or gives way to an
allocation that needs the room (``give_up``)::

    arrives   pin            b0 b1 b2 cached -> ref +1 each (pinned)
    waits                    eviction takes other blocks; b0..b2 stay
    admitted  allocate_slots table [b0 b1 b2 new..]: ref +1, then the pin's -1

The manager (``core/device_pool.py``) decides which blocks to pin; ``Pins`` keeps the
books and the references.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from pagedllm.core.block_pool import BlockPool
from pagedllm.core.compaction import remap_table
from pagedllm.core.request import Request


class Pins:
    """The pins on one device pool, by request id."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self._by_request: dict[str, list[int]] = {}  # request id -> the blocks it holds

    def pin(self, request_id: str, block_ids: list[int]) -> int:
        """Pin ``block_ids`` for a request holding no pin; returns how many."""
        if request_id in self._by_request:
            raise ValueError(f"request {request_id!r} is already pinned")
        if block_ids:
            self.pool.incref(block_ids)
            self._by_request[request_id] = block_ids
        return len(block_ids)

    def release(self, request_id: str) -> int:
        """End the request's pin (none: nothing happens); returns how many blocks it
        held. A block nobody else holds becomes cached-free again, tail blocks first."""
        block_ids = self._by_request.pop(request_id, None)
        if block_ids is None:
            return 0
        self.pool.decref(reversed(block_ids))
        return len(block_ids)

    def give_up(self, requests: Iterable[Request], num_free_blocks: int) -> int:
        """Release the pins of ``requests``, in the order given, until ``num_free_blocks``
        blocks are free; returns how many pins it released. None when that many are free
        already, or when even all of theirs would not make them free (a pin gives way
        only where that makes the room)."""
        pool = self.pool
        if pool.num_free_blocks >= num_free_blocks:
            return 0
        pinned = [r for r in requests if r.request_id in self._by_request]
        if pool.num_free_blocks + self._num_freed_by(pinned) < num_free_blocks:
            return 0
        released = 0
        for request in pinned:
            self.release(request.request_id)
            released += 1
            if pool.num_free_blocks >= num_free_blocks:
                break
        return released

    def holds(self, request_id: str) -> bool:
        return request_id in self._by_request

    @property
    def num_requests(self) -> int:
        return len(self._by_request)

    def block_ids(self, request_id: str) -> list[int]:
        """The blocks the request's pin holds (a copy; empty if none)."""
        return list(self._by_request.get(request_id, ()))

    def check(self, tables: dict[str, list[int]], held: Counter[int]) -> None:
        """A pinned request holds no table and no block twice; adds the pins' blocks to
        ``held``."""
        for request_id, block_ids in self._by_request.items():
            assert request_id not in tables, f"{request_id}: pinned and admitted"
            assert block_ids and len(set(block_ids)) == len(block_ids), f"{request_id}: pin"
            held.update(block_ids)

    @property
    def num_pinned_only_blocks(self) -> int:
        """Blocks held by pins alone (cached-free but for them)."""
        return self._num_freed_by_pins(self._by_request.values())

    def remap(self, mapping: dict[int, int]) -> None:
        """Rename blocks the pool moved (compaction)."""
        for block_ids in self._by_request.values():
            remap_table(block_ids, mapping)

    def _num_freed_by(self, requests: Sequence[Request]) -> int:
        """Blocks that releasing these requests' pins would make free."""
        return self._num_freed_by_pins(self._by_request[r.request_id] for r in requests)

    def _num_freed_by_pins(self, pins: Iterable[list[int]]) -> int:
        counts = Counter(b for block_ids in pins for b in block_ids)
        ref_count = self.pool.ref_count
        return sum(1 for b, n in counts.items() if ref_count(b) == n)
