"""What the engine returns per request: cumulative outputs (``LLMEngine.step``, the offline
``LLM``) or token deltas (``LLMEngine.step_deltas``, the engine core behind the server,
which detokenizes in its own process)."""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.core.outputs import TokenLogprob


@dataclass(frozen=True, slots=True)
class CompletionOutput:
    """One of a request's ``n`` completions, everything so far.

    ``finish_reason``: None while running, else "stop", "length", "abort" or "error".
    ``stop_reason``: the stop string or stop token id that ended it (None for EOS).
    """

    index: int
    text: str
    token_ids: tuple[int, ...]
    cumulative_logprob: float | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """A request's state after a step: prompt, its completions, whether all ended.

    ``num_cached_tokens``: prompt tokens served from the prefix cache at admission, and
    ``cache_event_seq`` where the cache's event log stood when they were looked up and
    ``arrival_event_seq`` where it stood when the request arrived (``core/request.py``; a
    router checks its prediction against both).
    ``prompt_logprobs`` (when ``SamplingParams.prompt_logprobs`` is set): one entry per
    prompt token, None for the first (vLLM's shape), else the token's ``TokenLogprob``
    with the top-k alternatives.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    outputs: tuple[CompletionOutput, ...]
    finished: bool
    num_cached_tokens: int = 0
    error: str | None = None
    cache_event_seq: int | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    arrival_event_seq: int | None = None


@dataclass(frozen=True, slots=True)
class SequenceDelta:
    """What one step added to one completion: new token ids (and their logprobs when
    asked for), and the finish reason once, in the step that finished it."""

    index: int
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(frozen=True, slots=True)
class RequestDelta:
    """One request's step: the completions that changed; ``finished`` once all ended.

    ``error``: why the request failed (then ``finished`` and ``finish_reason="error"``).
    ``prompt_logprobs``: ``RequestOutput.prompt_logprobs``, once, in the delta of the step
    that computed the prompt's last position (or that ended the request).
    """

    request_id: str
    seqs: tuple[SequenceDelta, ...]
    finished: bool
    num_cached_tokens: int = 0
    error: str | None = None
    cache_event_seq: int | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    arrival_event_seq: int | None = None
