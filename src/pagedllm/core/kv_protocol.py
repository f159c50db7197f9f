"""What the scheduler needs of a KV cache manager: ``KVCacheManager`` (one group, with
swap and disk tiers) and ``HybridKVCacheManager`` (groups of layers, recompute only)
both provide it. The scheduler is typed against this, never against either class."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

from pagedllm.core.cache_events import CacheEventLog
from pagedllm.core.kv_records import Allocation, CacheStats, ComputedBlocks
from pagedllm.core.request import Request
from pagedllm.core.tiers import DiskOps


@runtime_checkable
class KVCacheProtocol(Protocol):
    """The scheduler's door to blocks (see ``core/kv_cache_manager.py`` for each rule)."""

    enable_prefix_caching: bool
    events: CacheEventLog

    # ---- prefix lookup, allocation, release
    def get_computed_blocks(self, request: Request) -> ComputedBlocks: ...

    def block_hashes(self, request: Request) -> Sequence[bytes]: ...

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: ComputedBlocks | None = None,
        *,
        admission: bool = False,
    ) -> Allocation | None: ...

    def free_blocks_needed(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: ComputedBlocks | None = None,
        *,
        admission: bool = False,
    ) -> int: ...

    def cache_full_blocks(self, request: Request) -> None: ...

    def release_out_of_window(self, request: Request) -> int: ...

    def release_unverified(self, request: Request) -> int: ...

    def blocks_needed(self, num_tokens: int, max_step_tokens: int) -> int: ...

    def fork(self, parent: Request, child: Request) -> None: ...

    def free(self, request: Request) -> None: ...

    # ---- pins of waiting requests
    def pin_prefix(self, request: Request) -> int: ...

    def release_pin(self, request: Request) -> int: ...

    def give_up_pins(self, requests: Iterable[Request], num_free_blocks: int) -> int: ...

    @property
    def num_pinned_requests(self) -> int: ...

    # ---- tiers: swap and disk
    def can_swap_out(self, request: Request) -> bool: ...

    def swap_out(self, request: Request) -> list[tuple[int, int]] | None: ...

    def can_swap_in(self, request: Request) -> bool: ...

    def blocks_to_swap_in(self, request: Request) -> int: ...

    def swap_in(self, request: Request) -> list[tuple[int, int]] | None: ...

    def take_disk_ops(self) -> DiskOps: ...

    def loads_failed(self, block_ids: set[int]) -> None: ...

    # ---- views for the step's output
    def block_table_tuple(self, request_id: str) -> tuple[int, ...]: ...

    def group_block_tables(self, request_id: str) -> tuple[tuple[int, ...], ...]: ...

    def take_released_block_ids(self) -> tuple[int, ...]: ...

    @property
    def usable_blocks(self) -> int: ...

    def stats(self) -> CacheStats: ...
