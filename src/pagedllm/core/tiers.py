"""Where a block's data lives, below the block tables. Pure Python bookkeeping.

    device pool    ``BlockPool``: the blocks the model attends over, with the prefix index
    host swap tier ``HostSwapTier``: blocks of requests preempted by swapping, one host
                   table per swapped request, no prefix index
    disk store     ``DiskTier``: which block hashes the content-addressed store on disk
                   holds, in LRU order within a capacity, and the I/O the worker owes it

``KVCacheManager`` asks the tiers; it does not keep their books. The worker moves the
bytes (``SchedulerOutput.swap_out`` / ``swap_in``); nothing here holds a tensor.

A swap remembers the copy it made, so that a device block shared by several swapped
requests takes one host block and moves once, and so does a host block on the way
back. ``CopyMap`` keeps those copies for one direction: source -> (target, fill), the
target holding the source's first ``fill`` slots. Holders of a block never rewrite slots
below their own fill, so a copy stays good for a later holder with the same fill until
either side is re-allocated (``forget``).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from pagedllm.core.block_pool import BlockPool

# One swap plan entry: (source block, target block or None for a new one, fill).
SwapPlan = list[tuple[int, int | None, int]]
# One block's disk I/O: (device block, block hash, its token ids).
DiskBlock = tuple[int, bytes, tuple[int, ...]]


class CopyMap:
    """Copies made in one direction: source -> (target, fill), target -> source."""

    def __init__(self) -> None:
        self._by_source: dict[int, tuple[int, int]] = {}
        self._by_target: dict[int, int] = {}

    def __bool__(self) -> bool:
        return bool(self._by_source or self._by_target)

    def record(self, source: int, target: int, fill: int) -> None:
        """``target`` (just allocated) now holds ``source``'s first ``fill`` slots; an
        older copy of ``source`` is no longer its copy."""
        self.forget_source(source)
        self._by_source[source] = (target, fill)
        self._by_target[target] = source

    def target(self, source: int, fill: int) -> int | None:
        """The block holding a copy of ``source``'s first ``fill`` slots, if any."""
        copy = self._by_source.get(source)
        return copy[0] if copy is not None and copy[1] == fill else None

    def forget_source(self, source: int) -> None:
        """``source`` was re-allocated: its old content (and copies of it) are gone."""
        copy = self._by_source.pop(source, None)
        if copy is not None and self._by_target.get(copy[0]) == source:
            del self._by_target[copy[0]]

    def forget_target(self, target: int) -> None:
        """``target`` was re-allocated: it no longer holds a copy of anything."""
        source = self._by_target.pop(target, None)
        if source is not None and self._by_source.get(source, (None,))[0] == target:
            del self._by_source[source]

    def rename(self, sources: dict[int, int], targets: dict[int, int]) -> None:
        """Blocks moved (compaction): rename sources and targets through the maps."""
        self._by_source = {
            sources.get(s, s): (targets.get(t, t), fill) for s, (t, fill) in self._by_source.items()
        }
        self._by_target = {targets.get(t, t): sources.get(s, s) for t, s in self._by_target.items()}

    def check_invariants(self) -> None:
        assert len(self._by_source) == len(self._by_target), "copy map: one-sided entry"
        for target, source in self._by_target.items():
            assert self._by_source.get(source, (None,))[0] == target, (
                f"copy map: target {target} names source {source}, which points elsewhere"
            )


class HostSwapTier:
    """The host tier of swapped-out requests: a ``BlockPool`` without prefix index, one
    host table per swapped request, and the copies between the two tiers.

    The manager plans with ``plan_out`` / ``reusable_device_copy``, allocates device
    blocks itself, and tells the tier what happened (``move_out``, ``moved_in``,
    ``device_blocks_allocated``)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {num_blocks}")
        self.pool = BlockPool(num_blocks)
        self._tables: dict[str, list[int]] = {}
        self._to_host = CopyMap()  # device source -> host copy
        self._to_device = CopyMap()  # host source -> device copy

    # ---- views ---------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def holds(self, request_id: str) -> bool:
        return request_id in self._tables

    def table(self, request_id: str) -> list[int]:
        """The request's host table (a copy; empty if it is not swapped out)."""
        return list(self._tables.get(request_id, ()))

    def tables(self) -> dict[str, list[int]]:
        return {rid: list(table) for rid, table in self._tables.items()}

    # ---- swap out ------------------------------------------------------------------

    def plan_out(self, device_table: Sequence[int], fills: Sequence[int]) -> tuple[SwapPlan, int]:
        """Per device block: the host block already holding its copy, or None (a new
        one); and how many new host blocks that takes."""
        plan: SwapPlan = []
        num_new = 0
        for device, fill in zip(device_table, fills, strict=True):
            host = self._to_host.target(device, fill)
            if host is not None and self.pool.ref_count(host) == 0:
                host = None  # the copy's holders are gone; it may be overwritten any time
            plan.append((device, host, fill))
            num_new += host is None
        return plan, num_new

    def move_out(self, request_id: str, plan: SwapPlan) -> list[tuple[int, int]] | None:
        """Give the request a host table following ``plan``; the ``(device, host)`` moves
        to make, or None (no change) when the host tier lacks room."""
        if request_id in self._tables:
            raise ValueError(f"request {request_id!r} is already swapped out")
        num_new = sum(host is None for _, host, _ in plan)
        new_hosts = self.pool.allocate(num_new)
        if new_hosts is None:
            return None
        for block_id in new_hosts:
            self._to_device.forget_source(block_id)
            self._to_host.forget_target(block_id)
        new_host = iter(new_hosts)
        moves, table = [], []
        for device, host, fill in plan:
            if host is None:
                host = next(new_host)
                moves.append((device, host))
                self._to_host.record(device, host, fill)
            else:
                self.pool.incref((host,))
            table.append(host)
        self._tables[request_id] = table
        return moves

    # ---- swap in -------------------------------------------------------------------

    def reusable_device_copy(
        self, host: int, fill: int, is_held: Callable[[int], bool]
    ) -> int | None:
        """A device block already holding ``host``'s first ``fill`` slots and still held
        (so not overwritten), or None."""
        device = self._to_device.target(host, fill)
        return device if device is not None and is_held(device) else None

    def moved_in(self, request_id: str, moves: Iterable[tuple[int, int, int]]) -> None:
        """The request is back on the device: ``(host, device, fill)`` copies were made;
        its host blocks are released (tail first)."""
        for host, device, fill in moves:
            self._to_device.record(host, device, fill)
        table = self._tables.pop(request_id)
        self.pool.decref(reversed(table))

    def device_blocks_allocated(self, block_ids: Iterable[int]) -> None:
        """Device blocks were handed out again: they hold no copy and are no source."""
        if self._to_host or self._to_device:
            for block_id in block_ids:
                self._to_host.forget_source(block_id)
                self._to_device.forget_target(block_id)

    def device_blocks_relocated(self, mapping: dict[int, int]) -> None:
        """Compaction moved device blocks ``src -> dst`` (each ``dst`` was free): the
        copies follow the data."""
        if self._to_host or self._to_device:
            self.device_blocks_allocated(mapping.values())  # stale records of the targets
            self._to_host.rename(mapping, {})
            self._to_device.rename({}, mapping)

    def release(self, request_id: str) -> None:
        """Drop the request's host table, tail first (nothing if it holds none)."""
        table = self._tables.pop(request_id, None)
        if table:
            self.pool.decref(reversed(table))

    def check_invariants(self, num_slots: Callable[[str], int], block_size: int) -> None:
        """Raise AssertionError unless host ref counts match the tables and copies agree."""
        self.pool.check_invariants()
        held: Counter[int] = Counter()
        for request_id, table in self._tables.items():
            assert len(set(table)) == len(table), f"{request_id}: host block twice in a table"
            assert len(table) * block_size >= num_slots(request_id), (
                f"{request_id}: host table too short for its slots"
            )
            held.update(table)
        for block_id in range(self.pool.num_blocks):
            assert self.pool.ref_count(block_id) == held[block_id], (
                f"host block {block_id}: ref_count {self.pool.ref_count(block_id)}, "
                f"held by {held[block_id]} tables"
            )
        self._to_host.check_invariants()
        self._to_device.check_invariants()


@dataclass(frozen=True, slots=True)
class DiskOps:
    """The disk I/O of one step, for the worker, in this order: ``stores`` are read from
    the device before anything else of the step writes a block (then written in the
    background), ``loads`` are read into their (fresh) device blocks before the forward
    pass, ``drops`` are deleted after both (a hash may be loaded, then dropped)."""

    stores: tuple[DiskBlock, ...] = ()
    loads: tuple[DiskBlock, ...] = ()
    drops: tuple[bytes, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.stores or self.loads or self.drops)


NO_DISK_OPS = DiskOps()


class DiskTier:
    """Which full blocks the store on disk holds, keyed by block hash (salt included), in
    least-recently-used order, at most ``capacity`` of them; and the I/O the worker owes.

    A hash is *present* from the moment its store is planned: the worker keeps the bytes
    of a store in flight and serves a load of it from them. A block registered in the
    prefix index is stored once (``block_registered``); an admitted disk hit is loaded
    into a fresh device block (``load``); past capacity the least recently used hashes
    are dropped. A load the worker could not do (missing, truncated or corrupt file) is
    ``discard``-ed: a miss from then on.
    """

    def __init__(self, capacity: int, present: Iterable[bytes] = ()) -> None:
        if capacity < 0:
            raise ValueError(f"disk capacity must be >= 0 blocks, got {capacity}")
        self.capacity = capacity
        self._hashes: OrderedDict[bytes, None] = OrderedDict.fromkeys(present)  # LRU first
        self._stores: list[DiskBlock] = []
        self._loads: list[DiskBlock] = []
        self._drops: list[bytes] = []
        self._shrink()

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._hashes

    def __len__(self) -> int:
        return len(self._hashes)

    def hashes(self) -> list[bytes]:
        """Present hashes, least recently used first."""
        return list(self._hashes)

    def block_registered(self, block_id: int, block_hash: bytes, token_ids: Sequence[int]) -> None:
        """A full block entered the prefix index: store it unless the disk has it."""
        if block_hash in self._hashes:
            self._hashes.move_to_end(block_hash)
            return
        if not self.capacity:
            return
        self._hashes[block_hash] = None
        self._stores.append((block_id, block_hash, tuple(token_ids)))
        self._shrink()

    def load(self, block_id: int, block_hash: bytes, token_ids: Sequence[int]) -> None:
        """An admitted disk hit: read ``block_hash`` into device block ``block_id``."""
        if block_hash not in self._hashes:
            raise ValueError("load of a hash the disk tier does not hold")
        self._hashes.move_to_end(block_hash)
        self._loads.append((block_id, block_hash, tuple(token_ids)))

    def discard(self, block_hash: bytes) -> None:
        """The worker found no good copy of ``block_hash``: it is gone."""
        if self._hashes.pop(block_hash, False) is None:
            self._drops.append(block_hash)

    def take_ops(self) -> DiskOps:
        """The I/O planned since the last call (and forget it)."""
        if not (self._stores or self._loads or self._drops):
            return NO_DISK_OPS
        ops = DiskOps(tuple(self._stores), tuple(self._loads), tuple(self._drops))
        self._stores, self._loads, self._drops = [], [], []
        return ops

    def check_invariants(self) -> None:
        assert len(self._hashes) <= self.capacity, "disk tier over capacity"
        stored = [block_hash for _, block_hash, _ in self._stores]
        assert len(set(stored)) == len(stored), "a hash stored twice in one step"

    def _shrink(self) -> None:
        # A hash with a load planned this step is touched, so it sits at the MRU end and
        # goes last; the worker loads before it drops anyway.
        while len(self._hashes) > self.capacity:
            block_hash, _ = self._hashes.popitem(last=False)
            self._drops.append(block_hash)
