"""What a KV cache manager hands out and reports: prefix hits, allocations, stats.

Plain records shared by ``KVCacheManager``, the grouped manager (``core/hybrid_kv.py``)
and their readers; ``check_held`` is the one ref-count check both managers end with.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from pagedllm.core.block_pool import BlockPool


@dataclass(frozen=True, slots=True)
class ComputedBlocks:
    """The longest cached prefix of a request: full blocks only. ``block_ids`` are found
    in RAM; the next ``num_disk_blocks`` blocks are on disk (loaded at admission);
    ``num_tokens`` covers both."""

    block_ids: tuple[int, ...] = ()
    num_tokens: int = 0
    num_disk_blocks: int = 0
    # A grouped manager's hit (``core/hybrid_kv.py``): the tables of groups 1.. start so.
    group_block_ids: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True, slots=True)
class Allocation:
    """What ``allocate_slots`` did: blocks it handed out (copy-on-write destinations
    included) and the ``(src, dst)`` copies the worker must do before the forward pass."""

    new_block_ids: tuple[int, ...] = ()
    block_copies: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True, slots=True)
class GroupCacheStats:
    """One KV cache group of a grouped manager: its window (None: full attention), the
    distinct blocks its tables hold now, and those its window released so far."""

    sliding_window: int | None
    blocks_used: int
    window_freed_blocks: int


@dataclass(frozen=True, slots=True)
class CacheStats:
    """A snapshot; ``blocks_used + blocks_cached_free + blocks_free + blocks_retired ==
    blocks_total``.

    Prefix queries and hits are counted in tokens once per successful admission
    (an ``allocate_slots`` call given ``computed_blocks`` for a request holding no
    blocks), so a request that waits several steps for room counts once.
    """

    block_size: int
    blocks_total: int
    blocks_used: int
    blocks_cached_free: int
    blocks_free: int
    host_blocks_total: int
    host_blocks_used: int
    prefix_queries_tokens: int
    prefix_hits_tokens: int  # from either tier
    # Free blocks held back during a shrink (``core/compaction.py``): never handed out,
    # released when it ends; counted in ``blocks_total``, not in ``blocks_free``.
    blocks_retired: int = 0
    # Of blocks_used: held only by waiting requests' pins (cached-free but for them; any
    # allocation that needs them gets them: see ``DevicePoolViews``).
    blocks_pinned: int = 0
    disk_blocks_total: int = 0  # the disk tier's capacity (0: no disk tier)
    disk_blocks_used: int = 0
    prefix_disk_hits_tokens: int = 0  # the share of prefix_hits_tokens loaded from disk
    # Sliding-window models: the window, and the blocks released so far because they fell
    # out of it (see ``KVCacheManager.release_out_of_window``).
    sliding_window: int | None = None
    window_freed_blocks: int = 0
    # Models whose layers are grouped by attention kind: one entry per group.
    groups: tuple[GroupCacheStats, ...] = ()

    @property
    def prefix_hit_rate(self) -> float:
        return (
            self.prefix_hits_tokens / self.prefix_queries_tokens
            if self.prefix_queries_tokens
            else 0.0
        )


def check_held(pool: BlockPool, held: Counter[int]) -> None:
    """Raise AssertionError unless each block's ref count is how often it is ``held``."""
    for block_id in range(pool.num_blocks):
        assert pool.ref_count(block_id) == held[block_id], (
            f"block {block_id}: ref_count {pool.ref_count(block_id)}, "
            f"held by {held[block_id]} tables"
        )
