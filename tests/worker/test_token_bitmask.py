"""``apply_token_bitmask`` and ``bitmask_rows`` (structured outputs) against plain loops."""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm.core.outputs import ScheduledSequence
from pagedllm.worker.sampler import Sampler, apply_token_bitmask, bitmask_rows


def _mask(allowed: set[int], vocab: int) -> bytes:
    """The bitmask of ``allowed``, built bit by bit (little-endian 32-bit words)."""
    words = [0] * ((vocab + 31) // 32)
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    return b"".join(w.to_bytes(4, "little") for w in words)


def _reference(logits: torch.Tensor, rows: list[int], allowed: list[set[int]]) -> torch.Tensor:
    out = logits.clone()
    for row, keep in zip(rows, allowed, strict=True):
        for t in range(logits.shape[1]):
            if t not in keep:
                out[row, t] = float("-inf")
    return out


@pytest.mark.parametrize("vocab", [31, 32, 33, 100, 259])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masking_matches_a_plain_loop(vocab: int, dtype: torch.dtype) -> None:
    rng = random.Random(vocab)
    logits = torch.randn(5, vocab).to(dtype)
    rows = [0, 2, 3]
    allowed = [set(rng.sample(range(vocab), rng.randint(1, vocab))) for _ in rows]
    allowed[1] = {vocab - 1}  # the last token, in a partial last word
    expected = _reference(logits, rows, allowed)
    apply_token_bitmask(logits, rows, [_mask(a, vocab) for a in allowed])
    assert torch.equal(logits, expected)


def test_a_mask_shorter_than_the_vocabulary_forbids_the_rest() -> None:
    """The model's vocabulary may be padded past the tokenizer's: no mask bit, no token."""
    logits = torch.zeros(1, 70)
    apply_token_bitmask(logits, [0], [_mask({1, 40}, 64)])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [1, 40]


def test_rows_are_those_of_the_sequences_that_sample() -> None:
    def seq(rid: str, num_samples: int) -> ScheduledSequence:
        return ScheduledSequence(rid, (1,), 0, (0,), num_samples)

    scheduled = [seq("a", 1), seq("chunk", 0), seq("b", 3), seq("c", 1)]
    masks = {"b": b"B", "c": b"C", "chunk": b"X"}
    assert bitmask_rows(scheduled, masks) == ([1, 2], [b"B", b"C"])
    assert bitmask_rows(scheduled, {}) == ([], [])


def test_every_draw_of_a_masked_row_is_allowed() -> None:
    """Greedy, sampled and n>1 draws all come from the masked row."""
    vocab = 64
    logits = torch.randn(2, vocab)
    logits[0, 5] = 50.0  # the unmasked argmax, forbidden below
    allowed = {7, 9, 11}
    apply_token_bitmask(logits, [0], [_mask(allowed, vocab)])
    from pagedllm.sampling_params import SamplingParams

    scheduled = [
        ScheduledSequence("g", (1,), 0, (0,), 4, SamplingParams(temperature=1.0, n=4)),
        ScheduledSequence("free", (1,), 0, (0,), 1, SamplingParams(temperature=0.0)),
    ]
    for _ in range(20):
        out = Sampler()(logits, scheduled)
        assert set(out.sampled_token_ids[0]) <= allowed
    greedy = [ScheduledSequence("g", (1,), 0, (0,), 1, SamplingParams(temperature=0.0))]
    assert Sampler()(logits[:1], greedy).sampled_token_ids[0][0] in allowed


def test_only_greedy_rows_whose_argmax_is_forbidden_are_redone() -> None:
    from pagedllm.worker.sampler import forbidden_argmax

    vocab = 40
    masks = [_mask({3, 5}, vocab), _mask({7}, vocab), _mask(set(range(vocab)), vocab)]
    best = [5, 9, 7, 39]  # row 0 (mask {3,5}) allowed; row 1 forbidden; row 3 allowed
    assert forbidden_argmax(best, [0, 1, 3], masks) == ([1], [masks[1]])
    assert forbidden_argmax([100], [0], [masks[0]]) == ([0], [masks[0]])  # past the mask
