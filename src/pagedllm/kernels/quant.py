"""Linear weights kept in GGUF's block-quantized formats: the only copy of each weight.

A GGUF tensor's blocks are repacked once at load (``from_gguf_blocks``) into the layout of
the kernels (``csrc/quant_formats.h``): one uint8 tensor, a row per weight row, holding the
row's sections one after the other (B = K/32 blocks, S = K/256 super-blocks)::

    Q8_0  qs int8 [K], d [B]                               w = d q
    Q4_0  qs [K/2], d [B]                                  w = d (q - 8)
    Q4_1  qs [K/2], d [B], m [B]                           w = d q + m
    Q5_0  qs [K/2], qh [K/8], d [B]                        w = d (q - 16)
    Q4_K  qs [K/2], sc [B], mn [B], d [S], dmin [S]        w = d sc q - dmin mn
    Q5_K  qs [K/2], qh [K/8], sc [B], mn [B], d [S], dmin [S]
    Q6_K  ql [K/2], qh [K/4], sc int8 [K/16], d [S]        w = d sc (q - 32), sc per 16

Quants stay as GGUF stores them; the K-quants' 6-bit sub-scales become bytes, and Q6_K's 16
scales of a super-block are kept even ones first. ``quant_linear`` runs every row count on
``quant_gemm`` (integer dot products with activations quantised to int8 per 32-block for
decode-sized batches, dequantised tiles on ``small_gemm`` for prompts); ``dequantize`` is the
plain torch reference of the layouts and the fallback where the C++ kernels are missing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

BLOCK = 32
SUPER_BLOCK = 256
# The formats kept as stored, by their GGML type numbers (the kernels' format argument).
CODES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
FORMATS = tuple(CODES)
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")
# Bytes of one block of 32 weights (K-quants: one super-block of 256) in the kernels' layout.
_UNIT_BYTES = {
    "Q8_0": 34,
    "Q4_0": 18,
    "Q4_1": 20,
    "Q5_0": 22,
    "Q4_K": 148,
    "Q5_K": 180,
    "Q6_K": 210,
}
# Formats whose values another holds exactly, widest last: a fused linear whose parts came
# in several formats keeps the narrowest that holds them all (``concat_rows``).
_WIDER = {"Q4_0": ("Q5_0", "Q8_0"), "Q5_0": ("Q8_0",), "Q4_K": ("Q5_K",)}
# Elements of one dequantised tile on the torch path: a few MiB, so that a prompt step never
# holds a whole large weight (the LM head) in float at once.
TILE_ELEMENTS = 1 << 20


def unit(format: str) -> int:
    """Weights per repeated unit of ``format``'s layout: 32, or 256 for a K-quant."""
    return SUPER_BLOCK if format in K_QUANTS else BLOCK


def row_bytes(format: str, width: int) -> int:
    """Bytes of one row of ``width`` weights."""
    return width // unit(format) * _UNIT_BYTES[format]


@dataclass(frozen=True, slots=True)
class QuantWeight:
    """A linear's weight [N, K] in the kernels' layout of ``format`` (``data``, uint8).
    ``stored``: the GGUF formats its rows came in, where it differs ("Q5_0+Q8_0" widened to
    Q8_0 to fuse q/k/v)."""

    format: str
    data: torch.Tensor
    stored: str = ""

    @property
    def code(self) -> int:
        return CODES[self.format]

    @property
    def source(self) -> str:
        return self.stored or self.format

    @property
    def shape(self) -> tuple[int, int]:
        rows, size = self.data.shape
        return rows, size // _UNIT_BYTES[self.format] * unit(self.format)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def rows(self, index: torch.Tensor | slice) -> QuantWeight:
        """The weight of the rows ``index`` (a slice, or a permutation / gather)."""
        return QuantWeight(self.format, self.data[index].contiguous(), self.stored)


def check_format(format: str, width: int) -> None:
    if format not in CODES:
        raise ValueError(
            f"unsupported quantized format {format!r}; supported: {', '.join(FORMATS)}"
        )
    if width % unit(format):
        raise ValueError(
            f"a {format} weight needs whole blocks of {unit(format)}, got width {width}"
        )


def from_gguf_blocks(blocks: np.ndarray, format: str, shape: tuple[int, int]) -> QuantWeight:
    """The weight of shape (N, K) from a GGUF tensor's raw blocks (uint8, one row of blocks
    per weight row, as ``GGUFReader`` gives them)."""
    rows, width = shape
    check_format(format, width)
    raw = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(rows, width // unit(format), -1)
    parts = [raw[:, :, a:b] for a, b in _gguf_sections(format)]
    if format in ("Q4_K", "Q5_K"):
        from gguf.quants import Q4_K

        sc, mn = Q4_K.get_scale_min(raw[:, :, 4:16].reshape(-1, 12))
        at = len(parts) - 2  # before d and dmin
        parts[at:at] = [sc.reshape(rows, -1), mn.reshape(rows, -1)]
    elif format == "Q6_K":
        scales = raw[:, :, 192:208]
        parts[2] = np.concatenate((scales[:, :, 0::2], scales[:, :, 1::2]), axis=2)
    data = np.concatenate([p.reshape(rows, -1) for p in parts], axis=1)
    return QuantWeight(format, torch.from_numpy(data))


def _gguf_sections(format: str) -> list[tuple[int, int]]:
    """Byte ranges of a GGUF block that make the layout's sections, in order (Q4_K / Q5_K:
    their sc and mn, unpacked from the 6-bit scales, go before d and dmin)."""
    return {
        "Q8_0": [(2, 34), (0, 2)],
        "Q4_0": [(2, 18), (0, 2)],
        "Q4_1": [(4, 20), (0, 2), (2, 4)],
        "Q5_0": [(6, 22), (2, 6), (0, 2)],
        "Q4_K": [(16, 144), (0, 2), (2, 4)],
        "Q5_K": [(48, 176), (16, 48), (0, 2), (2, 4)],
        "Q6_K": [(0, 128), (128, 192), (192, 208), (208, 210)],
    }[format]


def _sections(weight: QuantWeight) -> list[torch.Tensor]:
    """The layout's sections of every row, in the order of the module's table."""
    rows, width = weight.shape
    blocks, supers = width // BLOCK, width // SUPER_BLOCK
    sizes = {
        "Q8_0": [width, 2 * blocks],
        "Q4_0": [width // 2, 2 * blocks],
        "Q4_1": [width // 2, 2 * blocks, 2 * blocks],
        "Q5_0": [width // 2, width // 8, 2 * blocks],
        "Q4_K": [width // 2, blocks, blocks, 2 * supers, 2 * supers],
        "Q5_K": [width // 2, width // 8, blocks, blocks, 2 * supers, 2 * supers],
        "Q6_K": [width // 2, width // 4, width // 16, 2 * supers],
    }[weight.format]
    return list(weight.data.split(sizes, dim=1))


def _halves(section: torch.Tensor) -> torch.Tensor:
    """fp16 values stored as byte pairs, as float32."""
    return section.contiguous().view(torch.float16).float()


def stored_integers(weight: QuantWeight) -> torch.Tensor:
    """Every weight's stored integer q (int16 [N, K]): signed for Q8_0, else unsigned."""
    rows, width = weight.shape
    parts = _sections(weight)
    qs = parts[0]
    if weight.format == "Q8_0":
        return qs.view(torch.int8).to(torch.int16)
    if weight.format in ("Q4_0", "Q4_1", "Q5_0"):
        packed = qs.reshape(rows, -1, BLOCK // 2)
        q = torch.cat((packed & 0x0F, packed >> 4), dim=2).reshape(rows, width)
        if weight.format == "Q5_0":
            q = q | (_bits(parts[1].reshape(rows, -1, 4)).reshape(rows, width) << 4)
        return q.to(torch.int16)
    if weight.format in ("Q4_K", "Q5_K"):
        runs = qs.reshape(rows, -1, 4, 1, BLOCK)
        q = torch.cat((runs & 0x0F, runs >> 4), dim=3).reshape(rows, -1, 8, BLOCK)
        if weight.format == "Q5_K":
            qh = parts[1].reshape(rows, -1, 1, BLOCK)
            shifts = torch.arange(8, dtype=torch.uint8).view(1, 1, 8, 1)
            q = q | (((qh >> shifts) & 1) << 4)
        return q.reshape(rows, width).to(torch.int16)
    ql = qs.reshape(rows, -1, 2, 1, 2, BLOCK)  # super-block, half, nibble, run, element
    low = torch.cat((ql & 0x0F, ql >> 4), dim=3).reshape(rows, -1, 2, 4, BLOCK)
    qh = parts[1].reshape(rows, -1, 2, 1, BLOCK)
    shifts = torch.arange(0, 8, 2, dtype=torch.uint8).view(1, 1, 1, 4, 1)
    return (low | (((qh >> shifts) & 3) << 4)).reshape(rows, width).to(torch.int16)


def _bits(qh: torch.Tensor) -> torch.Tensor:
    """[..., 4] bytes -> [..., 32] bits, little-endian (bit j of the 32: element j)."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((qh[..., :, None] >> shifts) & 1).flatten(-2)


def dequantize(weight: QuantWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight [N, K] (computed in float32 as GGUF's dequantisers do, then cast):
    the plain reference of the layouts, and the fallback where the C++ kernels are missing."""
    rows, width = weight.shape
    q = stored_integers(weight).float().view(rows, -1, BLOCK)
    parts = _sections(weight)
    fmt = weight.format
    if fmt in ("Q8_0", "Q4_0", "Q4_1", "Q5_0"):
        d = _halves(parts[-2] if fmt == "Q4_1" else parts[-1])[:, :, None]
        if fmt == "Q4_1":
            w = d * q + _halves(parts[-1])[:, :, None]
        else:
            w = d * (q - {"Q8_0": 0, "Q4_0": 8, "Q5_0": 16}[fmt])
    elif fmt in ("Q4_K", "Q5_K"):
        sc, mn = parts[-4].float(), parts[-3].float()
        d, dmin = _halves(parts[-2]), _halves(parts[-1])
        scale = (d.repeat_interleave(8, dim=1) * sc)[:, :, None]
        low = (dmin.repeat_interleave(8, dim=1) * mn)[:, :, None]
        w = scale * q - low
    else:
        stored = parts[2].view(torch.int8).reshape(rows, -1, 2, 8)
        sc = stored.transpose(2, 3).reshape(rows, -1).float()  # natural order, per 16
        scale = _halves(parts[3]).repeat_interleave(16, dim=1) * sc
        w = scale[:, :, None] * (q.view(rows, -1, 16) - 32)
    return w.reshape(rows, width).to(dtype)


def widen(weight: QuantWeight, format: str) -> QuantWeight:
    """The same values in a wider format that holds them exactly (``_WIDER``): Q4_0 or Q5_0
    as Q8_0 (the same scales, q less its offset), Q4_0 as Q5_0 (q + 8), Q4_K as Q5_K (no high
    bits)."""
    if format == weight.format:
        return weight
    if format not in _WIDER.get(weight.format, ()):
        raise ValueError(f"{weight.format} has no exact {format} form")
    rows, width = weight.shape
    parts = _sections(weight)
    q = stored_integers(weight)
    if weight.format == "Q4_K":
        high = torch.zeros(rows, width // 8, dtype=torch.uint8)
        return QuantWeight(format, torch.cat((parts[0], high, *parts[1:]), dim=1), weight.source)
    offset = {"Q4_0": 8, "Q5_0": 16}[weight.format]
    d = parts[-1]
    if format == "Q8_0":
        qs = (q - offset).to(torch.int8).view(torch.uint8)
        return QuantWeight(format, torch.cat((qs, d), dim=1), weight.source)
    q5 = (q + 8).to(torch.uint8).view(rows, -1, BLOCK)  # Q4_0 -> Q5_0
    nibbles = (q5[:, :, :16] & 0x0F) | ((q5[:, :, 16:] & 0x0F) << 4)
    high = (q5 >> 4).view(rows, -1, 4, 8) << torch.arange(8, dtype=torch.uint8)
    qh = high.sum(dim=3, dtype=torch.uint8)  # the 8 bits of each byte, or'ed
    data = torch.cat((nibbles.reshape(rows, -1), qh.reshape(rows, -1), d), dim=1)
    return QuantWeight(format, data, weight.source)


def common_format(formats: list[str]) -> str | None:
    """The narrowest format that holds weights of all ``formats`` exactly, or None."""
    for candidate in dict.fromkeys([*formats, *(w for f in formats for w in _WIDER.get(f, ()))]):
        if all(f == candidate or candidate in _WIDER.get(f, ()) for f in formats):
            return candidate
    return None


def concat_rows(parts: list[QuantWeight]) -> QuantWeight:
    """One weight of ``parts``' rows in order (q/k/v or gate/up fused into one linear), in
    the narrowest format that holds every part exactly (``widen``); ``ValueError`` where
    none does or the widths differ."""
    target = common_format([p.format for p in parts])
    if target is None or len({p.shape[1] for p in parts}) != 1:
        raise ValueError("fused parts must share one quantized layout and width")
    sources = "+".join(dict.fromkeys(p.source for p in parts))
    data = torch.cat([widen(p, target).data for p in parts])
    return QuantWeight(target, data, "" if sources == target else sources)


def quant_linear(
    x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None, ops
) -> torch.Tensor:
    """x @ weight.T (+ bias): on ``quant_gemm`` (``ops``: the kernels, where they run this
    weight), else in torch over dequantised tiles of rows."""
    if ops is not None and x.dtype in (torch.float32, torch.bfloat16) and x.device.type == "cpu":
        flat = x.reshape(-1, x.shape[-1])
        out = ops.quant_gemm(flat, weight.data, weight.code, bias)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[-1])
    return dequantized_linear(x, weight, bias)


def dequantized_linear(
    x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None
) -> torch.Tensor:
    """``F.linear`` over tiles of the weight's rows, each dequantised (``dequantize``) just
    before its use."""
    rows, width = weight.shape
    step = max(1, TILE_ELEMENTS // width)
    outs = []
    for start in range(0, rows, step):
        tile = weight if step >= rows else weight.rows(slice(start, start + step))
        part_bias = None if bias is None else bias[start : start + step]
        outs.append(F.linear(x, dequantize(tile, x.dtype), part_bias))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


def dequantize_rows(weight: QuantWeight, dtype: torch.dtype, ops) -> torch.Tensor:
    """``dequantize`` through the C++ kernel where it applies."""
    if ops is not None and dtype in (torch.float32, torch.bfloat16):
        return ops.quant_dequantize(weight.data, weight.code, dtype)
    return dequantize(weight, dtype)


def kernels_run(ops) -> bool:
    """``ops`` (the C++ kernels or None) run quantized weights on this CPU."""
    return ops is not None and ops.quant_gemm_isa() != "none"
