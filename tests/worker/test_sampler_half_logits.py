"""The greedy fast path on bf16/fp16 logits (no float32 copy) against the general path."""

from __future__ import annotations

import pytest
import torch

from pagedllm.core.outputs import ScheduledSequence
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.sampler import Sampler, _argmax_rows

GREEDY = SamplingParams(temperature=0.0)


def greedy_batch(rows: int) -> list[ScheduledSequence]:
    return [
        ScheduledSequence(f"r{i}", (0,), 0, (0,), 1, GREEDY, prompt_token_ids=(1,))
        for i in range(rows)
    ]


def awkward_logits(dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random logits, coarsely rounded so rows tie often, plus rows the int16 shortcut
    can't take (all negative, zeros of both signs, NaN, infinities)."""
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn(24, 500, generator=generator) * 4).round() / 4
    logits[1] = -logits[1].abs() - 1  # all negative
    logits[2] = 0.0
    logits[2, ::3] = -0.0
    logits[3, 10] = logits[3, 400] = 50.0  # a tie: the first index wins
    logits[4, 77] = float("nan")
    logits[8, 99] = -float("nan")  # sign bit set: reads as a negative int16
    logits[5, 5] = float("inf")
    logits[6] = float("-inf")
    logits[7, 3] = -0.0
    logits[7, 4:] = -1.0
    logits[7, :3] = -2.0
    logits = logits.to(dtype)
    logits[9].view(torch.int16)[98] = 0x7FC1  # a NaN with the sign bit clear
    assert logits[9, 98].isnan()
    return logits


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seed", range(5))
def test_half_fast_path_equals_general_path(dtype: torch.dtype, seed: int) -> None:
    logits = awkward_logits(dtype, seed)
    batch = greedy_batch(logits.shape[0])
    fast_sampler = Sampler()
    assert fast_sampler.uses_fast_path(batch)
    fast = fast_sampler(logits, batch)
    general = Sampler(fast_greedy=False)(logits, batch)
    assert fast == general
    # bf16 argmax equals the float32 argmax of the same values (first index on ties).
    expected = logits.float().argmax(dim=-1).tolist()
    assert [t[0] for t in fast.sampled_token_ids] == expected
    assert _argmax_rows(logits[:, ::2]) == logits[:, ::2].float().argmax(dim=-1).tolist()


def test_half_logits_are_not_copied_to_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    logits = awkward_logits(torch.bfloat16, 0)[10:]  # ordinary rows only
    expected = logits.float().argmax(dim=-1).tolist()

    def no_float(self: torch.Tensor) -> torch.Tensor:
        raise AssertionError("float32 copy on the greedy fast path")

    monkeypatch.setattr(torch.Tensor, "float", no_float)
    output = Sampler()(logits, greedy_batch(logits.shape[0]))
    assert [t[0] for t in output.sampled_token_ids] == expected


def test_general_path_still_upcasts_half_logits() -> None:
    logits = awkward_logits(torch.bfloat16, 1)[10:14]
    params = SamplingParams(temperature=0.0, logprobs=1)
    batch = [
        ScheduledSequence(f"r{i}", (0,), 0, (0,), 1, params, prompt_token_ids=(1,))
        for i in range(4)
    ]
    assert not Sampler().uses_fast_path(batch)
    output = Sampler()(logits, batch)
    expected = torch.log_softmax(logits.float(), dim=-1).max(dim=-1).values.tolist()
    assert [lp[0].logprob for lp in output.logprobs] == pytest.approx(expected)
