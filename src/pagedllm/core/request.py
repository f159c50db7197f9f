"""One request as the scheduler and the KV cache manager see it.

Token ranges of a request (``num_tokens = len(all_token_ids)``)::

    |<------------- all_token_ids (prompt + output) ------------->|
    |<--- num_computed_tokens (K/V in the cache) --->|<- to do -->|
    |<- num_cached_tokens ->|  (prefix-cache hit at admission)

``cache_event_seq``: where the prefix cache's event log stood when that hit was looked
up (``CacheEventLog.next_seq``): the hit is what the index held after the events before
it, so a router replaying the replica's events to that point finds the same hit.
``arrival_event_seq``: where the log stood when the request arrived (``add_request``), so
a router can tell a miss that happened before the request reached the replica from one
that happened while it waited in the queue.

A step schedules ``k`` tokens starting at ``num_computed_tokens``; when the model
has run, ``num_computed_tokens += k``. A decoding request has exactly one token
to do: the one sampled last step.

Speculative decoding: ``draft_token_ids`` are guesses of the next tokens, set before a
schedule and never part of ``all_token_ids`` until verified. A decode with ``d`` drafts
computes ``1 + d`` positions; of them only the input token and the accepted drafts count::

    |<-------- all_token_ids -------->|
    |<-- num_computed_tokens -->| t   | d1 d2 d3 |     written this step: t d1 d2 d3
                                after: d1 accepted, c sampled in place of d2
    |<----------- all_token_ids ------------->|
    |<---- num_computed_tokens ---->| d1 | c  |        d2 d3's slots rolled back
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedllm.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    # Members are singletons compared by identity: hash them by identity too, in C (Enum's
    # own __hash__ is a Python call, paid by every set lookup below).
    __hash__ = object.__hash__

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED  # a set lookup: asked for every sequence every step


_FINISHED = frozenset(s for s in RequestStatus if s.name.startswith("FINISHED"))


@dataclass(slots=True, eq=False)
class Request:
    """A sequence of tokens being generated; one per sample (n>1 forks children)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams | None = None
    eos_token_id: int | None = None
    arrival_time: float = 0.0
    priority: int = 0
    cache_salt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    # Which of its request's n parallel samples this is: 0 the parent, j the j-th child
    # (a seeded request's sample j draws from ``seed + j``).
    sample_index: int = 0
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    cache_event_seq: int | None = None
    arrival_event_seq: int | None = None
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    # Speculative decoding: the next step's guesses (unverified, not in all_token_ids).
    draft_token_ids: list[int] = field(default_factory=list)
    # Scored, never extended (beam search): a step that computes its last token reports
    # that position's top logprobs and appends nothing; the request then waits, computed
    # to its end ("parked"), until its client forks it with the chosen token or finishes it.
    score_only: bool = False

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        if not self.all_token_ids:
            self.all_token_ids = self.prompt_token_ids + list(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Every prompt position's logits are needed: no prefix-cache hit may skip them."""
        params = self.sampling_params
        return params is not None and params.prompt_logprobs is not None

    @property
    def extra_keys(self) -> tuple[str, ...]:
        """Extra inputs to every block hash (tenant isolation)."""
        return () if self.cache_salt is None else (self.cache_salt,)

    def append_output_token_ids(self, token_ids: list[int] | int) -> None:
        if isinstance(token_ids, int):
            self.output_token_ids.append(token_ids)
            self.all_token_ids.append(token_ids)
        else:
            self.output_token_ids.extend(token_ids)
            self.all_token_ids.extend(token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished
