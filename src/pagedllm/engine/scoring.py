"""Scoring requests: sequences a client extends itself (beam search, ``engine/beam_search.py``).

A scoring request is a ``Request`` with ``score_only``: each ``LLMEngine.step`` that
computes its last token reports that position's top logprobs (``take``) and appends
nothing, so the request parks, computed to its end. The client then ``fork``s it with the
token it chose (the child shares every block; copy-on-write splits the partial last one)
and ``finish``es the parent. The step loop treats these requests like any other (failure
isolation, stats, grammar masks, preemption), except that the speculator never drafts for
them and their outputs are these scores instead of ``RequestOutput``s.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from pagedllm.core.outputs import TokenLogprob
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler, SequenceUpdate
from pagedllm.engine.constrained import ConstrainedRequests
from pagedllm.sampling_params import StructuredOutputsParams


@dataclass(slots=True)
class Scores:
    """What the steps since the last ``take`` reported: the top logprobs of each scored
    request's last position, and the error of each one that failed (it is finished)."""

    top: dict[str, TokenLogprob] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)


class ScoringRequests:
    """The live scoring requests and their pending scores."""

    def __init__(self, scheduler: Scheduler, structured: ConstrainedRequests) -> None:
        self.scheduler = scheduler
        self.structured = structured
        self.live: set[str] = set()
        self._scores = Scores()

    def add(self, request: Request, structured: StructuredOutputsParams | None) -> None:
        """Queue ``request`` (its ``score_only`` set here), its tokens masked by the
        ``structured`` grammar if given, compiled now (``ValueError`` when refused,
        nothing queued)."""
        request.score_only = True
        grammar = None if structured is None else self.structured.compiler().compile(structured)
        self.scheduler.add_request(request)
        if grammar is not None:
            self.structured.matchers.add(request.request_id, grammar)
        self.live.add(request.request_id)

    def fork(self, parent_id: str, child_id: str, token_id: int) -> None:
        """A child of ``parent_id`` continued by ``token_id``: it shares the parent's
        blocks while the parent is running; one preempted while parked is recomputed
        (the prefix cache finds what is left of it)."""
        parent = self.scheduler.requests.get(parent_id)
        if parent is None or parent_id not in self.live:
            raise ValueError(f"{parent_id!r} is not a live scoring request")
        if parent.status is RequestStatus.RUNNING:
            child = self.scheduler.fork(parent, child_id)
            child.append_output_token_ids(token_id)
        else:
            child = Request(
                child_id,
                list(parent.prompt_token_ids),
                parent.sampling_params,
                eos_token_id=parent.eos_token_id,
                output_token_ids=[*parent.output_token_ids, token_id],
                score_only=True,
            )
            self.scheduler.add_request(child)
        matchers = self.structured.matchers
        if parent_id in matchers:
            matchers.fork(parent_id, child_id)
            matchers.advance(child_id, child.output_token_ids)
        self.live.add(child_id)

    def completes_grammar(self, request_id: str, token_id: int) -> bool:
        """Whether ``token_id`` completes the request's grammar (False without one)."""
        matchers = self.structured.matchers
        return request_id in matchers and matchers.completes_with(request_id, token_id)

    def finish(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """Finish these requests (unknown ids are ignored); frees their blocks."""
        ids = [i for i in request_ids if i in self.live]
        self.scheduler.finish_requests(ids, status)
        self.structured.release(ids)
        self.live.difference_update(ids)
        for request_id in ids:
            self._scores.top.pop(request_id, None)

    def record(self, update: SequenceUpdate) -> None:
        """A step scored ``update.request``."""
        if update.new_logprobs:
            self._scores.top[update.request.request_id] = update.new_logprobs[0]

    def fail(self, request: Request, error: str) -> bool:
        """Finish a scoring request with ``error``; False for any other request."""
        request_id = request.request_id
        if request_id not in self.live:
            return False
        self.finish([request_id], RequestStatus.FINISHED_ERROR)
        self._scores.failed[request_id] = error
        return True

    def take(self) -> Scores:
        scores, self._scores = self._scores, Scores()
        return scores
