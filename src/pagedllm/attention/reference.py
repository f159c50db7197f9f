"""Reference backend: gather each sequence's context through its block table, then SDPA.

Slow and plain on purpose: it is the ground truth every faster backend is tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.attention.base import (
    FULL_ATTENTION,
    AttentionKind,
    AttentionMetadata,
    KernelStep,
    QuantKernelStep,
    write_kv,
)
from pagedllm.attention.quant import QuantizedCache, forward_reference


def gather_context(
    cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, first_block: int = 0
) -> torch.Tensor:
    """K or V of positions ``first_block * block_size .. seq_len-1`` of one sequence:
    [tokens, num_kv_heads, head_dim]; one copy (``index_select`` is several times faster
    than advanced indexing here)."""
    num_blocks = -(-seq_len // cache.shape[1])
    blocks = torch.index_select(cache, 0, block_table[first_block:num_blocks].long())
    return blocks.view(-1, cache.shape[2], cache.shape[3])[: seq_len - first_block * cache.shape[1]]


def causal_mask(
    query_len: int,
    seq_len: int,
    device: torch.device,
    window: int | None = None,
    first_key: int = 0,
) -> torch.Tensor:
    """[query_len, seq_len - first_key] bool: query row j (position seq_len-query_len+j)
    sees keys at positions ``first_key..`` up to it, and within ``window`` of it if given."""
    query_pos = torch.arange(seq_len - query_len, seq_len, device=device)
    key_pos = torch.arange(first_key, seq_len, device=device)
    mask = key_pos[None, :] <= query_pos[:, None]
    if window is not None:
        mask &= key_pos[None, :] > query_pos[:, None] - window
    return mask


def first_visible_block(query_len: int, seq_len: int, block_size: int, window: int | None) -> int:
    """The first block any of the queries reads: 0 without a window."""
    if window is None:
        return 0
    return max(0, seq_len - query_len - window + 1) // block_size


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """q [H, q, D], k/v [H, k, D] (heads already repeated), mask [q, k] -> [H, q, D].
    SDPA, or with ``softcap`` the plain product, cap, mask and float32 softmax."""
    if softcap is None:
        return F.scaled_dot_product_attention(q.to(k.dtype), k, v, attn_mask=mask, scale=scale)
    scores = torch.matmul(q.to(k.dtype), k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
    return torch.matmul(probs, v)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kind: AttentionKind = FULL_ATTENTION,
) -> torch.Tensor:
    """Attention of every sequence through its block table (K/V already written)."""
    num_heads, num_kv_heads = query.shape[1], k_cache.shape[2]
    block_size = k_cache.shape[1]
    window = kind.sliding_window
    out = torch.empty_like(query)
    start = 0
    for i, (query_len, seq_len) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list)):
        first = first_visible_block(query_len, seq_len, block_size, window)
        q = query[start : start + query_len].transpose(0, 1)  # [H, q, D]
        k = gather_context(k_cache, meta.block_tables[i], seq_len, first).transpose(0, 1)
        v = gather_context(v_cache, meta.block_tables[i], seq_len, first).transpose(0, 1)
        if num_heads != num_kv_heads:
            k = k.repeat_interleave(num_heads // num_kv_heads, dim=0)
            v = v.repeat_interleave(num_heads // num_kv_heads, dim=0)
        mask = causal_mask(query_len, seq_len, query.device, window, first * block_size)
        o = attend(q, k, v, mask, scale, kind.softcap)
        out[start : start + query_len] = o.transpose(0, 1).to(query.dtype)
        start += query_len
    return out


class ReferenceAttention:
    name = "reference"

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor | QuantizedCache,
        v_cache: torch.Tensor | QuantizedCache,
        meta: AttentionMetadata,
        scale: float,
        kind: AttentionKind = FULL_ATTENTION,
    ) -> torch.Tensor:
        if meta.quant is not None:
            # Quantized: dequantize the sealed blocks, then attend (the ground truth).
            return forward_reference(query, key, value, k_cache, v_cache, meta, scale, kind)
        write_kv(key, value, k_cache, v_cache, meta.slot_mapping)
        return paged_attention(query, k_cache, v_cache, meta, scale, kind)

    def route(self, dtype: torch.dtype) -> str:
        return "reference (gather through the block tables + SDPA, one sequence at a time)"

    def quant_route(self, dtype: torch.dtype, quantization: str) -> str:
        return f"reference ({quantization} blocks dequantized, then SDPA, one sequence at a time)"

    def kind_route(self, dtype: torch.dtype, kind: AttentionKind) -> str:
        if kind.is_full:
            return self.route(dtype)
        return "reference (masked SDPA over the visible blocks only)"

    def kernel_step(
        self,
        dtype: torch.dtype,
        num_heads: int,
        head_dim: int,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        kind: AttentionKind = FULL_ATTENTION,
    ) -> KernelStep | None:
        """None: the reference has no C++ kernel; every step goes through ``forward``."""
        return None

    def quant_kernel_step(
        self,
        dtype: torch.dtype,
        head_dim: int,
        k_cache: QuantizedCache,
        v_cache: QuantizedCache,
        meta: AttentionMetadata,
        kind: AttentionKind = FULL_ATTENTION,
    ) -> QuantKernelStep | None:
        """None, as ``kernel_step``."""
        return None
