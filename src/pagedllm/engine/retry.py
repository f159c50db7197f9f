"""Failure isolation: when a step's forward raises, each of its sequences is re-run
alone, and only those that raise again fail (``LLMEngine._step``)."""

from __future__ import annotations

import logging

from pagedllm.core.outputs import ModelRunnerOutput, SchedulerOutput, TokenLogprob
from pagedllm.worker.base import ModelRunner

logger = logging.getLogger(__name__)


def retry_alone(
    runner: ModelRunner, forward: SchedulerOutput
) -> tuple[ModelRunnerOutput, dict[str, Exception]]:
    """Re-run each sequence of a failed forward on its own; returns the outputs
    aligned with ``forward.scheduled`` (empty for a culprit) and the culprits.

    Rewriting a sequence's new-token slots is safe: the retry writes the same
    tokens at the same positions (so the same K/V), and those slots lie only in
    blocks the sequence holds alone. A block shared by several sequences is
    either full (prefix-cache hits and fork ancestors; full blocks are never
    written again, and a cache hit stops one token short of the prompt so the
    recomputed last token lands in a fresh block) or the partial last block of
    a fork, which copy-on-write duplicated in this step's block moves, already
    done. Blocks written this step are registered in the prefix cache only
    after the step succeeds (``scheduler.update``), so no other sequence can
    have read them. A parent of ``n`` samples is retried with the same
    ``num_samples``; children are forked only once its sampling succeeded.

    Limit: a seeded request's generator advances when the sampler draws. If the
    batched attempt failed *after* its draws (an error in the sampler's last
    stages or a deferred device error), the retry draws the next values and the
    seeded request's token differs from an undisturbed run. Forward-pass errors
    and ``FakeModelRunner``'s injected failures come before any draw, so for
    them the retry reproduces the exact tokens.
    """
    n = len(forward.scheduled)
    sampled: list[tuple[int, ...]] = [()] * n
    logprobs: list[tuple[TokenLogprob, ...] | None] = [None] * n
    prompt_logprobs: list[tuple[TokenLogprob, ...] | None] = [None] * n
    culprits: dict[str, Exception] = {}
    finished_ids = forward.finished_request_ids  # releasing twice is harmless
    for i, seq in enumerate(forward.scheduled):
        mask = forward.token_bitmasks.get(seq.request_id)
        alone = SchedulerOutput(
            scheduled=(seq,),
            finished_request_ids=finished_ids,
            token_bitmasks={seq.request_id: mask} if mask is not None else {},
        )
        try:
            result = runner.execute(alone)
        except Exception as exc:
            logger.error("request %r failed: %s", seq.request_id, describe(exc))
            culprits[seq.request_id] = exc
            continue
        if result.sampled_token_ids:
            sampled[i] = tuple(result.sampled_token_ids[0])
        if result.logprobs:
            logprobs[i] = result.logprobs[0]
        if result.prompt_logprobs:
            prompt_logprobs[i] = result.prompt_logprobs[0]
    output = ModelRunnerOutput(tuple(sampled), tuple(logprobs), tuple(prompt_logprobs))
    return output, culprits


def describe(exc: BaseException) -> str:
    """The error text a failed request reports."""
    return f"{type(exc).__name__}: {exc}"
