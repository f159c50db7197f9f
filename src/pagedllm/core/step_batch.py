"""The step being built, and the ``ScheduledSequence`` each of its requests becomes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedllm.core.outputs import ScheduledSequence
from pagedllm.core.request import Request

if TYPE_CHECKING:
    from pagedllm.core.kv_protocol import KVCacheProtocol


@dataclass(slots=True)
class StepBatch:
    """The step being built (internal, mutable)."""

    budget: int
    scheduled: dict[str, tuple[Request, int]] = field(default_factory=dict)
    copies: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    # Requests swapped or preempted this step; with `scheduled`, all the step touched.
    touched: set[str] = field(default_factory=set)
    preempted: bool = False

    def add(self, request: Request, num_new_tokens: int, copies: Sequence[tuple[int, int]]) -> None:
        self.scheduled[request.request_id] = (request, num_new_tokens)
        self.budget -= num_new_tokens
        if copies:
            self.copies.setdefault(request.request_id, []).extend(copies)


def num_samples(request: Request) -> int:
    """``n``: the parallel samples the request asks for."""
    params = request.sampling_params
    return 1 if params is None else params.n


def will_fork(request: Request) -> bool:
    """A parent of n>1 samples that has not sampled yet (children have)."""
    return request.num_output_tokens == 0 and num_samples(request) > 1


def to_scheduled(kv: KVCacheProtocol, request: Request, num_new: int) -> ScheduledSequence:
    """The worker's view of ``num_new`` tokens of ``request`` (its slots allocated)."""
    start = request.num_computed_tokens
    end = start + num_new
    tokens = request.all_token_ids
    params = request.sampling_params
    num_drafts = end - len(tokens)
    if num_drafts > 0:  # a decode and its drafts (``Scheduler._allocate_drafts``)
        return _to_speculative(kv, request, num_drafts)
    if end < len(tokens):
        n = 0  # a prompt chunk that is not the last one
    elif will_fork(request):
        n = num_samples(request)
    else:
        n = 1
    # Positional: a named tuple built from keywords costs a good deal more, and one is
    # built for every sequence of every step.
    return ScheduledSequence(
        request.request_id,
        tuple(tokens[start:end]),
        start,
        kv.block_table_tuple(request.request_id),
        n,
        params,
        request.prompt_token_ids,
        request.output_token_ids,
        kv.group_block_tables(request.request_id),
        request.sample_index,
    )


def _to_speculative(kv: KVCacheProtocol, request: Request, num_drafts: int) -> ScheduledSequence:
    start = request.num_computed_tokens
    drafts = request.draft_token_ids
    assert len(drafts) == num_drafts, "drafts changed after their slots were allocated"
    return ScheduledSequence(
        request.request_id,
        (request.all_token_ids[start], *drafts),
        start,
        kv.block_table_tuple(request.request_id),
        1,
        request.sampling_params,
        request.prompt_token_ids,
        request.output_token_ids,
        kv.group_block_tables(request.request_id),
        request.sample_index,
        num_drafts,
    )
