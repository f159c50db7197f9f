"""``OutputProcessor``: every request's outputs, built once, from the core's token deltas.

::

    LLMEngine.step_deltas() --RequestDelta--> OutputProcessor.process() -> RequestState
        offline: LLMEngine.step(), in-process         state.output(): RequestOutput
        server:  AsyncEngine, in the API process      state.read(): StreamDelta per read,
                                                      state.output() for a whole answer

A ``RequestState`` keeps a request's ``n`` sequences: their tokens, logprobs (decoded into
vLLM's shape when read) and text. Stop strings are looked for here, once, as the text is
made. A sequence a stop string ends is finished here and listed by ``take_stopped`` for
its owner to finish in the scheduler: offline at once, before the next step; the server
sends it to the core, which may have run a step more meanwhile (tokens that arrive for a
finished sequence are ignored, so the output is the same either way).

Text is decoded when it is read, one window per read (``IncrementalDetokenizer``), except
for a sequence with stop strings: that one is decoded token by token as tokens arrive.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedllm.core.outputs import TokenLogprob
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.engine.outputs import (
    CompletionOutput,
    PromptLogprobs,
    RequestDelta,
    RequestOutput,
    SampleLogprobs,
    SequenceDelta,
    position_logprobs,
    prompt_position_logprobs,
)
from pagedllm.sampling_params import SamplingParams

__all__ = ["ChoiceDelta", "OutputProcessor", "RequestState", "SequenceState", "StreamDelta"]


@dataclass(frozen=True, slots=True)
class ChoiceDelta:
    """What is new in one completion since the stream's last read (``logprobs`` in
    vLLM's shape, one dict per new token)."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: SampleLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass(frozen=True, slots=True)
class StreamDelta:
    """One read of a request: the completions with something new."""

    request_id: str
    choices: tuple[ChoiceDelta, ...]
    finished: bool
    error: str | None = None


@dataclass(slots=True)
class SequenceState:
    """One completion: all its tokens, its text, and what has been read of it."""

    index: int
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    # The runner's records (None: not asked for) and, decoded as far as read, vLLM's shape.
    entries: list[TokenLogprob] | None = None
    positions: SampleLogprobs = field(default_factory=list)
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Tokens the detokenizer has been given: the rest wait until the text is read.
    num_detokenized: int = 0
    num_read_tokens: int = 0
    num_read_chars: int = 0
    num_read_logprobs: int = 0
    finish_read: bool = False

    @classmethod
    def new(
        cls, index: int, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> SequenceState:
        detokenizer = IncrementalDetokenizer.for_params(tokenizer, prompt_token_ids, params)
        if params.logprobs is None:
            return cls(index, detokenizer)
        return cls(index, detokenizer, entries=[], cumulative_logprob=0.0)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, delta: SequenceDelta) -> str | None:
        """Apply one step's delta; returns the stop string that now ends the sequence."""
        if self.finished:
            return None  # the core ran on until it heard of the stop
        token_ids, logprobs = delta.token_ids, delta.logprobs
        stop = None
        if self.detokenizer.stop:
            # One token at a time: a step may bring several (verified drafts), and those
            # after the token that completes a stop string are dropped.
            shown = token_ids
            if self._hides_stop_token(delta.finish_reason, delta.stop_reason, token_ids):
                shown = shown[:-1]
            detokenizer = self._detokenized(len(self.token_ids))
            for kept, token_id in enumerate(shown, 1):
                stop = detokenizer.add_tokens((token_id,))
                if stop is not None:
                    token_ids = token_ids[:kept]
                    logprobs = None if logprobs is None else logprobs[:kept]
                    break
            self.num_detokenized = len(self.token_ids) + len(token_ids)
        self.token_ids.extend(token_ids)
        if logprobs is not None and self.entries is not None:
            self.entries.extend(logprobs)
            # Summed a step at a time, the same in every process.
            self.cumulative_logprob = (self.cumulative_logprob or 0.0) + sum(
                e.logprob for e in logprobs
            )
        if stop is not None:
            self.finish("stop", stop)
        elif delta.finish_reason is not None:
            self.finish(delta.finish_reason, delta.stop_reason)
        return stop

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        if self.finish_reason is None:
            self.finish_reason, self.stop_reason = reason, stop_reason

    @property
    def text(self) -> str:
        """The text so far; while running, without what a stop string could take back."""
        end = len(self.token_ids)
        if self._hides_stop_token(self.finish_reason, self.stop_reason):
            end -= 1
        detokenizer = self._detokenized(end)
        if self.finish_reason is None:
            return detokenizer.visible_text
        return detokenizer.finish()

    def logprobs(self) -> SampleLogprobs | None:
        """The logprobs in vLLM's shape; each token is decoded once, however often read."""
        if self.entries is None:
            return None
        done = self.positions
        tokenizer = self.detokenizer.tokenizer
        done.extend(position_logprobs(e, tokenizer) for e in self.entries[len(done) :])
        return done

    def output(self) -> CompletionOutput:
        """Everything so far (a copy: a later step does not change it)."""
        logprobs = self.logprobs()
        return CompletionOutput(
            self.index, self.text, tuple(self.token_ids), self.cumulative_logprob,
            None if logprobs is None else list(logprobs), self.finish_reason, self.stop_reason,
        )  # fmt: skip

    def read(self) -> ChoiceDelta | None:
        """Everything new since the last read (None: nothing)."""
        text = self.text[self.num_read_chars :]
        token_ids = self.token_ids[self.num_read_tokens :]
        positions = self.logprobs()
        logprobs = None if positions is None else positions[self.num_read_logprobs :]
        finish = None if self.finish_read else self.finish_reason
        if not (text or token_ids or logprobs or finish):
            return None
        self.num_read_chars += len(text)
        self.num_read_tokens = len(self.token_ids)
        self.num_read_logprobs = len(positions or ())
        self.finish_read = finish is not None
        stop = self.stop_reason if finish else None
        return ChoiceDelta(self.index, text, tuple(token_ids), logprobs, finish, stop)

    def _hides_stop_token(
        self, reason: str | None, stop_reason: int | str | None, tokens: Sequence[int] = ()
    ) -> bool:
        """True when the sequence ended on a stop token, whose text stays out of the output
        as in vLLM (unless include_stop_str_in_output): a ``stop_token_ids`` token (its id
        is the stop reason) or EOS (a special token; a "stop" without a reason may also be
        a complete grammar's, whose last token is text). The last token is that of
        ``tokens`` (a delta not added yet), else of the sequence."""
        tokens = tokens or self.token_ids
        if reason != "stop" or isinstance(stop_reason, str) or not tokens:
            return False
        if self.detokenizer.include_stop_str_in_output:
            return False
        last = tokens[-1]
        if stop_reason is not None:
            return last == stop_reason
        tokenizer = self.detokenizer.tokenizer
        return tokenizer is not None and last in tokenizer.all_special_ids

    def _detokenized(self, end: int) -> IncrementalDetokenizer:
        """The detokenizer, once given the tokens before ``end`` (in one window)."""
        if self.num_detokenized < end:
            tokens = self.token_ids[self.num_detokenized : end]
            self.num_detokenized = end
            self.detokenizer.add_tokens(tokens, one_window=True)
        return self.detokenizer


@dataclass(slots=True)
class RequestState:
    """One request: its ``n`` sequences and what the core said of the whole."""

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]  # a tuple once: every output shares it
    params: SamplingParams
    tokenizer: Any
    seqs: dict[int, SequenceState] = field(default_factory=dict)
    finished: bool = False
    error: str | None = None
    num_cached_tokens: int = 0
    cache_event_seq: int | None = None
    arrival_event_seq: int | None = None
    prompt_logprob_entries: tuple[TokenLogprob | None, ...] | None = None
    prompt_positions: PromptLogprobs | None = None  # decoded once, when first read
    # (index, stop string) of the sequences a stop string ended, until taken.
    stopped: list[tuple[int, str]] = field(default_factory=list)

    def apply(self, delta: RequestDelta) -> None:
        """Apply one step's delta of this request."""
        for seq_delta in delta.seqs:
            seq = self.seqs.get(seq_delta.index)
            if seq is None:
                seq = self.seqs[seq_delta.index] = SequenceState.new(
                    seq_delta.index, self.tokenizer, self.prompt_token_ids, self.params
                )
            stop = seq.add(seq_delta)
            if stop is not None and seq_delta.finish_reason is None:
                self.stopped.append((seq_delta.index, stop))
        self.num_cached_tokens = delta.num_cached_tokens
        self.cache_event_seq = delta.cache_event_seq
        self.arrival_event_seq = delta.arrival_event_seq
        if delta.prompt_logprobs is not None:
            self.prompt_logprob_entries = delta.prompt_logprobs
        if delta.error is not None:
            self.error = delta.error
        num_finished = sum(seq.finished for seq in self.seqs.values())
        self.finished = (
            self.finished or delta.finished or self.error is not None
            or num_finished == self.params.n
        )  # fmt: skip

    def take_stopped(self) -> list[tuple[int, str]]:
        """The sequences stop strings ended since the last call: the core must stop them."""
        stopped, self.stopped = self.stopped, []
        return stopped

    def output(self) -> RequestOutput:
        """Everything so far, cumulative."""
        completions = tuple(self.seqs[i].output() for i in sorted(self.seqs))
        if self.error is not None and not completions:
            completions = (CompletionOutput(0, "", (), finish_reason="error"),)
        return RequestOutput(
            self.request_id, self.prompt, self.prompt_token_ids, completions, self.finished,
            self.num_cached_tokens, self.error, cache_event_seq=self.cache_event_seq,
            prompt_logprobs=self.prompt_logprobs(), arrival_event_seq=self.arrival_event_seq,
        )  # fmt: skip

    def read(self) -> StreamDelta | None:
        """The completions with something new since the last read (None: nothing)."""
        choices = [d for i in sorted(self.seqs) if (d := self.seqs[i].read())]
        if not choices:
            return None
        return StreamDelta(self.request_id, tuple(choices), self.finished, self.error)

    def prompt_logprobs(self) -> PromptLogprobs | None:
        """The prompt's logprobs in vLLM's shape, once the core has sent them."""
        if self.prompt_positions is None and self.prompt_logprob_entries is not None:
            entries = self.prompt_logprob_entries
            self.prompt_positions = prompt_position_logprobs(entries, self.tokenizer)
        return self.prompt_positions


class OutputProcessor:
    """The states of the requests whose outputs are built here, by request id."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
    ) -> RequestState:
        state = RequestState(request_id, prompt, tuple(prompt_token_ids), params, self.tokenizer)
        self.requests[request_id] = state
        return state

    def abort_request(self, request_id: str) -> None:
        """Forget a request (unknown ids are ignored)."""
        self.requests.pop(request_id, None)

    def process(self, delta: RequestDelta) -> RequestState | None:
        """Apply a core delta to its request; None for a request not (or no longer) here.
        A finished request is forgotten; its state stays readable."""
        state = self.requests.get(delta.request_id)
        if state is None:
            return None
        state.apply(delta)
        if state.finished:
            del self.requests[delta.request_id]
        return state
