"""The engine's books of one user request: a group of ``n`` sequences (the parent and the
children the scheduler forks), and what ``LLMEngine.step_deltas`` has reported of each.

A group's delta (``take_delta``) carries each sequence's tokens and logprobs since the last
delta, its finish reason once, and the prompt's logprobs once all positions are in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.core.outputs import TokenLogprob
from pagedllm.core.request import Request
from pagedllm.engine.outputs import RequestDelta, SequenceDelta
from pagedllm.sampling_params import SamplingParams


@dataclass(slots=True)
class GroupSequence:
    """One completion of a group: what ``step_deltas`` has reported of it."""

    index: int
    request: Request
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_sent: int = 0
    num_logprobs_sent: int = 0
    delta_finished: bool = False

    def take_delta(self) -> SequenceDelta:
        """The tokens and logprobs since the last delta (then marked sent)."""
        tokens = self.request.output_token_ids
        new_ids = tuple(tokens[self.num_sent :])
        self.num_sent = len(tokens)
        logprobs = None
        if self.logprobs is not None:
            logprobs = tuple(self.logprobs[self.num_logprobs_sent :])
            self.num_logprobs_sent = len(self.logprobs)
        finish = self.finish_reason
        if finish is not None and self.delta_finished:
            finish = None  # reported once
        self.delta_finished = finish is not None or self.delta_finished
        return SequenceDelta(self.index, new_ids, logprobs, finish, self.stop_reason)


@dataclass(slots=True)
class RequestGroup:
    """One user request: its ``n`` sequences, by index, as the scheduler reports them."""

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]  # a tuple once: every step's output shares it
    params: SamplingParams
    seq_ids: list[str]
    seqs: dict[int, GroupSequence] = field(default_factory=dict)
    error: str | None = None
    num_finished: int = 0  # sequences with a finish_reason (kept by `finish`)
    # prompt_logprobs by prompt position (1 ..), when asked for; a recomputed prompt
    # (after preemption) writes the same positions again.
    prompt_logprobs: dict[int, TokenLogprob] | None = None
    prompt_logprobs_sent: bool = False  # in a RequestDelta (step_deltas)

    @property
    def finished(self) -> bool:
        return self.error is not None or self.num_finished == self.params.n

    def sequence(self, index: int, request: Request) -> GroupSequence:
        """Sequence ``index`` (``request``), made the first time a step reports it."""
        seq = self.seqs.get(index)
        if seq is None:
            wants = self.params.logprobs is not None
            seq = self.seqs[index] = GroupSequence(index, request, [] if wants else None)
        return seq

    def finish(self, seq: GroupSequence, reason: str, stop_reason: int | str | None = None) -> None:
        """Give ``seq`` its finish reason (once; a later call is ignored)."""
        if seq.finish_reason is None:
            seq.finish_reason, seq.stop_reason = reason, stop_reason
            self.num_finished += 1

    def take_delta(self) -> RequestDelta:
        """What changed since the last delta: the sequences that advanced or finished."""
        deltas = [self.seqs[i].take_delta() for i in sorted(self.seqs)]
        if self.error is not None and not deltas:
            deltas = [SequenceDelta(0, (), finish_reason="error")]
        first = self.seqs.get(0)
        return RequestDelta(
            request_id=self.request_id,
            seqs=tuple(d for d in deltas if d.token_ids or d.finish_reason or d.logprobs),
            finished=self.finished,
            num_cached_tokens=first.request.num_cached_tokens if first else 0,
            error=self.error,
            cache_event_seq=first.request.cache_event_seq if first else None,
            prompt_logprobs=self._take_prompt_logprobs(),
            arrival_event_seq=first.request.arrival_event_seq if first else None,
        )

    def _take_prompt_logprobs(self) -> tuple[TokenLogprob | None, ...] | None:
        """vLLM's shape (one entry per prompt token, None for the first: nothing predicts
        it) once all positions are in, or the request ended; the first time only."""
        if self.prompt_logprobs is None or self.prompt_logprobs_sent:
            return None
        if len(self.prompt_logprobs) < len(self.prompt_token_ids) - 1 and not self.finished:
            return None
        self.prompt_logprobs_sent = True
        found = self.prompt_logprobs.get
        return (None, *(found(p) for p in range(1, len(self.prompt_token_ids))))
