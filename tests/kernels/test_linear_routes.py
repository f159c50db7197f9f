"""The routes' words for linears, read from the weights' packed copies and the kernels
(never from a model's ops): how many linears run where, where the LM head runs and why it
is off small_gemm, and how greedy tokens are picked."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels.linear import LinearTensors, pack_for_cpu, small_gemm_refusal
from pagedllm.kernels.ops import layer_ops
from pagedllm.kernels.routes import head_route, linear_route, sampler_route

from .isa_caps import small_gemm_capped

ops = layer_ops()


def packed(rows: int, cols: int, dtype: torch.dtype = torch.float32) -> LinearTensors:
    weight = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows)).to(dtype)
    return LinearTensors(weight, None, *pack_for_cpu(weight, ops))


@pytest.mark.parametrize(
    ("shape", "dtype", "reason"),
    [
        ((611, 64), torch.float32, "611 rows, not a multiple of 16"),
        ((64, 48), torch.bfloat16, "48 columns, not a multiple of 32"),
        ((64, 64), torch.float16, "a 2-D torch.float16 weight, not a bf16 or float32 matrix"),
        ((4, 16, 16), torch.float32, "a 3-D torch.float32 weight, not a bf16 or float32 matrix"),
    ],
)
def test_refusal_names_what_small_gemm_does_not_take(shape, dtype, reason) -> None:
    if ops is None:
        pytest.skip("the C++ kernels did not build")
    assert small_gemm_refusal(torch.zeros(shape, dtype=dtype), ops) == reason


def test_float32_takes_any_column_count() -> None:
    with small_gemm_capped(torch.float32, "avx2"):
        assert small_gemm_refusal(torch.zeros(64, 48), ops) is None


def test_refusal_without_kernels_or_a_route() -> None:
    weight = torch.zeros(64, 64)
    assert small_gemm_refusal(weight, None) == "the C++ kernels did not load"
    with small_gemm_capped(torch.float32, "none"):
        assert small_gemm_refusal(weight, ops) == "this CPU has no float32 route"
        assert pack_for_cpu(weight, ops) == (None, None)


def test_an_unpacked_head_beside_packed_layers() -> None:
    with small_gemm_capped(torch.float32, "avx2"):
        layers, head = [packed(64, 64), packed(128, 64)], packed(611, 64)
        assert head.small is None
        kernel = "own kernel small_gemm (avx2)"
        assert linear_route([head, *layers]) == f"2 on {kernel}; 1 on torch F.linear"
        assert head_route(layers[0]) == kernel
        assert head_route(head) == "torch F.linear; not small_gemm: 611 rows, not a multiple of 16"
        assert sampler_route(head).startswith("greedy: C++ argmax_rows over the logits; ")


def test_a_packed_bf16_head_picks_greedy_tokens_itself() -> None:
    with small_gemm_capped(torch.bfloat16, "amx"):
        head = packed(320, 64, torch.bfloat16)
        greedy = "greedy: argmax inside the LM head (small_gemm_argmax, amx)"
        assert sampler_route(head).startswith(greedy)
        assert sampler_route(head, in_head=False).startswith("greedy: C++ argmax_rows")
        unpacked = packed(611, 64, torch.bfloat16)
        assert head_route(unpacked).startswith("oneDNN (packed bf16); not small_gemm: 611 rows")
