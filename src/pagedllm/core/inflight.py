"""In-flight sharing: a waiting request whose next uncached full block a running
request is computing waits until that block is registered, then finds it in the prefix
cache instead of computing it a second time::

    A (admitted, computing)  |b0|b1|b2|a3|          b0..b2 not yet registered
    B (waiting)              |b0|b1|b2|x3|x4|       next uncached block b0: in flight
                              -> B waits; after A's step b0..b2 are cached and B
                                 computes only x3, x4
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from pagedllm.core.request import Request

if TYPE_CHECKING:
    from pagedllm.core.kv_protocol import KVCacheProtocol
    from pagedllm.core.kv_records import ComputedBlocks


class InflightSharing:
    """Which waiting requests wait for in-flight blocks, and what that saved."""

    def __init__(self, kv: KVCacheProtocol, block_size: int, enabled: bool) -> None:
        self.kv = kv
        self.block_size = block_size
        self.enabled = enabled
        # request id -> tokens it found cached when it first waited for in-flight blocks.
        self._waiters: dict[str, int] = {}
        self.num_shared_tokens = 0
        self.num_waits = 0

    def hashes(self, running: Iterable[Request], any_waiting: bool) -> set[bytes] | None:
        """Hashes of the full blocks running requests have yet to compute (None: no
        in-flight sharing). Only known tokens count, so a decode holds at most the
        block its next token completes."""
        if not (self.enabled and self.kv.enable_prefix_caching and any_waiting):
            return None
        in_flight: set[bytes] = set()
        for request in running:
            in_flight.update(self.uncomputed_hashes(request))
        return in_flight

    def uncomputed_hashes(self, request: Request) -> Sequence[bytes]:
        hashes = self.kv.block_hashes(request)
        return hashes[request.num_computed_tokens // self.block_size :]

    def waits_for(self, request: Request, computed: ComputedBlocks, in_flight: set[bytes]) -> bool:
        """True when the first block ``request`` would compute, and could have found
        cached, is being computed by a running request: it waits a step and hits it then.
        Never starves: the block's owner runs every step until it is registered, and a
        request that is preempted or finishes no longer counts."""
        index = computed.num_tokens // self.block_size
        if request.wants_prompt_logprobs:
            return False  # it takes no prefix hit, so waiting gains nothing
        if index >= (request.num_tokens - 1) // self.block_size:
            return False  # beyond the cap of a prefix hit: it computes that block anyway
        if self.kv.block_hashes(request)[index] not in in_flight:
            return False
        if request.request_id not in self._waiters:
            self._waiters[request.request_id] = computed.num_tokens
            self.num_waits += 1
        return True

    def count_share(self, request: Request, num_cached: int) -> None:
        """The request was admitted with ``num_cached`` tokens found cached."""
        base = self._waiters.pop(request.request_id, None)
        if base is not None:
            self.num_shared_tokens += max(0, num_cached - base)

    def forget(self, request_id: str) -> None:
        self._waiters.pop(request_id, None)
