"""Sampling from a batch of logits. (Placeholder greedy version; the engine work replaces it.)"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedllm.core.outputs import ModelRunnerOutput, ScheduledSequence


class Sampler:
    """Turns logits (one row per scheduled sequence with ``num_samples > 0``, in order)
    into a ``ModelRunnerOutput`` aligned with all scheduled sequences."""

    def __call__(
        self, logits: torch.Tensor, scheduled: Sequence[ScheduledSequence]
    ) -> ModelRunnerOutput:
        greedy = logits.argmax(dim=-1).tolist()
        sampled: list[tuple[int, ...]] = []
        row = 0
        for seq in scheduled:
            if seq.num_samples == 0:
                sampled.append(())
                continue
            sampled.append((greedy[row],) * seq.num_samples)
            row += 1
        return ModelRunnerOutput(
            sampled_token_ids=tuple(sampled), logprobs=tuple(None for _ in scheduled)
        )

    def release(self, request_ids: frozenset[str]) -> None:
        """Drop per-request state (seeded generators) of finished requests."""
