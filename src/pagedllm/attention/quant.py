"""Quantized paged K/V: block codecs, one layer's quantized K or V, a step's write plan.

A quantized cache keeps every *sealed* (full) block in its compact format and each
sequence's *open* block in the model's dtype, in a staging slot outside the pool. A query
at position p reads the blocks before its own block dequantized and its own block in full
precision, whatever the chunking::

    block        0          1          2 (p's block)
    read as  [ sealed  |  sealed  | full precision, positions <= p ]

So a token's K/V and logits do not depend on how its prompt was chunked, and a prefix-cache
hit reads exactly the sealed blocks a recomputation writes and reads. A cache may keep each
sequence's first block (logical block 0, the attention sink) unquantized: it is never
sealed, and queries past it read it from its staging slot (``QuantStep.first_slots``)::

    block        0                 1          2 (p's block)
    read as  [ full precision |  sealed  | full precision, positions <= p ]

A step (``QuantStep``, built by the worker, the same for every layer) gathers each
sequence's *touched* blocks (the blocks its new tokens fall in) into a full-precision
*window*: the open block's earlier rows come from staging, the new rows from the step's K/V.
Window blocks that are full after the step are quantized into the pool (sealed); the one
still open goes back to staging. Attention then reads sealed blocks from the pool and each
query's own block from the window.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from pagedllm.kv_dtypes import INT4_V_GROUP

if TYPE_CHECKING:
    from pagedllm.attention.base import AttentionKind, AttentionMetadata

CODEC_KINDS = ("int8", "int4_channel", "int4_token", "fp8_e4m3", "fp8_e5m2")
_FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
_INT8_MAX = 127.0
_INT4_LEVELS = 15.0


def int4_v_group(head_dim: int) -> int:
    """Channels per scale of int4 V: 32, or the whole head when it does not divide by 32."""
    return INT4_V_GROUP if head_dim % INT4_V_GROUP == 0 else head_dim


@dataclass(frozen=True, slots=True)
class BlockCodec:
    """How one side (K or V) of a sealed block is stored.

    ``int8``: symmetric, one fp16 scale per token and head. ``int4_channel`` (K) and
    ``int4_token`` (V): asymmetric 4-bit (fp16 scale and minimum) per channel over the
    block's tokens, or per token over each group of ``int4_v_group(head_dim)`` channels;
    two values a byte, the even channel in the low nibble. ``fp8_*``: the value cast to an 8-bit float (saturated), no
    scale. Data is stored as bytes (``uint8``/``int8``): torch has no copies for fp8.
    """

    kind: str

    def __post_init__(self) -> None:
        if self.kind not in CODEC_KINDS:
            raise ValueError(f"codec must be one of {CODEC_KINDS}, got {self.kind!r}")

    @classmethod
    def for_side(cls, kv_cache_dtype: str, side: str) -> BlockCodec:
        """The codec of K (``side="k"``) or V (``"v"``) for a quantized ``kv_cache_dtype``."""
        if kv_cache_dtype == "int4":
            return cls("int4_channel" if side == "k" else "int4_token")
        return cls(kv_cache_dtype)

    @property
    def code(self) -> int:
        """The format's number in the C++ kernel (``kernels/csrc/quant_attention.cpp``)."""
        return CODEC_KINDS.index(self.kind)

    @property
    def packed(self) -> bool:
        return self.kind.startswith("int4")

    @property
    def data_dtype(self) -> torch.dtype:
        return torch.int8 if self.kind == "int8" else torch.uint8

    def data_shape(self, num_blocks: int, block_shape: tuple[int, int, int]) -> tuple[int, ...]:
        block_size, num_kv_heads, head_dim = block_shape
        width = head_dim // 2 if self.packed else head_dim
        return (num_blocks, block_size, num_kv_heads, width)

    def scale_shape(
        self, num_blocks: int, block_shape: tuple[int, int, int]
    ) -> tuple[int, ...] | None:
        """Shape of the scales (and of the minimums, for int4); None for fp8."""
        block_size, num_kv_heads, head_dim = block_shape
        if self.kind == "int4_channel":
            return (num_blocks, num_kv_heads, head_dim)
        if self.kind == "int4_token":
            return (num_blocks, block_size, num_kv_heads, head_dim // int4_v_group(head_dim))
        if self.kind.startswith("fp8"):
            return None
        return (num_blocks, block_size, num_kv_heads)

    def encode(
        self, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``x`` [M, B, H, D] -> (data, scale, minimum); scale/minimum None where unused."""
        if self.kind == "int8":
            return _encode_int8(x)
        if self.kind == "int4_channel":
            return _encode_int4(x, dim=1)  # per channel: statistics over the block's tokens
        if self.kind == "int4_token":
            group = int4_v_group(x.shape[-1])
            data, scale, minimum = _encode_int4(x.unflatten(-1, (-1, group)), dim=-1)
            return data.flatten(-2), scale, minimum
        limit = torch.finfo(_FP8[self.kind]).max
        data = x.float().clamp(-limit, limit).to(_FP8[self.kind]).view(torch.uint8)
        return data, None, None

    def decode(
        self,
        data: torch.Tensor,
        scale: torch.Tensor | None,
        minimum: torch.Tensor | None,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """Inverse of ``encode`` (up to rounding), as ``dtype`` [M, B, H, D]."""
        if self.kind == "int8":
            return (data.float() * scale.float().unsqueeze(-1)).to(dtype)
        if self.packed:
            q = torch.stack((data & 0xF, data >> 4), dim=-1).flatten(-2).float()
            scale, minimum = scale.float(), minimum.float()
            if self.kind == "int4_channel":
                return (q * scale.unsqueeze(1) + minimum.unsqueeze(1)).to(dtype)
            q = q.unflatten(-1, (scale.shape[-1], -1))
            return (q * scale.unsqueeze(-1) + minimum.unsqueeze(-1)).flatten(-2).to(dtype)
        return data.view(_FP8[self.kind]).to(dtype)


def _encode_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
    x = x.float()
    scale = (x.abs().amax(dim=-1) / _INT8_MAX).clamp(max=torch.finfo(torch.float16).max)
    scale = scale.to(torch.float16)
    # Quantize with the scale as stored, so decoding undoes exactly this division.
    divisor = scale.float().unsqueeze(-1)
    q = torch.where(divisor > 0, x / divisor.clamp(min=1e-30), 0.0)
    data = q.round().clamp(-_INT8_MAX, _INT8_MAX).to(torch.int8)
    return data, scale, None


def _encode_int4(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = x.float()
    fp16_max = torch.finfo(torch.float16).max
    minimum = x.amin(dim=dim).clamp(-fp16_max, fp16_max).to(torch.float16)
    span = x.amax(dim=dim) - minimum.float()
    scale = (span / _INT4_LEVELS).clamp(max=fp16_max).to(torch.float16)
    divisor = scale.float().unsqueeze(dim)
    shifted = x - minimum.float().unsqueeze(dim)
    q = torch.where(divisor > 0, shifted / divisor.clamp(min=1e-30), 0.0)
    q = q.round().clamp(0, _INT4_LEVELS).to(torch.uint8)
    data = q[..., 0::2] | (q[..., 1::2] << 4)
    return data, scale, minimum


@dataclass(slots=True)
class QuantizedCache:
    """One layer's K or V in a quantized paged cache: sealed blocks (``data`` with their
    ``scale``/``minimum`` under the same block id) and the staging slots of open blocks
    (``stage``, in the model's dtype; the worker grows it by replacing the tensor)."""

    codec: BlockCodec
    data: torch.Tensor  # [num_blocks, B, H, D] (D/2 bytes when packed)
    scale: torch.Tensor | None
    minimum: torch.Tensor | None
    stage: torch.Tensor  # [num_slots, B, H, D], the model's dtype

    @property
    def dtype(self) -> torch.dtype:
        """The full-precision dtype (the model's): staging, windows, dequantized reads."""
        return self.stage.dtype

    @property
    def block_shape(self) -> tuple[int, int, int]:
        return tuple(self.stage.shape[1:])  # type: ignore[return-value]

    def read(self, block_ids: torch.Tensor) -> torch.Tensor:
        """Sealed blocks ``block_ids`` dequantized: [M, B, H, D] in ``dtype``."""
        ids = block_ids.long()
        return self.codec.decode(
            self.data.index_select(0, ids),
            None if self.scale is None else self.scale.index_select(0, ids),
            None if self.minimum is None else self.minimum.index_select(0, ids),
            self.dtype,
        )

    def seal(self, block_ids: torch.Tensor, blocks: torch.Tensor) -> None:
        """Quantize full-precision ``blocks`` [M, B, H, D] into the pool at ``block_ids``."""
        data, scale, minimum = self.codec.encode(blocks)
        self.data.index_copy_(0, block_ids, data)
        if self.scale is not None:
            self.scale.index_copy_(0, block_ids, scale)
        if self.minimum is not None:
            self.minimum.index_copy_(0, block_ids, minimum)

    def parts(self) -> tuple[torch.Tensor, ...]:
        """The per-block tensors a block move copies (data, scale, minimum)."""
        return tuple(t for t in (self.data, self.scale, self.minimum) if t is not None)

    def write_args(self) -> tuple:
        """This side's arguments to the C++ ``quant_write``, in its order."""
        return (self.data, self.scale, self.minimum, self.stage, self.codec.code)


@dataclass(frozen=True, slots=True)
class QuantStep:
    """How one step writes a quantized cache; shared by every layer (see the module doc).

    Window block ``w`` of sequence i is its touched block ``first_block[i] + w -
    window_start[i]``, where ``first_block[i] = (seq_len - query_len) // block_size``.
    """

    num_window_blocks: int
    load_window: torch.Tensor  # [n] int64: window blocks whose earlier rows are staged
    load_slots: torch.Tensor  # [n] int64: their staging slots
    row_slots: torch.Tensor  # [T] int64: window row (w * B + offset) of each token row
    seal_window: torch.Tensor  # [m] int64: window blocks full after this step
    seal_blocks: torch.Tensor  # [m] int64: their pool block ids
    keep_window: torch.Tensor  # [k] int64: the window blocks still open after the step
    keep_slots: torch.Tensor  # [k] int64: their staging slots
    window_start: torch.Tensor  # [num_seqs] int32
    window_start_list: list[int]
    # [num_seqs] int32: the staging slot of each sequence's block 0 when the cache keeps
    # first blocks unquantized; empty when block 0 is sealed like the others.
    first_slots: torch.Tensor
    first_slots_list: list[int]

    def write_args(self) -> tuple:
        """The plan's arguments to the C++ ``quant_write`` (after both sides'), in its order."""
        return (
            self.num_window_blocks,
            self.load_window,
            self.load_slots,
            self.row_slots,
            self.seal_window,
            self.seal_blocks,
            self.keep_window,
            self.keep_slots,
        )


def write_step(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: QuantizedCache,
    v_cache: QuantizedCache,
    step: QuantStep,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write the step's K/V: build the windows, seal the full blocks, stage the open ones.
    Returns the K and V windows [W, B, H, D] that attention reads own blocks from. The
    reference of the C++ ``quant_write`` (``kernels/csrc/quant_write.cpp``), which gives
    the same bits in one call."""
    return _write_side(key, k_cache, step), _write_side(value, v_cache, step)


def _write_side(rows: torch.Tensor, cache: QuantizedCache, step: QuantStep) -> torch.Tensor:
    block_size, num_kv_heads, head_dim = cache.block_shape
    # Zeros, not garbage: rows of a window block past the last written are never attended,
    # but a NaN there would survive a zero attention weight.
    window = torch.zeros(
        (step.num_window_blocks, block_size, num_kv_heads, head_dim),
        dtype=cache.dtype,
        device=rows.device,
    )
    if step.load_window.numel():
        window.index_copy_(0, step.load_window, cache.stage.index_select(0, step.load_slots))
    window.view(-1, num_kv_heads, head_dim).index_copy_(0, step.row_slots, rows.to(cache.dtype))
    if step.seal_window.numel():
        cache.seal(step.seal_blocks, window.index_select(0, step.seal_window))
    if step.keep_window.numel():
        cache.stage.index_copy_(0, step.keep_slots, window.index_select(0, step.keep_window))
    return window


def check_full_attention(kind: AttentionKind | None) -> None:
    """A quantized cache serves full-attention layers only (no window, no soft-capping)."""
    if kind is not None and not kind.is_full:
        raise NotImplementedError(f"a quantized KV cache takes full attention only, not {kind}")


def forward_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: QuantizedCache,
    v_cache: QuantizedCache,
    meta: AttentionMetadata,
    scale: float,
    kind: AttentionKind | None = None,
) -> torch.Tensor:
    """``AttentionBackend.forward`` over a quantized cache, plainly: ``write_step``, then
    ``attend_reference`` (the ground truth)."""
    check_full_attention(kind)
    step = meta.quant
    k_window, v_window = write_step(key, value, k_cache, v_cache, step)
    return attend_reference(
        query,
        k_cache,
        v_cache,
        k_window,
        v_window,
        meta.block_tables,
        meta.query_lens_list,
        meta.seq_lens_list,
        step.window_start_list,
        scale,
        step.first_slots_list,
    )


def attend_reference(
    query: torch.Tensor,
    k_cache: QuantizedCache,
    v_cache: QuantizedCache,
    k_window: torch.Tensor,
    v_window: torch.Tensor,
    block_tables: torch.Tensor,
    query_lens: list[int],
    seq_lens: list[int],
    window_start: list[int],
    scale: float,
    first_slots: list[int] = (),
) -> torch.Tensor:
    """Plain dequantize-then-attend, one query block at a time: the ground truth.

    Query rows in block b of their sequence attend to blocks 0..b-1 read from the pool
    (dequantized) and to block b's rows up to their own position read from the window.
    With ``first_slots`` (one a sequence), block 0 is read from that staging slot instead.
    """
    block_size = k_window.shape[1]
    num_heads, num_kv_heads = query.shape[1], k_window.shape[2]
    out = torch.empty_like(query)
    row = 0
    for i, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        first = seq_len - query_len
        first_block, last_block = first // block_size, (seq_len - 1) // block_size
        table = block_tables[i, :last_block]
        k_sealed, v_sealed = k_cache.read(table), v_cache.read(table)
        if first_slots and last_block > 0:
            k_sealed[0], v_sealed[0] = k_cache.stage[first_slots[i]], v_cache.stage[first_slots[i]]
        k_sealed, v_sealed = k_sealed.flatten(0, 1), v_sealed.flatten(0, 1)
        for b in range(first_block, last_block + 1):
            lo, hi = max(first, b * block_size), min(seq_len, (b + 1) * block_size)
            w = window_start[i] + b - first_block
            own = hi - b * block_size
            k = torch.cat((k_sealed[: b * block_size], k_window[w, :own]))
            v = torch.cat((v_sealed[: b * block_size], v_window[w, :own]))
            q_pos = torch.arange(lo, hi)
            mask = torch.arange(b * block_size + own)[None, :] <= q_pos[:, None]
            q = query[row + lo - first : row + hi - first].transpose(0, 1)
            k, v = k.transpose(0, 1), v.transpose(0, 1)
            if num_heads != num_kv_heads:
                k = k.repeat_interleave(num_heads // num_kv_heads, dim=0)
                v = v.repeat_interleave(num_heads // num_kv_heads, dim=0)
            o = F.scaled_dot_product_attention(q.to(k.dtype), k, v, attn_mask=mask, scale=scale)
            out[row + lo - first : row + hi - first] = o.transpose(0, 1).to(query.dtype)
        row += query_len
    return out
