"""Sliding-window release: the blocks no later query of a windowed model can read.

With a window (every layer of the model, or of one KV cache group, slides), a table's
entries before the window become a placeholder block the manager holds for good (the
worker never reads it, and slots stay ``table[p // block_size]``); the blocks they held
go back to the pool, and full hashed ones stay findable as cached-free::

    block size 4, window 8, 30 tokens computed: positions < 23 are never read again
    table  [ 7  3  9 12 15  4 21 30]  ->  [ N  N  N  N  N  4 21 30]    N: the placeholder
"""

from __future__ import annotations

from pagedllm.core.block_pool import BlockPool


class WindowRelease:
    """One manager's window (None: full attention) and the blocks released so far."""

    def __init__(self, sliding_window: int | None, block_size: int) -> None:
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, got {sliding_window}")
        self.sliding_window = sliding_window
        self.block_size = block_size
        self.num_freed = 0

    def release(
        self, table: list[int] | None, num_computed: int, null: int, pool: BlockPool
    ) -> int:
        """Point the entries of ``table`` that no later query reads (every position up to
        ``num_computed - sliding_window``: the next query, at ``num_computed``, sees the
        ``sliding_window`` positions ending at itself) at ``null`` and release their
        blocks; returns how many were released (0 without a window)."""
        window = self.sliding_window
        if window is None:
            return 0
        dead = max(0, num_computed - window + 1) // self.block_size
        if not table or dead == 0 or table[min(dead, len(table)) - 1] == null:
            return 0
        released = [b for b in table[:dead] if b != null]
        for i in range(min(dead, len(table))):
            table[i] = null
        pool.incref([null] * len(released))
        pool.decref(released)
        self.num_freed += len(released)
        return len(released)

    def blocks_needed(self, num_tokens: int, max_step_tokens: int) -> int:
        """Blocks a sequence of ``num_tokens`` cached tokens holds at its peak when each
        step computes at most ``max_step_tokens``: all of them without a window; with
        one, those a step's queries can see (the window before the step's first query,
        the step's own tokens) plus one for a window that does not start on a block, and
        the placeholder the manager holds."""
        full = -(-num_tokens // self.block_size)
        if self.sliding_window is None:
            return full
        seen = self.sliding_window - 1 + max_step_tokens
        return min(full, -(-seen // self.block_size) + 1) + 1
