"""What the engine returns per request: cumulative outputs (``LLMEngine.step``, the offline
``LLM``) or token deltas (``LLMEngine.step_deltas``, the engine core behind the server,
which detokenizes in its own process).

Outputs carry logprobs in vLLM's shape (``Logprob`` dicts, decoded); deltas carry the
runner's compact ``TokenLogprob`` records, turned into that shape where the text is made."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagedllm.core.outputs import TokenLogprob

if TYPE_CHECKING:
    from pagedllm.tool_calls.parsers import ToolCall


@dataclass(frozen=True, slots=True)
class Logprob:
    """One token's log-probability at one position, as vLLM's ``Logprob``: ``rank`` is
    its place in the distribution (1: the most likely), ``decoded_token`` its text (None
    without a tokenizer)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's shapes. A position maps token id -> Logprob for the actual token (sampled, or
# the prompt's) and the top-k; a prompt's first position, which nothing predicts, is None.
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


def position_logprobs(entry: TokenLogprob, tokenizer: Any) -> dict[int, Logprob]:
    """vLLM's dict of one position: the actual token at its rank, then the top-k at ranks
    1..k. k entries when the actual token is one of the top-k, else k + 1."""
    position = {
        entry.token_id: Logprob(entry.logprob, entry.rank, decode(tokenizer, entry.token_id))
    }
    for rank, (token_id, logprob) in enumerate(
        zip(entry.top_token_ids, entry.top_logprobs, strict=True), 1
    ):
        known = position.get(token_id)
        text = known.decoded_token if known is not None else decode(tokenizer, token_id)
        position[token_id] = Logprob(logprob, rank, text)
    return position


def top_logprobs(
    position: dict[int, Logprob], token_id: int, num_top: int
) -> list[tuple[int, Logprob]]:
    """The ``num_top`` most likely tokens of a ``position_logprobs`` dict whose actual
    token is ``token_id``, most likely first. The sampler lists exactly ``num_top``, so
    the count tells whether the actual token is an entry more; its rank cannot (a tie
    may rank it inside the top-k without it being listed)."""
    extra = len(position) > num_top
    entries = [(t, lp) for t, lp in position.items() if not (extra and t == token_id)]
    return sorted(entries, key=lambda entry: entry[1].rank or 0)


def prompt_position_logprobs(
    entries: Sequence[TokenLogprob | None], tokenizer: Any
) -> PromptLogprobs:
    """``position_logprobs`` of each entry; None stays None."""
    return [None if e is None else position_logprobs(e, tokenizer) for e in entries]


def decode(tokenizer: Any, token_id: int) -> str | None:
    """One token as text, as vLLM's ``decoded_token`` (None without a tokenizer)."""
    return None if tokenizer is None else tokenizer.decode([token_id])


@dataclass(frozen=True, slots=True)
class CompletionOutput:
    """One of a request's ``n`` completions, everything so far.

    ``finish_reason``: None while running, else "stop", "length", "abort" or "error".
    ``stop_reason``: the stop string or stop token id that ended it (None for EOS).
    ``logprobs`` (when ``SamplingParams.logprobs`` is set): vLLM's shape, one dict per
    token (``position_logprobs``).
    ``tool_calls`` and ``content`` (``LLM.chat(tools=...)`` only; ``text`` stays the
    whole reply): the calls read in the model's tool-call format, and the text around
    them (None when the reply is only calls).
    """

    index: int
    text: str
    token_ids: tuple[int, ...]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    tool_calls: tuple[ToolCall, ...] | None = None
    content: str | None = None

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
    ``prompt_logprobs`` (when ``SamplingParams.prompt_logprobs`` is set): vLLM's shape,
    one entry per prompt token, None for the first, else the dict of the prompt token and
    the top-k (``position_logprobs``).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    outputs: tuple[CompletionOutput, ...]
    finished: bool
    num_cached_tokens: int = 0
    error: str | None = None
    cache_event_seq: int | None = None
    prompt_logprobs: PromptLogprobs | None = None
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
    ``prompt_logprobs``: the prompt's ``TokenLogprob``s (None first), once, in the delta
    of the step that computed the prompt's last position (or that ended the request); the
    server turns them into vLLM's shape, as it detokenizes.
    """

    request_id: str
    seqs: tuple[SequenceDelta, ...]
    finished: bool
    num_cached_tokens: int = 0
    error: str | None = None
    cache_event_seq: int | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    arrival_event_seq: int | None = None
