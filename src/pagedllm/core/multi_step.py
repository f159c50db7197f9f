"""Multi-step decoding: one schedule covers several greedy decode steps in a row, and the
worker runs them back to back (``Scheduler.schedule``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from pagedllm.core.request import Request
from pagedllm.core.step_batch import StepBatch

if TYPE_CHECKING:
    from pagedllm.core.kv_protocol import KVCacheProtocol
    from pagedllm.core.scheduler_config import SchedulerConfig


def multi_step_size(
    config: SchedulerConfig, running: Sequence[Request], max_tokens: Callable[[Request], int]
) -> int:
    """How many decode steps this schedule may cover: 1, or up to
    ``num_scheduler_steps`` when every ``running`` request (nothing waits or is swapped
    out: the caller checks) has one token to do, samples it as a plain argmax (no
    logprobs, penalties, bias or pending ``min_tokens``; no stop strings, which the
    engine checks on text; no structured outputs, whose grammar masks every draw) and
    has room below ``max_model_len``; no more steps than the longest remaining
    ``max_tokens`` needs."""
    limit = config.num_scheduler_steps
    if limit == 1 or not running:
        return 1
    if len(running) > config.max_num_batched_tokens:
        return 1
    wanted = 1
    for request in running:
        if request.draft_token_ids:
            return 1  # a speculative step verifies several tokens in one forward
        params = request.sampling_params
        num_tokens = len(request.all_token_ids)
        num_output = len(request.output_token_ids)
        if (
            params is None
            or num_tokens - request.num_computed_tokens != 1
            or not params.plain_greedy(num_output)
            or params.stop
            or params.structured_outputs is not None  # a mask before every draw
        ):
            return 1
        # Step j's input sits at position num_tokens - 1 + j < max_model_len.
        limit = min(limit, config.max_model_len - num_tokens)
        wanted = max(wanted, max_tokens(request) - num_output)
    return max(1, min(limit, wanted))


def schedule_steps(
    kv: KVCacheProtocol, running: Sequence[Request], step: StepBatch, num_steps: int
) -> bool:
    """Slots for ``num_steps`` tokens for every running request (a decode of one token
    each). False when the cache cannot give them all: the requests given theirs stay
    in ``step`` (with any copy-on-write), the others are scheduled as an ordinary step
    (the slots already taken serve the next steps)."""
    allocate_slots = kv.allocate_slots
    for request in running:
        allocation = allocate_slots(request, num_steps)
        if allocation is None:
            return False
        step.add(request, 1, allocation.block_copies)
    return True
