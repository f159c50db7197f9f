"""The three wastes and the headroom, computed from an allocator's current state.

Both allocators are first reduced to one picture (``AllocatorView``): physical
units held by live sequences (paged: blocks; contiguous: one run per sequence),
which positions of which sequence each unit holds, and the free extents.

    internal     allocated slots holding no token (sum over physical units of
                 size minus the most any holder has filled)
    external     free slots the next waiting sequence cannot use because the
                 extent they lie in is smaller than it needs (paged: a block
                 is all anyone needs, so zero, but computed)
    duplication  filled physical slots minus distinct prefixes stored: a slot
                 whose (position, every token up to it) another slot holds too
    headroom     free slots, and how many more sequences of a length fit

Fractions are of allocated slots (``*_fraction``) or of the cache (``*_cache_fraction``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from pagedllm.core.contiguous import ContiguousAllocator
from pagedllm.core.hybrid_kv import HybridKVCacheManager
from pagedllm.core.kv_cache_manager import KVCacheManager


@dataclass(frozen=True, slots=True)
class AllocatorView:
    """One allocator's state, reduced to what the wastes need.

    ``units``: physical unit id -> size in slots, for units held by live sequences.
    ``layouts``: request id -> ``((unit_id, first_position, num_filled), ...)``.
    ``free_extents``: sizes of the free extents (paged: one per free block).
    ``contiguous``: a new sequence needs one extent of its whole reservation.
    ``reserve_len``: contiguous slots reserved per sequence regardless of its
    length (the ``max_len`` policy), else None.
    """

    total_slots: int
    block_size: int
    contiguous: bool
    reserve_len: int | None
    units: dict
    layouts: dict[str, tuple[tuple[object, int, int], ...]]
    free_extents: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class WasteReport:
    """Waste (in token slots) of one allocator state; see the module docstring."""

    total_slots: int
    allocated_slots: int
    filled_slots: int
    internal_tokens: int
    external_tokens: int
    duplication_tokens: int | None  # None: no token ids were given
    headroom_tokens: int
    block_size: int
    contiguous: bool
    reserve_len: int | None
    free_extents: tuple[int, ...]

    def _of_allocated(self, tokens: int | None) -> float:
        return (tokens or 0) / self.allocated_slots if self.allocated_slots else 0.0

    def _of_cache(self, tokens: int | None) -> float:
        return (tokens or 0) / self.total_slots

    @property
    def internal_fraction(self) -> float:
        return self._of_allocated(self.internal_tokens)

    @property
    def external_fraction(self) -> float:
        return self._of_allocated(self.external_tokens)

    @property
    def duplication_fraction(self) -> float:
        return self._of_allocated(self.duplication_tokens)

    @property
    def internal_cache_fraction(self) -> float:
        return self._of_cache(self.internal_tokens)

    @property
    def external_cache_fraction(self) -> float:
        return self._of_cache(self.external_tokens)

    @property
    def duplication_cache_fraction(self) -> float:
        return self._of_cache(self.duplication_tokens)

    def headroom_sequences(self, length: int) -> int:
        """How many more sequences of ``length`` tokens could be placed now."""
        if length <= 0:
            raise ValueError(f"length must be positive, got {length}")
        if self.contiguous:
            size = self.reserve_len or length
            return sum(extent // size for extent in self.free_extents)
        blocks_each = -(-length // self.block_size)
        free_blocks = sum(extent // self.block_size for extent in self.free_extents)
        return free_blocks // blocks_each


def view_of(allocator: KVCacheManager | ContiguousAllocator) -> AllocatorView:
    """Reduce either allocator to an ``AllocatorView`` (device tier only for paged)."""
    if isinstance(allocator, KVCacheManager):
        return _paged_view(allocator)
    if isinstance(allocator, ContiguousAllocator):
        return _contiguous_view(allocator)
    raise TypeError(f"no accounting for {type(allocator).__name__}")


def group_wastes(
    kv: HybridKVCacheManager,
    token_ids: Mapping[str, Sequence[int]] | None = None,
    next_request_len: int | None = None,
) -> list[WasteReport]:
    """``waste`` of each KV cache group of a grouped manager, in group order (each over
    the whole shared pool: its total, free extents and headroom are the pool's)."""
    return [waste(group, token_ids, next_request_len) for group in kv.groups]


def _merged(reports: Sequence[WasteReport]) -> WasteReport:
    """The groups' reports as one: slots held, filled and wasted add up (a block is in
    one group only); the pool's figures are every group's."""
    first = reports[0]
    duplication = [r.duplication_tokens for r in reports]
    return replace(
        first,
        allocated_slots=sum(r.allocated_slots for r in reports),
        filled_slots=sum(r.filled_slots for r in reports),
        internal_tokens=sum(r.internal_tokens for r in reports),
        duplication_tokens=None if None in duplication else sum(duplication),  # type: ignore[arg-type]
    )


def waste(
    allocator: KVCacheManager | HybridKVCacheManager | ContiguousAllocator | AllocatorView,
    token_ids: Mapping[str, Sequence[int]] | None = None,
    next_request_len: int | None = None,
) -> WasteReport:
    """Measure the allocator's waste now.

    ``token_ids``: each live sequence's tokens (at least those it holds), needed for
    duplication. ``next_request_len``: total tokens the next waiting sequence will
    hold (prompt + max_tokens); without it there is nobody to fail, so no external
    waste.
    """
    if isinstance(allocator, HybridKVCacheManager):
        merged = _merged(group_wastes(allocator, token_ids, next_request_len))
        # The grouped manager holds the pins, not its groups: their blocks are free here.
        pinned = (allocator.block_size,) * allocator.num_pinned_only_blocks
        return replace(
            merged,
            headroom_tokens=merged.headroom_tokens + sum(pinned),
            free_extents=merged.free_extents + pinned,
        )
    view = allocator if isinstance(allocator, AllocatorView) else view_of(allocator)
    filled = _filled_per_unit(view)
    allocated = sum(view.units.values())
    filled_slots = sum(filled.values())
    return WasteReport(
        total_slots=view.total_slots,
        allocated_slots=allocated,
        filled_slots=filled_slots,
        internal_tokens=allocated - filled_slots,
        external_tokens=_external(view, next_request_len),
        duplication_tokens=None
        if token_ids is None
        else filled_slots - _distinct_prefixes(view, token_ids),
        headroom_tokens=sum(view.free_extents),
        block_size=view.block_size,
        contiguous=view.contiguous,
        reserve_len=view.reserve_len,
        free_extents=view.free_extents,
    )


# ---- internal -----------------------------------------------------------------------


def _paged_view(kv: KVCacheManager) -> AllocatorView:
    bs = kv.block_size
    units: dict[int, int] = {}
    layouts = {}
    for request_id, table in kv.live_block_tables().items():
        num_tokens = kv.num_slots(request_id)
        layout = []
        for i, block_id in enumerate(table):
            if block_id == kv.null_block:
                continue  # released out of the sliding window: holds nothing
            units[block_id] = bs
            layout.append((block_id, i * bs, max(0, min(bs, num_tokens - i * bs))))
        layouts[request_id] = tuple(layout)
    return AllocatorView(
        total_slots=kv.num_blocks * bs,
        block_size=bs,
        contiguous=False,
        reserve_len=None,
        units=units,
        layouts=layouts,
        # A block only waiting requests' pins hold gives way to any allocation: free here.
        free_extents=(bs,) * (kv.num_free_blocks + kv.num_pinned_only_blocks),
    )


def _contiguous_view(alloc: ContiguousAllocator) -> AllocatorView:
    runs = alloc.runs()
    return AllocatorView(
        total_slots=alloc.num_slots,
        block_size=1,
        contiguous=True,
        reserve_len=alloc.max_model_len if alloc.policy == "max_len" else None,
        units={request_id: length for request_id, (_, length) in runs.items()},
        layouts={rid: ((rid, 0, alloc.num_tokens(rid)),) for rid in runs},
        free_extents=tuple(length for _, length in alloc.free_holes()),
    )


def _filled_per_unit(view: AllocatorView) -> dict:
    # A shared unit holds what its fullest holder wrote; the others see a prefix.
    filled: dict = {}
    for layout in view.layouts.values():
        for unit_id, _, num_filled in layout:
            if num_filled > filled.get(unit_id, 0):
                filled[unit_id] = num_filled
    return filled


def _external(view: AllocatorView, next_request_len: int | None) -> int:
    if not next_request_len:
        return 0
    # The smallest extent the next sequence can use: a whole reservation when it
    # must be contiguous, a single block when any block will do.
    if view.contiguous:
        needed = view.reserve_len or next_request_len
    else:
        needed = min(view.block_size, next_request_len)
    return sum(extent for extent in view.free_extents if extent < needed)


def _distinct_prefixes(view: AllocatorView, token_ids: Mapping[str, Sequence[int]]) -> int:
    """Distinct (position, prefix) pairs among the stored tokens: the size of a trie
    over the stored sequences, i.e. total length minus the common prefixes of
    neighbours in sorted order. Where a sequence no longer holds its first positions (a
    sliding window released them) the pairs are counted by a chain of prefix hashes."""
    if any(first for layout in view.layouts.values() for _, first, n in layout[:1] if n):
        return _distinct_window_prefixes(view, token_ids)
    stored = []
    for request_id, layout in view.layouts.items():
        num_stored = max((first + n for _, first, n in layout if n), default=0)
        tokens = token_ids[request_id]
        if len(tokens) < num_stored:
            raise ValueError(f"token_ids[{request_id!r}] has fewer tokens than it holds")
        stored.append(list(tokens[:num_stored]))
    stored.sort()
    distinct = sum(len(s) for s in stored)
    for prev, cur in zip(stored, stored[1:], strict=False):
        common = 0
        for a, b in zip(prev, cur, strict=False):
            if a != b:
                break
            common += 1
        distinct -= common
    return distinct


def _distinct_window_prefixes(view: AllocatorView, token_ids: Mapping[str, Sequence[int]]) -> int:
    """Distinct (position, prefix) pairs among the stored positions, each prefix named by
    a chained hash (one pass per sequence instead of comparing whole prefixes)."""
    seen: set[tuple[int, int]] = set()
    for request_id, layout in view.layouts.items():
        filled = [(first, n) for _, first, n in layout if n]
        if not filled:
            continue
        start, end = filled[0][0], max(first + n for first, n in filled)
        tokens = token_ids[request_id]
        if len(tokens) < end:
            raise ValueError(f"token_ids[{request_id!r}] has fewer tokens than it holds")
        chain = 0
        for position, token in enumerate(tokens[:end]):
            chain = hash((chain, token))
            if position >= start:
                seen.add((position, chain))
    return len(seen)
