"""The manager's side of the disk tier (``tiers.DiskTier``): prefix hits past RAM, the
loads admission plans for them, and the loads the worker could not do.

Every block registered in the prefix index is also stored on disk in the background; a
prefix lookup goes on past the last block found in RAM through the hashes the disk
holds. Admission allocates fresh blocks for the disk hits, indexes them at once and
plans their loads (``take_ops``); a load the worker cannot do is handed back
(``failed``), which takes those blocks out of the index.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedllm.core.block_pool import BlockPool
from pagedllm.core.tiers import NO_DISK_OPS, DiskOps, DiskTier


class DiskLoads:
    """The disk tier of one manager (``disk`` None: none) and the loads of the last
    disk ops handed to the worker."""

    def __init__(self, pool: BlockPool, disk: DiskTier | None) -> None:
        self.pool = pool
        self.disk = disk
        self._in_flight: dict[int, bytes] = {}  # device block -> hash, last disk ops

    def num_hits(self, hashes: Sequence[bytes], first: int, end: int) -> int:
        """How many of ``hashes[first:end]``, from the first on, the disk holds."""
        disk = self.disk
        num = 0
        if disk is not None:
            while first + num < end and hashes[first + num] in disk:
                num += 1
        return num

    def holds_all(self, hashes: Sequence[bytes]) -> bool:
        disk = self.disk
        return disk is not None and all(h in disk for h in hashes)

    def plan(
        self,
        block_ids: Sequence[int],
        first: int,
        hashes: Sequence[bytes],
        tokens: Sequence[int],
        extra_keys: tuple,
        block_size: int,
    ) -> None:
        """Index fresh device blocks under the disk hits from block ``first`` on and plan
        their loads."""
        assert self.disk is not None
        bs = block_size
        for i, block_id in enumerate(block_ids, start=first):
            block_tokens = tokens[i * bs : (i + 1) * bs]
            self.pool.register(
                block_id,
                hashes[i],
                block_tokens,
                parent_hash=hashes[i - 1] if i else None,
                extra_keys=extra_keys,
            )
            self.disk.load(block_id, hashes[i], block_tokens)

    def take_ops(self) -> DiskOps:
        """The disk I/O planned since the last call, for this step's worker."""
        if self.disk is None:
            return NO_DISK_OPS
        ops = self.disk.take_ops()
        self._in_flight = {block_id: block_hash for block_id, block_hash, _ in ops.loads}
        return ops

    def failed(self, block_ids: set[int]) -> None:
        """The worker could not load these blocks of the last disk ops: they leave the
        prefix index and the disk tier."""
        for block_id in block_ids:
            block_hash = self._in_flight.get(block_id)
            if block_hash is None:
                raise ValueError(f"block {block_id} was not loaded from disk in the last step")
            if self.pool.block_hash(block_id) == block_hash:
                self.pool.discard(block_id)
            if self.disk is not None:
                self.disk.discard(block_hash)
