"""Linear layers on pagedllm's kernels: the packed weight layouts and the choice between them.

A linear's weight is packed once (``pack_for_cpu``) into the small-batch kernel's layout
(``small_gemm``, ``csrc/small_gemm.cpp``) where this CPU runs it, else oneDNN's blocked bf16
layout, and the packed copy replaces the plain weight: ``linear`` runs every row count on
it. Where a reference path needs the row-major weight it is made on demand
(``dense_weight``), not kept; a table tied to a packed head gives its rows from the packed
copy (``small_rows``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from pagedllm.kernels.quant import Quantized, dequantize, quant_linear

# The most rows the one-call decoder loop (``decoder_layers``) takes on small_gemm: float32
# up to the default max_num_seqs (every decode batch), bf16 and float32 on AVX2 up to their
# prompt chunks; bigger steps go layer by layer. Every row count runs on the kernel, whose
# packed copy is the weight's only one: beyond these counts MKL / oneDNN on a plain copy
# were level or up to ~1.3x faster per product (docs/performance.md, small_gemm), which no
# longer pays for a second copy of every weight.
SMALL_GEMM_MAX_ROWS = 256
SMALL_GEMM_MAX_ROWS_BF16 = 1024
SMALL_GEMM_MAX_ROWS_F32_AVX2 = 1024


def small_gemm_max_rows(small: torch.Tensor) -> int:
    """The most rows the one-call decoder loop runs on a weight packed as ``small``."""
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
    """A linear's weight and bias with its packed forms: ``linear``'s arguments. A weight
    packed (``packed``: oneDNN's, or ``small``: small_gemm's) or kept quantized (``quant``)
    has no other copy: ``weight`` is then empty (of the model's dtype)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    packed: torch.Tensor | None
    small: torch.Tensor | None
    quant: Quantized | None = None


# A weight's packed copies: (oneDNN's, small_gemm's), one of them at most.
Packs = tuple[torch.Tensor | None, torch.Tensor | None]


def pack_for_cpu(weight: torch.Tensor, ops: Any) -> Packs:
    """(oneDNN copy, small-batch copy) of a linear weight, one of them at most (both None
    where neither applies: the plain weight stays the only one)."""
    small = pack_small_weight(weight, ops)
    return (pack_weight(weight) if small is None else None), small


def unpack_small(small: torch.Tensor) -> torch.Tensor:
    """The row-major [N, K] weight of small_gemm's packed copy (``pack_small_gemm``: float32
    [N/16, K, 16], element (g, j, c) = w[16 g + c, j]; bf16 [N/16, K/32, 16, 32], element
    (g, t, p, 2 c + h) = w[16 g + c, 32 t + 2 p + h]), made on demand."""
    return small_rows(small, torch.arange(small.shape[0] * 16, device=small.device))


def small_rows(small: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` (any shape) of the weight packed as ``small``: [*ids.shape, K]."""
    groups, cols = ids.div(16, rounding_mode="floor"), ids.remainder(16)
    if small.dtype == torch.float32:
        return small[groups, :, cols]  # [*ids, K]
    n, steps = small.shape[0], small.shape[1]
    pairs = small.view(n, steps, 16, 16, 2)[groups, :, :, cols]  # [*ids, K/32, 16, 2]
    return pairs.reshape(*ids.shape, steps * 32)


def dense_weight(t: LinearTensors) -> torch.Tensor:
    """A linear's row-major weight for a reference path: the plain one where it is held,
    else made from its packed or quantized form (a new tensor each call, not kept)."""
    if t.weight.numel():
        return t.weight
    if t.small is not None:
        return unpack_small(t.small)
    if t.packed is not None:
        return t.packed.to_dense()
    if t.quant is not None:
        return dequantize(t.quant, t.weight.dtype)
    return t.weight


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    packed: torch.Tensor | None,
    small: torch.Tensor | None,
    quant: Quantized | None,
    ops: Any,
) -> torch.Tensor:
    """x @ weight.T (+ bias) on the form the weight is held in: small_gemm's packed copy,
    oneDNN's, the plain weight, or a quantized weight on ``quant_linear``."""
    if quant is not None:
        return quant_linear(x, quant, bias, ops)
    if small is not None:
        if x.dim() == 2:
            return ops.small_gemm(x, small, bias)
        rows = ops.small_gemm(x.reshape(-1, x.shape[-1]), small, bias)
        return rows.view(*x.shape[:-1], rows.shape[-1])
    if packed is not None:
        return packed_linear(x, packed, bias)
    return F.linear(x, weight, bias)
