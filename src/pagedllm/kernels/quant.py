"""Linear weights kept in GGUF's block-quantized formats (Q8_0, Q4_0, Q4_1): the only copy.

A GGUF tensor's blocks are repacked once at load (``from_gguf_blocks``) into the layout of
``quant_gemm`` (``csrc/quant_gemm.cpp``): per row, the quants as stored, and the block
scales ``d`` (and minimums ``m``) apart as fp16::

    Q8_0  block: d, 32 x int8          ->  qs int8 [N, K]       d [N, K/32]   w = d q
    Q4_0  block: d, 16 bytes of nibbles ->  qs uint8 [N, K/2]    d, m = -8 d    w = d q + m
    Q4_1  block: d, m, 16 bytes         ->  qs uint8 [N, K/2]    d, m           w = d q + m

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
# The stored formats kept as they are, and the kernel's layout each one becomes.
Q8 = 0
Q4 = 1
FORMATS = {"Q8_0": Q8, "Q4_0": Q4, "Q4_1": Q4}
# Up to this many rows a linear runs on quant_gemm; more go to the float GEMM over
# dequantised tiles (the measurements: docs/performance.md, quantized weights).
QUANT_GEMM_MAX_ROWS = 16
# Elements of one dequantised tile: a few MiB, so that a prompt step never holds a whole
# large weight (the LM head) in float at once.
TILE_ELEMENTS = 1 << 20


@dataclass(frozen=True, slots=True)
class QuantWeight:
    """A linear's weight [N, K] in ``quant_gemm``'s layout. ``format``: the GGUF type(s) it
    was stored as ("Q4_1"; fused parts of two types read "Q4_0+Q4_1")."""

    format: str
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None

    @property
    def code(self) -> int:
        return Q8 if self.m is None else Q4

    @property
    def shape(self) -> tuple[int, int]:
        rows, width = self.qs.shape
        return rows, width if self.code == Q8 else 2 * width

    @property
    def nbytes(self) -> int:
        parts = (self.qs, self.d) if self.m is None else (self.qs, self.d, self.m)
        return sum(t.numel() * t.element_size() for t in parts)

    def rows(self, index: torch.Tensor | slice) -> QuantWeight:
        """The weight of the rows ``index`` (a slice, or a permutation / gather)."""

        def take(t: torch.Tensor) -> torch.Tensor:
            return t[index].contiguous()

        return QuantWeight(self.format, take(self.qs), take(self.d), _maybe(take, self.m))


def _maybe(fn, t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else fn(t)


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
    nb = width // BLOCK
    raw = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(rows, nb, -1)
    d = _halves(raw[:, :, 0:2])
    if format == "Q8_0":
        qs = raw[:, :, 2:34].view(np.int8).reshape(rows, width)
        return QuantWeight(format, torch.from_numpy(qs.copy()), d, None)
    if format == "Q4_0":
        qs = raw[:, :, 2:18].reshape(rows, width // 2)
        return QuantWeight(format, torch.from_numpy(qs.copy()), d, d * -8)
    qs = raw[:, :, 4:20].reshape(rows, width // 2)
    return QuantWeight(format, torch.from_numpy(qs.copy()), d, _halves(raw[:, :, 2:4]))


def _halves(pairs: np.ndarray) -> torch.Tensor:
    """fp16 [N, blocks] from [N, blocks, 2] bytes (little-endian)."""
    return torch.from_numpy(np.ascontiguousarray(pairs).view(np.float16)[..., 0].copy())


def concat_rows(parts: list[QuantWeight]) -> QuantWeight:
    """One weight of ``parts``' rows in order (q/k/v or gate/up fused into one linear);
    ``ValueError`` unless they share one layout."""
    if len({p.code for p in parts}) != 1 or len({p.shape[1] for p in parts}) != 1:
        raise ValueError("fused parts must share one quantized layout and width")
    names = "+".join(dict.fromkeys(p.format for p in parts))

    def cat(ts: list[torch.Tensor | None]) -> torch.Tensor | None:
        return None if ts[0] is None else torch.cat(ts)  # type: ignore[arg-type]

    return QuantWeight(
        names,
        cat([p.qs for p in parts]),  # type: ignore[arg-type]
        cat([p.d for p in parts]),  # type: ignore[arg-type]
        cat([p.m for p in parts]),
    )


def dequantize(weight: QuantWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight [N, K] (computed in float32, then cast): the plain reference of the
    layout, and the fallback where the C++ kernels are missing."""
    rows, width = weight.shape
    d = weight.d.float()[:, :, None]
    if weight.m is None:
        q = weight.qs.float().view(rows, -1, BLOCK)
        return (d * q).reshape(rows, width).to(dtype)
    packed = weight.qs.view(rows, -1, BLOCK // 2)
    q = torch.cat((packed & 0x0F, packed >> 4), dim=2).float()
    return (d * q + weight.m.float()[:, :, None]).reshape(rows, width).to(dtype)


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
        return ops.quant_gemm(x, weight.qs, weight.d, weight.m, weight.code, bias)
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
        return ops.quant_dequantize(weight.qs, weight.d, weight.m, weight.code, dtype)
    return dequantize(weight, dtype)
