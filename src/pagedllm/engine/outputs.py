"""What the engine returns per request: cumulative outputs (the server computes deltas)."""

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

    ``num_cached_tokens``: prompt tokens served from the prefix cache at admission.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    outputs: tuple[CompletionOutput, ...]
    finished: bool
    num_cached_tokens: int = 0
    error: str | None = None
