"""The block pool: ref counts, a prefix index, and a free list with LRU eviction.

Every block is in exactly one of three states::

    referenced   ref_count > 0, held by one or more block tables
    cached-free  ref_count == 0, still registered under its hash: findable by
                 ``lookup`` and revived by ``incref`` until it is evicted
    free         ref_count == 0, no hash
    retired      ref_count == 0, no hash, at or above ``limit`` during a shrink: never
                 handed out again, released by ``truncate`` (see ``core/compaction.py``)

``allocate`` takes plain free blocks first, then evicts cached-free blocks least
recently released first. Callers release a finished request's blocks in reverse
table order, so its tail is evicted before its (more often shared) head.

A *first block* is a hashed block with no parent (logical block 0 of every table that
holds it). With ``max_cached_first_blocks``, at most that many first blocks stay
cached-free: one more evicts the least recently released of them (a quantized cache keeps
first blocks in full precision, one staging slot each, so their number must be bounded).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from pagedllm.core.cache_events import CacheEventLog
from pagedllm.core.hashing import hash_block_tokens

# Codes of ``BlockPool.block_states`` (small ints: the dashboard ships one per block).
BLOCK_FREE = 0
BLOCK_CACHED_FREE = 1
BLOCK_USED = 2
BLOCK_RETIRED = 3
BLOCK_STATE_NAMES = ("free", "cached_free", "used", "retired")


class BlockPool:
    """``num_blocks`` KV blocks with ref counts and a hash -> block prefix index.

    ``events``: where registrations and removals from the index are logged (a router's
    feed, ``core/cache_events.py``); None logs nothing. ``track_released``: keep the ids of
    blocks released since the last ``take_released`` (the worker drops per-block state it
    keeps outside the pool, such as a quantized cache's staging slots): a block is released
    when nobody can read its contents any more, so when its ref count reaches zero if it is
    not hashed, else when it leaves the prefix index (evicted, dropped, or moved away).
    ``max_cached_first_blocks``: the bound on cached-free first blocks (None: no bound)."""

    def __init__(
        self,
        num_blocks: int,
        *,
        events: CacheEventLog | None = None,
        track_released: bool = False,
        max_cached_first_blocks: int | None = None,
    ) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if max_cached_first_blocks is not None and max_cached_first_blocks < 0:
            raise ValueError(f"max_cached_first_blocks must be >= 0, got {max_cached_first_blocks}")
        self.num_blocks = num_blocks
        # Blocks at or above the limit are on their way out (a shrink in progress): once
        # free they are retired instead of handed out again.
        self.limit = num_blocks
        self._released: list[int] | None = [] if track_released else None
        self._ref_counts = [0] * num_blocks
        # OrderedDicts as ordered sets: O(1) pop from the front and removal from the
        # middle (a plain dict degrades to O(n) when popped from the front).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # LRU first
        self._hash_to_block: dict[bytes, int] = {}
        self._block_hash: dict[int, bytes] = {}
        self._block_tokens: dict[int, tuple[int, ...]] = {}
        self._block_hash_inputs: dict[int, tuple[bytes | None, tuple]] = {}
        self._retired: set[int] = set()
        self.max_cached_first_blocks = max_cached_first_blocks
        self._cached_first: OrderedDict[int, None] = OrderedDict()  # LRU first
        self.events = events

    # ---- public API -----------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks an ``allocate`` may hand out: free plus cached-free."""
        return len(self._free) + len(self._cached_free)

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._cached_free)

    @property
    def num_cached_first_blocks(self) -> int:
        """Cached-free first blocks (at most ``max_cached_first_blocks``)."""
        return len(self._cached_first)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks - len(self._retired)

    @property
    def num_retired_blocks(self) -> int:
        return len(self._retired)

    def allocate(self, n: int) -> list[int] | None:
        """``n`` blocks with ref count 1, or ``None`` (and no change) if fewer are free."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if n > self.num_free_blocks:
            return None
        blocks = []
        for _ in range(n):
            if self._free:
                block_id = self._free.popitem(last=False)[0]
            else:
                block_id = self._cached_free.popitem(last=False)[0]
                self._unregister(block_id)
                self._note_released(block_id)
            self._ref_counts[block_id] = 1
            blocks.append(block_id)
        return blocks

    def lookup(self, block_hash: bytes, token_ids: Sequence[int]) -> int | None:
        """The block registered under ``block_hash`` holding exactly ``token_ids``."""
        block_id = self._hash_to_block.get(block_hash)
        if block_id is None:
            return None
        # A hash hit alone is not trusted: a collision would leak another tenant's KV.
        if self._block_tokens[block_id] != tuple(token_ids):
            return None
        return block_id

    def register(
        self,
        block_id: int,
        block_hash: bytes,
        token_ids: Sequence[int],
        *,
        parent_hash: bytes | None = None,
        extra_keys: tuple = (),
    ) -> bool:
        """Index a referenced full block under its hash.

        Returns False (and changes nothing) when the block is already hashed or
        another block already holds this hash: one physical copy is enough.
        ``parent_hash`` and ``extra_keys`` are kept so ``check_invariants`` can
        recompute the hash.
        """
        if self._ref_counts[block_id] <= 0:
            raise ValueError(f"block {block_id} is not referenced; only held blocks register")
        if block_id in self._block_hash or block_hash in self._hash_to_block:
            return False
        self._hash_to_block[block_hash] = block_id
        self._block_hash[block_id] = block_hash
        self._block_tokens[block_id] = tuple(token_ids)
        self._block_hash_inputs[block_id] = (parent_hash, tuple(extra_keys))
        if self.events is not None:
            self.events.stored(block_hash)
        return True

    def incref(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on each block, reviving cached-free ones."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                if block_id in self._cached_free:
                    del self._cached_free[block_id]
                    self._cached_first.pop(block_id, None)
                else:
                    del self._free[block_id]
            self._ref_counts[block_id] += 1

    def decref(self, block_ids: Iterable[int]) -> None:
        """Drop one reference on each block, in the order given.

        A block reaching zero joins the most-recently-used end of the free list
        (cached-free if hashed), so pass a request's blocks tail first.
        """
        for block_id in block_ids:
            count = self._ref_counts[block_id]
            if count <= 0:
                raise ValueError(f"decref of unreferenced block {block_id}")
            self._ref_counts[block_id] = count - 1
            if count == 1:
                if block_id in self._block_hash:
                    self._cache(block_id)
                    continue
                self._note_released(block_id)
                if block_id < self.limit:
                    self._free[block_id] = None
                else:
                    self._retired.add(block_id)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def take_released(self) -> tuple[int, ...]:
        """Blocks released (their contents read by nobody any more: see the class doc)
        since the last call, in order; () when the pool does not track them."""
        if not self._released:
            return ()
        released = tuple(self._released)
        self._released.clear()
        return released

    def pending_released(self) -> tuple[int, ...]:
        """What the next ``take_released`` returns, without taking it."""
        return tuple(self._released or ())

    def block_hash(self, block_id: int) -> bytes | None:
        return self._block_hash.get(block_id)

    def is_cached_free(self, block_id: int) -> bool:
        return block_id in self._cached_free

    def is_first_block(self, block_id: int) -> bool:
        """Whether the block is hashed with no parent (logical block 0 of its tables)."""
        inputs = self._block_hash_inputs.get(block_id)
        return inputs is not None and inputs[0] is None

    def evict(self, n: int | None = None) -> list[int]:
        """Evict up to ``n`` (default: all) cached-free blocks, LRU first; they become free."""
        count = len(self._cached_free) if n is None else min(n, len(self._cached_free))
        evicted = [self._cached_free.popitem(last=False)[0] for _ in range(count)]
        for block_id in evicted:
            self._forget(block_id)
        return evicted

    def discard(self, block_id: int) -> None:
        """Take a block out of the prefix index whatever its state (its content is not
        what its hash says: a failed load); a cached-free one becomes free."""
        if block_id in self._cached_free:
            del self._cached_free[block_id]
            self._forget(block_id)
        else:
            self._unregister(block_id)

    def drop(self, block_ids: Iterable[int]) -> None:
        """Evict these cached-free blocks (a compaction plan's drops); they become free,
        or retired at or above the limit."""
        for block_id in block_ids:
            if block_id not in self._cached_free:
                raise ValueError(f"block {block_id} is not cached-free")
            del self._cached_free[block_id]
            self._forget(block_id)

    # ---- resizing (the elastic pool; plans in core/compaction.py) ------------------

    def free_block_ids(self) -> list[int]:
        """Plain free blocks (all below the limit), in allocation order."""
        return list(self._free)

    def set_limit(self, limit: int) -> None:
        """Hold back blocks at or above ``limit``: the free ones retire now, the others
        as they are freed (or when compaction moves them). Raising the limit again
        returns retired blocks below it to the free list."""
        if not 0 <= limit <= self.num_blocks:
            raise ValueError(f"limit must be in [0, {self.num_blocks}], got {limit}")
        if limit < self.limit:
            for block_id in range(limit, self.limit):
                if block_id in self._free:
                    del self._free[block_id]
                    self._retired.add(block_id)
        else:
            for block_id in range(self.limit, limit):
                if block_id in self._retired:
                    self._retired.discard(block_id)
                    self._free[block_id] = None
        self.limit = limit

    def grow(self, num_blocks: int) -> None:
        """Add blocks up to ``num_blocks`` in all, free; ends any shrink in progress."""
        if num_blocks < self.num_blocks:
            raise ValueError(f"cannot grow from {self.num_blocks} to {num_blocks} blocks")
        self.set_limit(self.num_blocks)
        self._ref_counts.extend([0] * (num_blocks - self.num_blocks))
        self._free.update(dict.fromkeys(range(self.num_blocks, num_blocks)))
        self.num_blocks = self.limit = num_blocks

    def occupied_above(self, limit: int) -> list[int]:
        """Blocks at or above ``limit`` that hold data someone may read: referenced or
        cached-free (ascending ids)."""
        refs, cached = self._ref_counts, self._cached_free
        return [b for b in range(limit, self.num_blocks) if refs[b] or b in cached]

    def relocate(self, moves: Sequence[tuple[int, int]]) -> None:
        """Give each ``(src, dst)`` pair's state to ``dst``: ref count, hash and place in
        the LRU order; ``dst`` must be free, ``src`` referenced or cached-free. The data
        must already have been copied; ``src`` then becomes free (retired at or above
        the limit). Callers rewrite the block tables that held ``src``."""
        targets = {dst for _, dst in moves}
        if len(targets) != len(moves) or len({src for src, _ in moves}) != len(moves):
            raise ValueError("a block appears twice among the moves")
        renamed: dict[int, int] = {}
        for src, dst in moves:
            if dst not in self._free:
                raise ValueError(f"move target {dst} is not free")
            if src in targets or not (self._ref_counts[src] or src in self._cached_free):
                raise ValueError(f"move source {src} holds nothing to move")
            del self._free[dst]
            self._ref_counts[dst], self._ref_counts[src] = self._ref_counts[src], 0
            block_hash = self._block_hash.pop(src, None)
            if block_hash is not None:
                self._block_hash[dst] = block_hash
                self._hash_to_block[block_hash] = dst
                self._block_tokens[dst] = self._block_tokens.pop(src)
                self._block_hash_inputs[dst] = self._block_hash_inputs.pop(src)
            renamed[src] = dst
            self._note_released(src)
            if src < self.limit:
                self._free[src] = None
            else:
                self._retired.add(src)
        if any(src in self._cached_free for src in renamed):
            self._cached_free = OrderedDict.fromkeys(renamed.get(b, b) for b in self._cached_free)
            self._cached_first = OrderedDict.fromkeys(renamed.get(b, b) for b in self._cached_first)

    def truncate(self) -> None:
        """Drop every block at or above the limit; they must all be retired."""
        busy = self.occupied_above(self.limit)
        if busy:
            raise ValueError(f"blocks {busy[:8]} at or above the limit still hold data")
        self._retired.clear()
        del self._ref_counts[self.limit :]
        self.num_blocks = self.limit

    def free_queue_order(self) -> list[int]:
        """The order ``allocate`` hands blocks out: plain free first, then cached-free LRU."""
        return list(self._free) + list(self._cached_free)

    def cached_free_order(self) -> list[int]:
        """Cached-free blocks in eviction order (least recently released first)."""
        return list(self._cached_free)

    def hashed_blocks(self) -> dict[int, bytes]:
        """Every hashed block (referenced or cached-free) and its hash."""
        return dict(self._block_hash)

    def block_token_ids(self, block_id: int) -> tuple[int, ...] | None:
        return self._block_tokens.get(block_id)

    def block_states(self) -> list[int]:
        """Every block's state by block id (a new list): ``BLOCK_FREE``,
        ``BLOCK_CACHED_FREE`` or ``BLOCK_USED`` (ref count > 0)."""
        states = [BLOCK_USED if count else BLOCK_FREE for count in self._ref_counts]
        for block_id in self._cached_free:
            states[block_id] = BLOCK_CACHED_FREE
        for block_id in self._retired:
            states[block_id] = BLOCK_RETIRED
        return states

    def ref_counts(self) -> list[int]:
        """Every block's ref count by block id (a new list)."""
        return list(self._ref_counts)

    def check_invariants(
        self, block_size: int | None = None, *, verify_hashes: bool = False
    ) -> None:
        """Raise AssertionError unless the pool is consistent.

        free, cached-free, retired and referenced partition the blocks; free blocks lie
        below the limit and retired ones at or above it; cached-free blocks are hashed
        and plain free ones are not; the index and the per-block hashes agree.
        With ``block_size``, hashed blocks are full; with ``verify_hashes``, each hash
        is recomputed from its parent hash, tokens and extra keys.
        """
        free, cached, retired = set(self._free), set(self._cached_free), self._retired
        assert len(free) == len(self._free) and len(cached) == len(self._cached_free)
        assert not free & cached, "a block is both free and cached-free"
        assert not retired & (free | cached), "a retired block is also free or cached-free"
        assert len(self._ref_counts) == self.num_blocks and 0 <= self.limit <= self.num_blocks
        assert all(b < self.limit for b in free), "a free block at or above the limit"
        assert all(self.limit <= b < self.num_blocks for b in retired), "retired below limit"
        for block_id, count in enumerate(self._ref_counts):
            assert count >= 0, f"block {block_id} has ref_count {count}"
            is_free = block_id in free or block_id in cached or block_id in retired
            assert is_free == (count == 0), f"block {block_id}: ref_count {count}, free={is_free}"
        assert all(b in self._block_hash for b in cached), "cached-free block without hash"
        first = [b for b in cached if self.is_first_block(b)]
        assert set(first) == set(self._cached_first), "cached-free first blocks mismatch"
        bound = self.max_cached_first_blocks
        assert bound is None or len(first) <= bound, "too many cached-free first blocks"
        assert not any(b in self._block_hash for b in free | retired), "free block still hashed"
        assert len(self._hash_to_block) == len(self._block_hash)
        for block_hash, block_id in self._hash_to_block.items():
            assert self._block_hash.get(block_id) == block_hash, f"index mismatch at {block_id}"
            tokens = self._block_tokens[block_id]
            if block_size is not None:
                assert len(tokens) == block_size, f"hashed block {block_id} is not full"
            if verify_hashes:
                parent, extra = self._block_hash_inputs[block_id]
                assert hash_block_tokens(parent, tokens, extra) == block_hash, (
                    f"block {block_id}: hash does not match its tokens"
                )

    # ---- internal -------------------------------------------------------------------

    def _cache(self, block_id: int) -> None:
        """A hashed block's last reference is gone: cached-free, most recently used; a
        first block past ``max_cached_first_blocks`` evicts the oldest cached first block."""
        self._cached_free[block_id] = None
        if not self.is_first_block(block_id):
            return
        self._cached_first[block_id] = None
        bound = self.max_cached_first_blocks
        if bound is not None and len(self._cached_first) > bound:
            oldest = next(iter(self._cached_first))
            del self._cached_free[oldest]
            self._forget(oldest)

    def _note_released(self, block_id: int) -> None:
        if self._released is not None:
            self._released.append(block_id)

    def _forget(self, block_id: int) -> None:
        """An evicted cached-free block: out of the index, free (retired past the limit)."""
        self._unregister(block_id)
        self._note_released(block_id)
        if block_id < self.limit:
            self._free[block_id] = None
        else:
            self._retired.add(block_id)

    def _unregister(self, block_id: int) -> None:
        self._cached_first.pop(block_id, None)
        block_hash = self._block_hash.pop(block_id, None)
        if block_hash is not None:
            del self._hash_to_block[block_hash]
            del self._block_tokens[block_id]
            del self._block_hash_inputs[block_id]
            if self.events is not None:
                self.events.removed(block_hash)
