"""The fit rule: whether a request can ever fit, and the ``max_tokens`` a request that
sets none gets (all the room its prompt leaves). The one place both live; the engine and
the server ask the scheduler, which asks this."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedllm.core.request import Request

if TYPE_CHECKING:
    from pagedllm.core.kv_protocol import KVCacheProtocol
    from pagedllm.core.scheduler_config import SchedulerConfig


class FitRule:
    """Sizes a request against ``max_model_len`` and the whole cache. ``max_num_blocks``:
    the most blocks the pool may grow to (the elastic pool's MAX), if it can grow."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheProtocol, block_size: int) -> None:
        self.config = config
        self.kv = kv
        self.block_size = block_size
        self.max_num_blocks: int | None = None

    def check_fits(self, num_prompt_tokens: int, max_tokens: int, n: int = 1) -> None:
        """Raise ``ValueError`` (with both numbers) for a request that can never fit."""
        limit = self.config.max_model_len
        if num_prompt_tokens < 1:
            raise ValueError("prompt must contain at least one token")
        num_tokens = num_prompt_tokens + max_tokens
        if num_tokens > limit:
            raise ValueError(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = "
                f"{num_tokens} tokens exceeds max_model_len ({limit})"
            )
        needed, total = self.blocks_needed(num_tokens), self.capacity_blocks()
        if needed > total:
            raise ValueError(
                f"request needs {needed} KV blocks ({num_tokens - 1} tokens) but the whole "
                f"cache holds {total} blocks ({total * self.block_size} tokens); lower "
                f"max_tokens or give the cache more memory"
            )
        if n > self.config.max_num_seqs:
            raise ValueError(f"n ({n}) exceeds max_num_seqs ({self.config.max_num_seqs})")

    def max_num_tokens(self) -> int:
        """The most tokens (prompt + ``max_tokens``) one request may have: ``max_model_len``,
        or fewer when the whole cache holds fewer (``check_fits`` admits exactly these)."""
        low, high = 0, self.config.max_model_len  # fits: low; and everything above high fails
        total = self.capacity_blocks()
        while low < high:
            middle = (low + high + 1) // 2
            if self.blocks_needed(middle) <= total:
                low = middle
            else:
                high = middle - 1
        return low

    def default_max_tokens(self, num_prompt_tokens: int) -> int:
        """``max_tokens`` of a request that sets none: all the room its prompt leaves."""
        limit = self.max_num_tokens()
        if num_prompt_tokens >= limit:
            raise ValueError(
                f"prompt ({num_prompt_tokens} tokens) leaves no room for output within "
                f"the {limit} tokens a request may have (max_model_len and the cache's size)"
            )
        return limit - num_prompt_tokens

    def max_tokens(self, request: Request) -> int:
        """The most output tokens ``request`` may have."""
        params = request.sampling_params
        if params is None or params.max_tokens is None:
            return max(self.max_num_tokens() - request.num_prompt_tokens, 0)
        return params.max_tokens

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks a request of ``num_tokens`` holds at its peak: the last sampled token is
        never written to the cache, and a sliding window bounds the rest."""
        return self.kv.blocks_needed(num_tokens - 1, self.config.max_num_batched_tokens)

    def capacity_blocks(self) -> int:
        """The pool may be resized at run time; an elastic pool may grow to max_num_blocks."""
        return max(self.kv.usable_blocks, self.max_num_blocks or 0)
