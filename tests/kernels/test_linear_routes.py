"""Why small_gemm does not take a weight, in the routes' words."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels.linear import pack_for_cpu, small_gemm_refusal
from pagedllm.kernels.ops import layer_ops

from .isa_caps import small_gemm_capped

ops = layer_ops()


@pytest.mark.parametrize(
    ("shape", "dtype", "reason"),
    [
        ((611, 64), torch.float32, "611 rows, not a multiple of 16"),
        ((64, 48), torch.bfloat16, "48 columns, not a multiple of 32"),
        ((64, 48), torch.float32, None),  # float32 takes any column count
        ((64, 64), torch.float16, "a 2-D torch.float16 weight, not a bf16 or float32 matrix"),
        ((4, 16, 16), torch.float32, "a 3-D torch.float32 weight, not a bf16 or float32 matrix"),
    ],
)
def test_refusal_names_what_small_gemm_does_not_take(shape, dtype, reason) -> None:
    with small_gemm_capped(torch.float32, "avx2"), small_gemm_capped(torch.bfloat16, "amx"):
        assert small_gemm_refusal(torch.zeros(shape, dtype=dtype), ops) == reason


def test_refusal_without_kernels_or_a_route() -> None:
    weight = torch.zeros(64, 64)
    assert small_gemm_refusal(weight, None) == "the C++ kernels did not load"
    with small_gemm_capped(torch.float32, "none"):
        assert small_gemm_refusal(weight, ops) == "this CPU has no float32 route"
        assert pack_for_cpu(weight, ops) == (None, None)
