"""Linear layers on pagedllm's kernels: the packed weight layouts and the choice between them.

A linear's weight gets one packed copy (``pack_for_cpu``): the small-batch kernel's layout
(``small_gemm``, ``csrc/small_gemm.cpp``) where this CPU runs it, else oneDNN's blocked bf16
layout. ``linear`` then takes the fastest form for the row count at hand.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from pagedllm.kernels.quant import Quantized, quant_linear

# Up to this many rows (the default max_num_seqs: every decode batch), float32 linears run on
# pagedllm's small-batch kernel, which streams decode-step weights faster than MKL; more rows
# go to torch. bf16 goes on with the kernel up to its own limit (prompt chunks), beyond which
# oneDNN is as fast or faster; so does float32 on AVX2, where MKL's AVX2 sgemm is slower than
# the kernel up to 1024 rows and level with it at 2048. The measurements: docs/performance.md
# (small_gemm).
SMALL_GEMM_MAX_ROWS = 256
SMALL_GEMM_MAX_ROWS_BF16 = 1024
SMALL_GEMM_MAX_ROWS_F32_AVX2 = 1024


def small_gemm_max_rows(small: torch.Tensor) -> int:
    """The most rows ``small_gemm`` takes for a weight packed as ``small``."""
    if small.dtype == torch.bfloat16:
        return SMALL_GEMM_MAX_ROWS_BF16
    if torch.ops.pagedllm.small_gemm_f32_isa() == "avx2":
        return SMALL_GEMM_MAX_ROWS_F32_AVX2
    return SMALL_GEMM_MAX_ROWS


def pack_small_weight(weight: torch.Tensor, ops: Any) -> torch.Tensor | None:
    """The weight laid out for ``ops.small_gemm`` (``kernels/csrc/small_gemm.cpp``), or
    None where that kernel does not apply (``small_gemm_refusal``)."""
    if small_gemm_refusal(weight, ops) is not None:
        return None
    return ops.pack_small_gemm(weight.detach())


def small_gemm_refusal(weight: torch.Tensor, ops: Any) -> str | None:
    """Why ``ops.small_gemm`` does not take ``weight``, in words for the routes, or None
    where it does: bf16 needs the tile unit or AVX-512-bf16 and rows in 16s, columns in
    32s; float32 needs AVX-512 or AVX2 with FMA and rows in 16s."""
    bf16 = weight.dtype == torch.bfloat16
    if ops is None:
        return "the C++ kernels did not load"
    if weight.device.type != "cpu":
        return f"the weight is on {weight.device.type}"
    if weight.dtype not in (torch.bfloat16, torch.float32) or weight.dim() != 2:
        return f"a {weight.dim()}-D {weight.dtype} weight, not a bf16 or float32 matrix"
    if weight.shape[0] % 16:
        return f"{weight.shape[0]} rows, not a multiple of 16"
    if bf16 and weight.shape[1] % 32:
        return f"{weight.shape[1]} columns, not a multiple of 32"
    if not ops.small_gemm_available(bf16):
        return f"this CPU has no {'bf16' if bf16 else 'float32'} route"
    return None


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """A oneDNN-blocked copy of a bf16 CPU weight for ``Linear``, or None where unsupported."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        return None
    try:
        if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return None
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach())
    except (AttributeError, RuntimeError):
        return None


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class LinearTensors(NamedTuple):
    """A linear's weight and bias with its pre-packed copies: ``linear``'s arguments. A
    weight kept quantized (``quant``) has no other copy: ``weight`` is then empty."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    packed: torch.Tensor | None
    small: torch.Tensor | None
    quant: Quantized | None = None


# A weight's packed copies: (oneDNN's, small_gemm's), one of them at most.
Packs = tuple[torch.Tensor | None, torch.Tensor | None]


def pack_for_cpu(weight: torch.Tensor, ops: Any) -> Packs:
    """(oneDNN copy, small-batch copy) of a linear weight, one of them at most: with the
    small-batch layout, larger batches use the plain weight (F.linear reorders it per call,
    which at prefill sizes is small next to the work)."""
    small = pack_small_weight(weight, ops)
    return (pack_weight(weight) if small is None else None), small


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    packed: torch.Tensor | None,
    small: torch.Tensor | None,
    quant: Quantized | None,
    ops: Any,
) -> torch.Tensor:
    """x @ weight.T (+ bias) on the fastest form of the weight for x's row count; a
    quantized weight on ``quant_linear``."""
    if quant is not None:
        return quant_linear(x, quant, bias, ops)
    # Every route takes at least SMALL_GEMM_MAX_ROWS: a decode batch never asks the library
    # for its route (one dispatcher call per linear per step).
    if (
        small is not None
        and x.dim() == 2
        and (x.shape[0] <= SMALL_GEMM_MAX_ROWS or x.shape[0] <= small_gemm_max_rows(small))
    ):
        return ops.small_gemm(x, small, bias)
    if packed is not None:
        return packed_linear(x, packed, bias)
    return F.linear(x, weight, bias)
