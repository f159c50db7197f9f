"""The engine's books of structured outputs (``engine/structured_outputs.py`` compiles and
matches): which requests are constrained, which wait for their grammar, and the step's
token masks.

A constrained request whose grammar is still compiling waits here, beside the scheduler
(``queue``), and is handed to it between steps once compiled (``admit_compiled``), so no
step waits for a compile. Each constrained sequence has a matcher: the step masks every
draw to the tokens it allows (``with_masks``), and its new tokens advance it
(``advance``); a sequence whose grammar is complete finishes with "stop".
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import replace
from typing import Any

from pagedllm.core.outputs import SchedulerOutput
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler, SequenceUpdate
from pagedllm.engine.config import DEFAULT_GRAMMAR_COMPILE_LIMIT_S
from pagedllm.engine.structured_outputs import Grammar, GrammarCompiler, Match, SequenceMatchers
from pagedllm.sampling_params import SamplingParams

# How long a step with nothing to run waits for a grammar being compiled (seconds): an
# idle loop then sleeps instead of spinning; a step with work never waits for one.
IDLE_COMPILE_WAIT_S = 0.01


class ConstrainedRequests:
    """The compiler (made for the first constrained request), one matcher per constrained
    sequence (``matchers``), and the requests whose grammar is compiling (``compiling``)."""

    def __init__(
        self,
        scheduler: Scheduler,
        tokenizer: Any,
        vocab_size: int,
        eos_ids: Sequence[int],
        compile_limit_s: float = DEFAULT_GRAMMAR_COMPILE_LIMIT_S,
    ) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids)
        self.compile_limit_s = compile_limit_s
        self.matchers = SequenceMatchers()
        self.compiling: dict[str, tuple[Request, Future[Grammar]]] = {}
        self._compiler: GrammarCompiler | None = None

    def compiler(self) -> GrammarCompiler:
        """The compiler of the engine's tokenizer (made on first use); ``ValueError``
        without a tokenizer."""
        if self._compiler is None:
            self._compiler = GrammarCompiler(
                self.tokenizer, self.vocab_size, self.eos_ids, time_limit_s=self.compile_limit_s
            )
        return self._compiler

    def check(self, params: SamplingParams) -> None:
        """Compile ``params.structured_outputs`` now (at most the compiler's time limit):
        ``ValueError`` naming the field and the unsupported feature, before any request
        is added (``LLM`` calls it: offline, the caller's thread is the API's)."""
        structured = getattr(params, "structured_outputs", None)  # add_request checks the type
        if structured is not None:
            self.compiler().compile(structured)

    def queue(self, request: Request) -> None:
        """To the scheduler, or, constrained with its grammar still compiling, to wait
        here. A grammar the engine refuses raises ``ValueError`` when its compile is
        already done."""
        params = request.sampling_params
        structured = params.structured_outputs if params is not None else None
        if not structured:
            self.scheduler.add_request(request)
            return
        future = self.compiler().submit(structured)
        if not future.done():
            self.scheduler.check_fits(request.num_prompt_tokens, params.max_tokens, params.n)
            self.compiling[request.request_id] = (request, future)
            return
        grammar = future.result()
        self.scheduler.add_request(request)
        self.matchers.add(request.request_id, grammar)

    def admit_compiled(self) -> list[tuple[Request, ValueError]]:
        """Hand the requests whose grammar has compiled to the scheduler; returns those
        whose grammar was refused (the engine fails them). Waits briefly only when there
        is nothing else to run."""
        if not self.compiling:
            return []
        if not self.scheduler.has_unfinished_requests():
            futures = [future for _, future in self.compiling.values()]
            wait(futures, timeout=IDLE_COMPILE_WAIT_S, return_when=FIRST_COMPLETED)
        refused: list[tuple[Request, ValueError]] = []
        for request_id, (request, future) in list(self.compiling.items()):
            if not future.done():
                continue
            del self.compiling[request_id]
            try:
                grammar = future.result()
                self.scheduler.add_request(request)
            except ValueError as exc:
                refused.append((request, exc))
                continue
            self.matchers.add(request_id, grammar)
        return refused

    def with_masks(self, output: SchedulerOutput) -> SchedulerOutput:
        """``output`` with each constrained sequence's token mask (unchanged without any)."""
        if not len(self.matchers):
            return output
        return replace(output, token_bitmasks=self.matchers.bitmasks(output.scheduled))

    def allowed_drafts(self, request: Request, drafts: Sequence[int]) -> int:
        """How many leading drafts (speculative decoding) a constrained sequence's grammar
        lets it verify (``SequenceMatchers.allowed_drafts``)."""
        return self.matchers.allowed_drafts(request.request_id, drafts)

    def advance(self, update: SequenceUpdate) -> str | None:
        """Feed a constrained sequence's new tokens to its matcher; finish it ("stop") when
        its grammar is complete. A parallel sample forked this step gets a matcher rebuilt
        from its own output tokens. Returns why, when the grammar refused a token (the
        mask makes that a bug, never a guess: the engine fails the request)."""
        request = update.request
        seq_id = request.request_id
        params = request.sampling_params
        if not len(self.matchers) or params is None or params.structured_outputs is None:
            return None
        if request.is_finished:
            self.matchers.release([seq_id])
            return None
        grammar = None
        if seq_id not in self.matchers and update.parent_id is not None:
            grammar = self.matchers.grammar_of(update.parent_id)
        state = self.matchers.advance(seq_id, request.output_token_ids, grammar)
        if state is Match.COMPLETE:
            self.scheduler.finish_requests([seq_id], RequestStatus.FINISHED_STOPPED)
            self.matchers.release([seq_id])
        elif state is Match.REJECTED:
            return self.matchers.error(seq_id)
        return None

    def release(self, seq_ids: Iterable[str]) -> None:
        """Forget these sequences (finished, stopped, aborted)."""
        seq_ids = list(seq_ids)
        for seq_id in seq_ids:
            self.compiling.pop(seq_id, None)
        self.matchers.release(seq_ids)

    def close(self) -> None:
        if self._compiler is not None:
            self._compiler.close()
