"""How far a lossy KV cache moves a model's predictions: teacher-forced logits over a text
under two runners, compared position by position (mean KL, top-1 agreement, perplexity).

The text goes through the runner as a prompt in chunks, through the same paged cache and
attention path as serving, so a quantized cache is measured as it stores and reads K/V.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedllm.core.outputs import ScheduledSequence
from pagedllm.worker.model_runner import TorchModelRunner


@dataclass(frozen=True, slots=True)
class QualityReport:
    """One runner's predictions against a reference runner's, over ``num_positions``."""

    num_positions: int
    mean_kl: float  # mean over positions of KL(reference || test), nats
    top1_agreement: float  # share of positions whose argmax agrees
    ppl_reference: float
    ppl: float

    @property
    def delta_ppl(self) -> float:
        return self.ppl - self.ppl_reference


def text_logits(
    runner: TorchModelRunner, token_ids: Sequence[int], *, chunk: int = 256
) -> torch.Tensor:
    """Float32 logits of every position but the last [len - 1, vocab]: position p scores
    token p + 1. The text is one sequence fed ``chunk`` tokens a step, on blocks 0, 1, ...;
    a model with several KV cache groups (``core/kv_groups.py``) takes each group's blocks
    after the previous group's."""
    num_blocks = -(-len(token_ids) // runner.block_size)
    groups = kv_groups(runner)
    if num_blocks * groups > runner.num_blocks:
        raise ValueError(
            f"{len(token_ids)} tokens need {num_blocks * groups} blocks; the cache has fewer"
        )
    tables = [tuple(range(g * num_blocks, (g + 1) * num_blocks)) for g in range(groups)]
    rows = []
    for start in range(0, len(token_ids) - 1, chunk):
        tokens = tuple(token_ids[start : min(start + chunk, len(token_ids) - 1)])
        seq = ScheduledSequence(
            "text", tokens, start, tables[0], 0, group_block_tables=tuple(tables[1:])
        )
        rows.append(runner.row_logits([seq]))
    return torch.cat(rows)


def kv_groups(runner: TorchModelRunner) -> int:
    """How many KV cache groups (block tables per sequence) the runner's model has."""
    return max(runner.spec.layer_groups, default=0) + 1


def compare(reference: torch.Tensor, test: torch.Tensor, targets: Sequence[int]) -> QualityReport:
    """``reference`` and ``test`` logits [N, vocab] of the same positions; ``targets`` [N]
    the tokens they predict."""
    if reference.shape != test.shape or reference.shape[0] != len(targets):
        raise ValueError("reference, test and targets must cover the same positions")
    ref_lp = torch.log_softmax(reference.float(), dim=-1)
    test_lp = torch.log_softmax(test.float(), dim=-1)
    kl = (ref_lp.exp() * (ref_lp - test_lp)).sum(dim=-1)
    agree = (reference.argmax(-1) == test.argmax(-1)).float().mean()
    index = torch.tensor(list(targets), dtype=torch.long)[:, None]
    nll_ref = -ref_lp.gather(1, index).mean()
    nll = -test_lp.gather(1, index).mean()
    return QualityReport(
        num_positions=len(targets),
        mean_kl=float(kl.mean()),
        top1_agreement=float(agree),
        ppl_reference=math.exp(float(nll_ref)),
        ppl=math.exp(float(nll)),
    )
