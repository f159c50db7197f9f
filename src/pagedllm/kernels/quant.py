"""Linear weights kept in GGUF's block-quantized formats: the only copy of each weight.

A GGUF tensor's blocks are repacked once at load (``from_gguf_blocks``) into the layout of
the kernels (``csrc/quant_formats.h``): one uint8 tensor, a row per weight row, holding the
row's sections one after the other (B = K/32 blocks, P = ceil(B/2) pairs of them, G =
ceil(B/8) groups of eight, S = K/256 super-blocks)::

    Q8_0  qs int8 [K], d [B]                               w = d q
    Q4_0  qs [32 P], d [B]                                 w = d (q - 8)
    Q4_1  qs [32 P], d [B], m [B]                          w = d q + m
    Q5_0  qs [32 P], qh [32 G], d [B]                      w = d (q - 16)
    Q4_K  qs [K/2], sc [B], mn [B], d [S], dmin [S]        w = d sc q - dmin mn
    Q5_K  qs [K/2], qh [K/8], sc [B], mn [B], d [S], dmin [S]
    Q6_K  ql [K/2], qh [K/4], sc int8 [K/16], d [S]        w = d sc (q - 32), sc per 16

Nibbles come in 32-byte runs of two blocks (low nibbles the first, high the second) and fifth
bits in 32 bytes per eight blocks, as Q4_K / Q5_K store them, so that one load gives a
block's quants; Q4_0 / Q4_1 / Q5_0 are repacked into that shape (padded to whole runs and
groups), the K-quants' 6-bit sub-scales become bytes, and Q6_K's 16 scales of a super-block
are kept even ones first. ``quant_linear`` runs every row count on
``quant_gemm`` (integer dot products with activations quantised per 32-block, to int8, or
to int16 for Q8_0 weights in a model kept all in Q8_0: ``int8_for_q8_0``, for decode-sized
batches; dequantised tiles on
``small_gemm`` for prompts); ``dequantize`` is the
plain torch reference of the layouts and the fallback where the C++ kernels are missing.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace

import numpy as np
import torch
import torch.nn.functional as F

from pagedllm.quant_layout import (
    BLOCK,
    CODES,
    FORMATS,
    HOLDS_MINUS_128,
    INT8_ACTIVATIONS,
    fused_format,
    row_bytes,
    section_sizes,
    unit,
)

# Elements of one dequantised tile on the torch path: a few MiB, so that a prompt step never
# holds a whole large weight (the LM head) in float at once.
TILE_ELEMENTS = 1 << 20


def width_of(format: str, size: int) -> int:
    """The width whose rows take ``size`` bytes (padding adds less than eight units)."""
    step = unit(format)
    most = size * 512 // row_bytes(format, 512 * step)
    for units in range(most, max(most - 8, 0), -1):
        if row_bytes(format, units * step) == size:
            return units * step
    raise ValueError(f"a {format} row of {size} bytes holds no whole number of blocks")


@dataclass(frozen=True, slots=True)
class QuantWeight:
    """A linear's weight [N, K] in the kernels' layout of ``format`` (``data``, uint8).
    ``stored``: where its blocks came from, where not a GGUF's ("int8 at load").
    ``int8_activations``: a Q8_0 weight's activations quantised to int8 as every other
    format's, not to int16 (``int8_for_q8_0``); other formats ignore it.
    ``holds_minus_128``: read from ``data`` (never given), when a kernel first asks."""

    format: str
    data: torch.Tensor
    stored: str = ""
    int8_activations: bool = False
    # holds_minus_128's answer once read (None: not yet).
    _minus_128: bool | None = field(init=False, default=None, repr=False, compare=False)

    @property
    def holds_minus_128(self) -> bool:
        """Whether a Q8_0 weight has a quant byte of -128, which the AVX2 lane kernel
        multiplies the slower way (``quant_formats.h``): scanned once, on the first call
        (a weight's first product), not for every weight made (an embedding's looked-up
        rows, every step, are only dequantised)."""
        if self._minus_128 is None:
            object.__setattr__(
                self, "_minus_128", self.format == "Q8_0" and _holds_minus_128(self.data)
            )
        return bool(self._minus_128)

    @property
    def code(self) -> int:
        """``quant_gemm``'s format argument: the GGML type, Q8_0's with its activations
        (and whether a byte is -128, for int8 ones)."""
        if self.format == "Q8_0" and self.int8_activations:
            return CODES["Q8_0"] + INT8_ACTIVATIONS + HOLDS_MINUS_128 * self.holds_minus_128
        return CODES[self.format]

    @property
    def activations(self) -> str:
        """What ``quant_gemm``'s integer kernel quantises the activations to."""
        return "int16" if self.format == "Q8_0" and not self.int8_activations else "int8"

    @property
    def shape(self) -> tuple[int, int]:
        rows, size = self.data.shape
        return rows, width_of(self.format, size)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def rows(self, index: torch.Tensor | slice) -> QuantWeight:
        """The weight of the rows ``index`` (a slice, or a permutation / gather: an index
        tensor goes through ``index_select``, a fraction of advanced indexing's cost on the
        one row an embedding looks up per decode step)."""
        if isinstance(index, slice):
            return replace(self, data=self.data[index].contiguous())
        return replace(self, data=self.data.index_select(0, index))


# Rows of a Q8_0 weight compared at a time by _holds_minus_128: a few MiB of booleans, not
# a whole LM head's.
SCAN_ROWS = 4096


def _holds_minus_128(data: torch.Tensor) -> bool:
    """Whether a Q8_0 weight in the kernels' layout has a quant byte of -128."""
    blocks = data.shape[1] // row_bytes("Q8_0", BLOCK)  # no padding in Q8_0's layout
    held = section_sizes("Q8_0", blocks * BLOCK)[0]
    return any(
        bool((data[r : r + SCAN_ROWS, :held] == 0x80).any())
        for r in range(0, data.shape[0], SCAN_ROWS)
    )


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
    if format in ("Q4_0", "Q4_1", "Q5_0"):
        return _repacked_blocks(torch.from_numpy(raw.copy()), format)
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


def _repacked_blocks(raw: torch.Tensor, format: str) -> QuantWeight:
    """Q4_0 / Q4_1 / Q5_0 GGUF blocks [rows, B, bytes] in the kernels' layout: nibbles in
    runs, fifth bits in groups."""
    rows, blocks, _ = raw.shape
    quants = {"Q4_0": 2, "Q4_1": 4, "Q5_0": 6}[format]  # where a block's nibbles start
    packed = raw[:, :, quants : quants + 16]
    q = torch.cat((packed & 0x0F, packed >> 4), dim=2)  # [rows, B, 32]
    if format == "Q5_0":
        q = q | (_bits(raw[:, :, 2:6]) << 4)
    scales = [raw[:, :, 0:2].reshape(rows, -1)]
    if format == "Q4_1":
        scales.append(raw[:, :, 2:4].reshape(rows, -1))
    return QuantWeight(format, _pack_quants(q, format == "Q5_0", scales))


def _pack_quants(q: torch.Tensor, fifth_bits: bool, scales: list[torch.Tensor]) -> torch.Tensor:
    """Rows of the layout from stored integers q (uint8 [rows, B, 32], under 16, or 32 with
    ``fifth_bits``) and the scale sections that follow them."""
    rows, blocks, _ = q.shape
    if blocks % 2:
        q = torch.cat((q, q.new_zeros(rows, 1, BLOCK)), dim=1)
    runs = (q[:, 0::2] & 0x0F) | ((q[:, 1::2] & 0x0F) << 4)
    parts = [runs.reshape(rows, -1)]
    if fifth_bits:
        grouped = torch.cat((q, q.new_zeros(rows, -q.shape[1] % 8, BLOCK)), dim=1) >> 4
        shifts = torch.arange(8, dtype=torch.uint8).view(1, 1, 8, 1)
        high = (grouped.view(rows, -1, 8, BLOCK) << shifts).sum(dim=2, dtype=torch.uint8)
        parts.append(high.reshape(rows, -1))
    return torch.cat([*parts, *scales], dim=1)


def _gguf_sections(format: str) -> list[tuple[int, int]]:
    """Byte ranges of a GGUF block that make the layout's sections, in order (Q4_K / Q5_K:
    their sc and mn, unpacked from the 6-bit scales, go before d and dmin)."""
    return {
        "Q8_0": [(2, 34), (0, 2)],
        "Q4_K": [(16, 144), (0, 2), (2, 4)],
        "Q5_K": [(48, 176), (16, 48), (0, 2), (2, 4)],
        "Q6_K": [(0, 128), (128, 192), (192, 208), (208, 210)],
    }[format]


def _sections(weight: QuantWeight) -> list[torch.Tensor]:
    """The layout's sections of every row, in the order of the module's table."""
    return list(weight.data.split(section_sizes(weight.format, weight.shape[1]), dim=1))


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
    if weight.format != "Q6_K":
        runs = qs.reshape(rows, -1, 1, BLOCK)
        q = torch.cat((runs & 0x0F, runs >> 4), dim=2).reshape(rows, -1, BLOCK)
        if weight.format in ("Q5_0", "Q5_K"):
            qh = parts[1].reshape(rows, -1, 1, BLOCK)
            shifts = torch.arange(8, dtype=torch.uint8).view(1, 1, 8, 1)
            high = ((qh >> shifts) & 1).reshape(rows, -1, BLOCK)
            q = q[:, : high.shape[1]] | (high[:, : q.shape[1]] << 4)
        return q[:, : width // BLOCK].reshape(rows, width).to(torch.int16)
    ql = qs.reshape(rows, -1, 2, 1, 2, BLOCK)  # super-block, half, nibble, run, element
    low = torch.cat((ql & 0x0F, ql >> 4), dim=3).reshape(rows, -1, 2, 4, BLOCK)
    qh = parts[1].reshape(rows, -1, 2, 1, BLOCK)
    shifts = torch.arange(0, 8, 2, dtype=torch.uint8).view(1, 1, 1, 4, 1)
    return (low | (((qh >> shifts) & 3) << 4)).reshape(rows, width).to(torch.int16)


def _bits(qh: torch.Tensor) -> torch.Tensor:
    """[..., 4] bytes -> [..., 32] bits, little-endian (bit j of the 32: element j): Q5_0's
    fifth bits as GGUF stores them."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((qh[..., :, None] >> shifts) & 1).flatten(-2)


def dequantize(
    weight: QuantWeight | QuantParts, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The float weight [N, K] (computed in float32 as GGUF's dequantisers do, then cast):
    the plain reference of the layouts, and the fallback where the C++ kernels are missing."""
    if isinstance(weight, QuantParts):
        return torch.cat([dequantize(part, dtype) for part in weight.parts])
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


@dataclass(frozen=True, slots=True)
class QuantParts:
    """A linear's weight kept as row blocks in different formats (q, k and v stored apart:
    llama.cpp's Q4_K_M keeps v in Q6_K beside Q4_K q/k in some layers), each block its own
    ``QuantWeight`` and its own ``quant_gemm`` call, the outputs side by side: the file's
    bytes, none widened or dequantised."""

    parts: tuple[QuantWeight, ...]

    @property
    def format(self) -> str:
        """The parts' formats in order ("Q4_K+Q4_K+Q6_K")."""
        return "+".join(p.format for p in self.parts)

    @property
    def stored(self) -> str:
        return ""

    @property
    def activations(self) -> str:
        """The parts' activations, each kind once ("int8", or "int8+int16")."""
        return "+".join(dict.fromkeys(p.activations for p in self.parts))

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def rows(self, index: torch.Tensor | slice) -> QuantWeight | QuantParts:
        """The weight of the rows ``index``, which must keep the parts' order (a tensor
        parallel rank's q, k and v rows)."""
        ends = torch.tensor([p.shape[0] for p in self.parts]).cumsum(0)
        picked = torch.arange(int(ends[-1]))[index]
        owner = torch.bucketize(picked, ends, right=True)
        if bool((owner.diff() < 0).any()):
            raise ValueError("rows of a weight kept in parts must keep the parts' order")
        kept = [
            part.rows(picked[owner == i] - (int(ends[i - 1]) if i else 0))
            for i, part in enumerate(self.parts)
            if bool((owner == i).any())
        ]
        return kept[0] if len(kept) == 1 else QuantParts(tuple(kept))


# A linear's weight kept quantized: one layout, or row blocks in several (``QuantParts``).
Quantized = QuantWeight | QuantParts

# What a model's Q8_0 weights' activations are quantised to ("auto": ``int8_for_q8_0``).
Q8_0_ACTIVATIONS = ("auto", "int16", "int8")


def check_q8_0_activations(choice: str) -> None:
    """``ValueError`` naming the field unless ``choice`` is one of ``Q8_0_ACTIVATIONS``."""
    if choice not in Q8_0_ACTIVATIONS:
        raise ValueError(
            f"q8_0_activations must be one of {', '.join(Q8_0_ACTIVATIONS)}, got {choice!r}"
        )


def int8_for_q8_0(formats: Iterable[str], choice: str = "auto") -> bool:
    """Whether a model's Q8_0 weights take int8 activations, given every kept weight's
    format. "auto": where any is stored at fewer bits (the LM head and some v projections
    of a Q4_K_M, Q5_0 or Q4_1 file), as llama.cpp runs them: that file's error is its
    low-bit weights', and int16 activations made its 16-row batches ~10% slower for a
    fraction of a point of top-1 (docs/performance.md). A model kept all in Q8_0 keeps
    int16 (the Q8_0 quality goal). ``ValueError`` for another ``choice``."""
    check_q8_0_activations(choice)
    if choice != "auto":
        return choice == "int8"
    return any(f != "Q8_0" for f in formats)


def with_q8_0_activations(
    weights: Iterable[tuple[str, torch.Tensor | QuantWeight]], choice: str = "auto"
) -> Iterator[tuple[str, torch.Tensor | QuantWeight]]:
    """``weights`` with each Q8_0 one's activations as ``int8_for_q8_0`` decides over all
    their formats: float tensors pass through as they come, the quantized ones after them
    (the loader holds those until the end anyway). ``ValueError`` for a bad ``choice``."""
    check_q8_0_activations(choice)  # now, not at the first tensor
    return _with_q8_0_activations(weights, choice)


def _with_q8_0_activations(
    weights: Iterable[tuple[str, torch.Tensor | QuantWeight]], choice: str
) -> Iterator[tuple[str, torch.Tensor | QuantWeight]]:
    held: list[tuple[str, QuantWeight]] = []
    for name, tensor in weights:
        if isinstance(tensor, QuantWeight):
            held.append((name, tensor))
        else:
            yield name, tensor
    int8 = int8_for_q8_0((w.format for _, w in held), choice)
    for name, weight in held:
        yield name, replace(weight, int8_activations=int8)


def concat_rows(parts: list[QuantWeight]) -> QuantWeight | QuantParts:
    """One weight of ``parts``' rows in order (q/k/v or gate/up as one linear): fused where
    they share a format (``fused_format``), else kept apart (``QuantParts``); ``ValueError``
    where their widths differ."""
    if len({p.shape[1] for p in parts}) != 1:
        raise ValueError("the parts of one linear must share their width")
    if fused_format([p.format for p in parts]) is None:
        return QuantParts(tuple(parts))
    return replace(parts[0], data=torch.cat([p.data for p in parts]))


def quant_linear(
    x: torch.Tensor, weight: QuantWeight | QuantParts, bias: torch.Tensor | None, ops
) -> torch.Tensor:
    """x @ weight.T (+ bias): on ``quant_gemm`` (``ops``: the kernels, where they run this
    weight), else in torch over dequantised tiles of rows; a weight in parts one part at a
    time, the outputs side by side."""
    if isinstance(weight, QuantParts):
        outs, start = [], 0
        for part in weight.parts:
            stop = start + part.shape[0]
            part_bias = None if bias is None else bias[start:stop]
            outs.append(quant_linear(x, part, part_bias, ops))
            start = stop
        return torch.cat(outs, dim=-1)
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
        # The format alone: how the activations are multiplied does not change the weights.
        return ops.quant_dequantize(weight.data, CODES[weight.format], dtype)
    return dequantize(weight, dtype)


def kernels_run(ops) -> bool:
    """``ops`` (the C++ kernels or None) run quantized weights on this CPU."""
    return ops is not None and ops.quant_gemm_isa() != "none"
