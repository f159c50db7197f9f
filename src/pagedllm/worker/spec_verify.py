"""Verifying drafts: every scored position of a speculating sequence sampled as the
sequence would have sampled it without drafts, and the drafts kept while they agree.

A sequence with drafts ``d1 .. dk`` has ``k + 1`` logits rows: row j scores the token
after ``d1 .. dj``. Each row becomes a *position* (a ``ScheduledSequence`` whose output
includes ``d1 .. dj``, so penalties, ``min_tokens`` and logprobs apply per position) and
is sampled by the ordinary ``Sampler``: ``t_j``. Then::

    accepted  the longest prefix with t_j == d_{j+1}       (a drafts)
    tokens    d1 .. da, t_a                                 (t_j == d_{j+1} for j < a)

Greedy, ``t_j`` is the argmax: the tokens are those of decoding without drafts. Sampled,
this is rejection sampling against a point-mass draft (a deterministic proposer's): ``d``
is kept with probability ``p(d)``, and a rejection's ``t_j`` is a draw from ``p`` with
``d`` removed and renormalised (the residual ``max(0, p - q)``), so every token has the
model's distribution exactly. A seeded sequence draws row j's number from its own
generator as the j-th step without drafts would, and the generator is rewound to count
only the ``a + 1`` tokens kept: the same seed gives the same text with and without drafts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedllm.core.outputs import ModelRunnerOutput, ScheduledSequence, TokenLogprob
from pagedllm.spec_decode.acceptance import num_kept
from pagedllm.worker.sampler import Sampler


@dataclass(frozen=True, slots=True)
class Positions:
    """A batch with every speculating sequence split into its scored positions."""

    seqs: list[ScheduledSequence]  # a sequence without drafts, or each of its positions
    spans: list[tuple[int, int]]  # per scheduled sequence: its range in ``seqs``


def has_drafts(scheduled: Sequence[ScheduledSequence]) -> bool:
    return any(seq.num_draft_tokens for seq in scheduled)


def positions(scheduled: Sequence[ScheduledSequence]) -> Positions:
    """Each sequence as its scored positions: one for a sequence without drafts (itself),
    ``1 + num_draft_tokens`` for one with drafts (position j's output includes the first
    j drafts)."""
    seqs: list[ScheduledSequence] = []
    spans = []
    for seq in scheduled:
        start = len(seqs)
        drafts = seq.num_draft_tokens
        if not drafts:
            seqs.append(seq)
        else:
            draft_ids = seq.token_ids[1:]
            output = list(seq.output_token_ids)
            for j in range(drafts + 1):
                seqs.append(
                    seq._replace(
                        output_token_ids=output + list(draft_ids[:j]) if j else output,
                        num_draft_tokens=0,
                    )
                )
        spans.append((start, len(seqs)))
    return Positions(seqs, spans)


def accept(
    scheduled: Sequence[ScheduledSequence],
    split: Positions,
    tokens: Sequence[Sequence[int]],
    logprobs: Sequence[tuple[TokenLogprob, ...] | None],
) -> ModelRunnerOutput:
    """The output of ``scheduled`` from the positions' sampled ``tokens`` (one tuple per
    position) and ``logprobs``: per speculating sequence the accepted drafts and the token
    after them, with their logprobs."""
    sampled: list[tuple[int, ...]] = []
    per_seq: list[tuple[TokenLogprob, ...] | None] = []
    for seq, (start, end) in zip(scheduled, split.spans, strict=True):
        if not seq.num_draft_tokens:
            sampled.append(tuple(tokens[start]))
            per_seq.append(logprobs[start])
            continue
        drafts = seq.token_ids[1:]
        kept = num_kept([tokens[i][0] for i in range(start, end)], drafts)
        sampled.append(tuple(tokens[i][0] for i in range(start, start + kept)))
        found = [logprobs[i] for i in range(start, start + kept)]
        per_seq.append(
            tuple(lp[0] for lp in found) if all(lp for lp in found) else None  # type: ignore[index]
        )
    return ModelRunnerOutput(tuple(sampled), tuple(per_seq))


def accept_argmax(best: Sequence[int], scheduled: Sequence[ScheduledSequence]) -> ModelRunnerOutput:
    """``Sampler.greedy_from_argmax`` for a batch with drafts: ``best`` holds each sampling
    row's argmax (``1 + num_draft_tokens`` rows for a speculating sequence)."""
    sampled: list[tuple[int, ...]] = []
    row = 0
    for seq in scheduled:
        if not seq.num_samples:
            sampled.append(())
            continue
        rows = best[row : row + 1 + seq.num_draft_tokens]
        row += len(rows)
        if seq.num_draft_tokens:
            sampled.append(tuple(rows[: num_kept(rows, seq.token_ids[1:])]))
        else:
            sampled.append((rows[0],) * seq.num_samples)
    return ModelRunnerOutput(tuple(sampled), (None,) * len(sampled))


def verify(
    sampler: Sampler, logits: torch.Tensor, scheduled: Sequence[ScheduledSequence]
) -> ModelRunnerOutput:
    """Sample every scored position (``logits``: one row per sampling row, as
    ``input_batch`` orders them) and keep the agreeing drafts; seeded generators end as
    if only the kept tokens had been drawn."""
    split = positions(scheduled)
    speculating = [seq for seq in scheduled if seq.num_draft_tokens]
    states = sampler.generator_states(speculating, logits.device)
    output = sampler(logits, split.seqs, fast_path=False)
    result = accept(scheduled, split, output.sampled_token_ids, output.logprobs)
    kept = {
        seq.request_id: len(tokens)
        for seq, tokens in zip(scheduled, result.sampled_token_ids, strict=True)
        if seq.num_draft_tokens
    }
    sampler.rewind_generators(states, kept, logits.device)
    return result
