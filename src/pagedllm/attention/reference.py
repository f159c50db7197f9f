"""Reference backend: gather each sequence's context through its block table, then SDPA.

Slow and plain on purpose: it is the ground truth every faster backend is tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.attention.base import AttentionMetadata, KernelStep, write_kv


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """K or V of positions 0..seq_len-1 of one sequence: [seq_len, num_kv_heads, head_dim];
    one copy (``index_select`` is several times faster than advanced indexing here)."""
    num_blocks = -(-seq_len // cache.shape[1])
    blocks = torch.index_select(cache, 0, block_table[:num_blocks].long())
    return blocks.view(-1, cache.shape[2], cache.shape[3])[:seq_len]


def causal_mask(query_len: int, seq_len: int, device: torch.device) -> torch.Tensor:
    """[query_len, seq_len] bool: query row j (position seq_len-query_len+j) sees keys <= it."""
    query_pos = torch.arange(seq_len - query_len, seq_len, device=device)
    key_pos = torch.arange(seq_len, device=device)
    return key_pos[None, :] <= query_pos[:, None]


class ReferenceAttention:
    name = "reference"

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        write_kv(key, value, k_cache, v_cache, meta.slot_mapping)
        num_heads, num_kv_heads = query.shape[1], k_cache.shape[2]
        out = torch.empty_like(query)
        start = 0
        for i, (query_len, seq_len) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list)):
            q = query[start : start + query_len].transpose(0, 1)  # [H, q, D]
            k = gather_context(k_cache, meta.block_tables[i], seq_len).transpose(0, 1)
            v = gather_context(v_cache, meta.block_tables[i], seq_len).transpose(0, 1)
            if num_heads != num_kv_heads:
                k = k.repeat_interleave(num_heads // num_kv_heads, dim=0)
                v = v.repeat_interleave(num_heads // num_kv_heads, dim=0)
            mask = causal_mask(query_len, seq_len, query.device)
            o = F.scaled_dot_product_attention(q.to(k.dtype), k, v, attn_mask=mask, scale=scale)
            out[start : start + query_len] = o.transpose(0, 1).to(query.dtype)
            start += query_len
        return out

    def kernel_step(
        self,
        dtype: torch.dtype,
        num_heads: int,
        head_dim: int,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> KernelStep | None:
        """None: the reference has no C++ kernel; every step goes through ``forward``."""
        return None
