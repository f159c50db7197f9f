"""Compaction: move plans that pack the blocks worth keeping low, so a pool can shrink.

A shrink to ``limit`` blocks (``BlockPool.set_limit``) leaves the pool in two parts::

    0                          limit                        num_blocks
    |  kept: allocation comes  |  tail: retired when free, |
    |  only from here          |  moved below when not     |

``plan_compaction`` answers one slice: which tail blocks (referenced, or cached-free
and still findable by their hash) go to which free block below the limit, and which
cached-free blocks are forgotten, least recently used first, to make room when the
kept part cannot hold everything. The plan changes nothing: the worker copies each
``(src, dst)`` block first, then ``KVCacheManager.apply_compaction`` moves the books
(ref counts, prefix index, LRU order, block tables, swap copies) the same way. A plan
bounded by ``max_moves`` leaves the rest for the next slice, so running requests keep
generating between slices; a block they free meanwhile retires without a move.

When nothing is left at or above the limit, ``truncate`` drops the tail and the worker
gives its memory back. If running requests hold more than fits below the limit, the
plan moves what it can and the caller settles on a larger size (``settle_limit``).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.core.block_pool import BlockPool


@dataclass(frozen=True, slots=True)
class CompactionPlan:
    """One slice of a compaction: forget ``drops`` (cached-free blocks), then copy each
    ``(src, dst)`` of ``moves`` and give ``dst`` the source's place."""

    moves: tuple[tuple[int, int], ...] = ()
    drops: tuple[int, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not (self.moves or self.drops)

    def mapping(self) -> dict[int, int]:
        return dict(self.moves)


def plan_compaction(pool: BlockPool, *, max_moves: int | None = None) -> CompactionPlan:
    """The next slice of moves that empties ``pool`` at and above ``pool.limit``.

    Referenced blocks move before cached-free ones (running requests first); sources
    and targets each in ascending id order, so the result packs low. Cached-free blocks
    are dropped (least recently used first) only as far as the kept part lacks room.
    """
    if max_moves is not None and max_moves < 0:
        raise ValueError(f"max_moves must be >= 0, got {max_moves}")
    limit = pool.limit
    tail = pool.occupied_above(limit)
    live = [b for b in tail if pool.ref_count(b)]
    cached = {b for b in tail if not pool.ref_count(b)}
    targets = pool.free_block_ids()
    drops: list[int] = []
    deficit = len(tail) - len(targets)
    for block_id in pool.cached_free_order() if deficit > 0 else ():
        if deficit <= 0:
            break
        drops.append(block_id)
        deficit -= 1
        if block_id >= limit:
            cached.discard(block_id)
        else:
            targets.append(block_id)
    targets.sort()
    sources = live + sorted(cached)
    count = min(len(sources), len(targets))
    if max_moves is not None:
        count = min(count, max_moves)
    return CompactionPlan(tuple(zip(sources[:count], targets[:count], strict=True)), tuple(drops))


def settle_limit(pool: BlockPool) -> int:
    """The smallest size the pool can truncate to now: past its highest occupied block
    (no smaller than its limit)."""
    occupied = pool.occupied_above(pool.limit)
    return occupied[-1] + 1 if occupied else pool.limit


def packed_size(pool: BlockPool) -> int:
    """Blocks the pool needs to keep everything it holds: referenced + cached-free."""
    return pool.num_used_blocks + pool.num_cached_free_blocks


def remap_table(table: list[int], mapping: dict[int, int]) -> bool:
    """Rewrite ``table`` in place through ``mapping``; True if anything changed."""
    changed = False
    for i, block_id in enumerate(table):
        target = mapping.get(block_id)
        if target is not None:
            table[i] = target
            changed = True
    return changed
