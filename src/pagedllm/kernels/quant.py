"""Linear weights kept in GGUF's block-quantized formats (Q8_0, Q4_0, Q4_1): the only copy.

A GGUF tensor's blocks are repacked once at load (``from_gguf_blocks``) into the layout of
``quant_gemm`` (``csrc/quant_gemm.cpp``): one tensor, a row per weight row, holding the
row's quants as stored, then its blocks' fp16 scales ``d``, then (4-bit) their minimums
``m``. The tensor's dtype names the layout (int8: q8, uint8: q4), so that it passes for a
weight wherever the one-call decoder takes one::

    Q8_0  block: d, 32 x int8           ->  int8  [N, K + 2 K/32]:  q..., d...        w = d q
    Q4_0  block: d, 16 bytes of nibbles  ->  uint8 [N, K/2 + 4 K/32]: q..., d..., m...  w = d q + m
    Q4_1  block: d, m, 16 bytes          ->  (as Q4_0; Q4_0 is m = -8 d)

``quant_linear`` runs a decode-sized batch on ``quant_gemm`` (activations quantised to int8
per 32-block, integer dot products, block scales in float) and a larger one on the float
GEMM over dequantised tiles of rows (``quant_dequantize``). ``dequantize`` is the plain
torch reference of the layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

BLOCK = 32
# The stored formats kept as they are, and the dtype of the layout each one becomes.
FORMATS = {"Q8_0": torch.int8, "Q4_0": torch.uint8, "Q4_1": torch.uint8}
# Up to this many rows a linear runs on quant_gemm; more go to the float GEMM over
# dequantised tiles (the measurements: docs/performance.md, quantized weights).
QUANT_GEMM_MAX_ROWS = 16
# Elements of one dequantised tile: a few MiB, so that a prompt step never holds a whole
# large weight (the LM head) in float at once.
TILE_ELEMENTS = 1 << 20


@dataclass(frozen=True, slots=True)
class QuantWeight:
    """A linear's weight [N, K] in ``quant_gemm``'s layout (``data``). ``format``: the GGUF
    type(s) it was stored as ("Q4_1"; fused parts of two types read "Q4_0+Q4_1")."""

    format: str
    data: torch.Tensor

    @property
    def four_bit(self) -> bool:
        return self.data.dtype == torch.uint8

    @property
    def shape(self) -> tuple[int, int]:
        rows, stride = self.data.shape
        return rows, stride * 8 // 5 if self.four_bit else stride * 16 // 17

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def rows(self, index: torch.Tensor | slice) -> QuantWeight:
        """The weight of the rows ``index`` (a slice, or a permutation / gather)."""
        return QuantWeight(self.format, self.data[index].contiguous())

    def parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(quants [N, K] or [N, K/2], d [N, K/32] fp16, m [N, K/32] fp16 or None)."""
        rows, width = self.shape
        quant_bytes = width // 2 if self.four_bit else width
        blocks = width // BLOCK
        data = self.data.view(torch.uint8)
        d = data[:, quant_bytes : quant_bytes + 2 * blocks].contiguous().view(torch.float16)
        m = data[:, quant_bytes + 2 * blocks :].contiguous().view(torch.float16)
        return self.data[:, :quant_bytes], d, m if self.four_bit else None


def from_gguf_blocks(blocks: np.ndarray, format: str, shape: tuple[int, int]) -> QuantWeight:
    """The weight of shape (N, K) from a GGUF tensor's raw blocks (uint8, one row of blocks
    per weight row, as ``GGUFReader`` gives them)."""
    if format not in FORMATS:
        raise ValueError(
            f"unsupported quantized format {format!r}; supported: {', '.join(FORMATS)}"
        )
    rows, width = shape
    if width % BLOCK:
        raise ValueError(f"a {format} weight needs whole blocks of {BLOCK}, got width {width}")
    raw = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(rows, width // BLOCK, -1)
    d = raw[:, :, 0:2]
    if format == "Q8_0":
        parts = [raw[:, :, 2:34], d]
    elif format == "Q4_0":
        m = (np.ascontiguousarray(d).view(np.float16) * np.float16(-8)).view(np.uint8)
        parts = [raw[:, :, 2:18], d, m]
    else:
        parts = [raw[:, :, 4:20], d, raw[:, :, 2:4]]
    data = np.concatenate([p.reshape(rows, -1) for p in parts], axis=1)
    return QuantWeight(format, torch.from_numpy(data).view(FORMATS[format]))


def concat_rows(parts: list[QuantWeight]) -> QuantWeight:
    """One weight of ``parts``' rows in order (q/k/v or gate/up fused into one linear);
    ``ValueError`` unless they share one layout."""
    if len({p.data.dtype for p in parts}) != 1 or len({p.shape[1] for p in parts}) != 1:
        raise ValueError("fused parts must share one quantized layout and width")
    names = "+".join(dict.fromkeys(p.format for p in parts))
    return QuantWeight(names, torch.cat([p.data for p in parts]))


def dequantize(weight: QuantWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight [N, K] (computed in float32, then cast): the plain reference of the
    layout, and the fallback where the C++ kernels are missing."""
    rows, width = weight.shape
    quants, d, m = weight.parts()
    d = d.float()[:, :, None]
    if m is None:
        q = quants.float().view(rows, -1, BLOCK)
        return (d * q).reshape(rows, width).to(dtype)
    packed = quants.contiguous().view(rows, -1, BLOCK // 2)
    q = torch.cat((packed & 0x0F, packed >> 4), dim=2).float()
    return (d * q + m.float()[:, :, None]).reshape(rows, width).to(dtype)


def quant_linear(
    x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None, ops
) -> torch.Tensor:
    """x @ weight.T (+ bias): on ``quant_gemm`` up to ``QUANT_GEMM_MAX_ROWS`` rows, else on
    the float GEMM over dequantised tiles of rows."""
    if (
        ops is not None
        and x.dim() == 2
        and x.shape[0] <= QUANT_GEMM_MAX_ROWS
        and x.dtype in (torch.float32, torch.bfloat16)
        and x.device.type == "cpu"
    ):
        return ops.quant_gemm(x, weight.data, bias)
    return dequantized_linear(x, weight, bias, ops)


def dequantized_linear(
    x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None, ops
) -> torch.Tensor:
    """``F.linear`` over tiles of the weight's rows, each dequantised just before its use."""
    rows, width = weight.shape
    step = max(1, TILE_ELEMENTS // width)
    outs = []
    for start in range(0, rows, step):
        tile = weight if step >= rows else weight.rows(slice(start, start + step))
        part_bias = None if bias is None else bias[start : start + step]
        outs.append(F.linear(x, dequantize_rows(tile, x.dtype, ops), part_bias))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


def dequantize_rows(weight: QuantWeight, dtype: torch.dtype, ops) -> torch.Tensor:
    """``dequantize`` through the C++ kernel where it applies."""
    if ops is not None and dtype in (torch.float32, torch.bfloat16):
        return ops.quant_dequantize(weight.data, dtype)
    return dequantize(weight, dtype)
