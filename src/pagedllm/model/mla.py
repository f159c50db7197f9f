"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2) over the paged cache, and YaRN.

What a token leaves in the cache, per layer, is its compressed latent ``c`` (the normed
``kv_lora_rank`` part of ``kv_a_proj_with_mqa``) and its rope key ``k_pe``
(``qk_rope_head_dim``, after rotary): ``kv_lora_rank + qk_rope_head_dim`` values, one
"head" — not 2 x heads x head_dim. Attention runs in the latent space with the absorbed
projections (as the DeepSeek-V2 paper describes): ``kv_b_proj`` splits per head into
``W_uk`` [nope, r] and ``W_uv`` [v, r];

    score(h, t, s) = (q_nope[h] W_uk[h]) . c[s] + q_pe[h] . k_pe[s]
    out[h]         = W_uv[h] (sum_s p(h, t, s) c[s])

so the query is ``[q_nope W_uk, q_pe]`` ([H, r + rope]) against keys that are the cache
rows themselves, and the values are the rows' first ``r`` values. That is multi-query
attention over the latent cache: any ``AttentionBackend`` runs it, given the latent tensor
as both K and V cache (the value rows' rope tail is computed and dropped: rope / (r + rope)
of the value work). ``ReferenceAttention`` is the ground truth; ``CpuAttention`` runs it in
its C++ kernel. The same path serves prefill and decode (no per-head K/V is expanded).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pagedllm.attention.base import AttentionBackend, AttentionMetadata
from pagedllm.model.config import ModelConfig, RopeConfig
from pagedllm.model.llama import Linear, RMSNorm, rope_inv_freq, rotate_half

# transformers' DeepSeek builds the q/kv low-rank norms with their default epsilon.
LORA_NORM_EPS = 1e-6


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim // 2], cos/sin scale): YaRN's blend of interpolated and
    extrapolated frequencies and its attention factor, else ``rope_inv_freq`` and 1."""
    if rope.rope_type != "yarn":
        return rope_inv_freq(rope, dim), 1.0
    factor = rope.factor
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    pos_freqs = rope.theta**exponents
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    original = rope.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(
        0, 1
    )
    keep = 1 - ramp  # the extrapolated share
    inv_freq = interpolated * (1 - keep) + extrapolated * keep
    if rope.attention_factor is not None:
        scale = rope.attention_factor
    elif rope.mscale and rope.mscale_all_dim:
        scale = yarn_mscale(factor, rope.mscale) / yarn_mscale(factor, rope.mscale_all_dim)
    else:
        scale = yarn_mscale(factor)
    return inv_freq, float(scale)


def softmax_scale(config: ModelConfig) -> float:
    """qk_head_dim ** -0.5, times YaRN's mscale(factor, mscale_all_dim) squared."""
    mla, rope = config.mla, config.rope
    assert mla is not None
    scale = mla.qk_head_dim**-0.5
    if rope.rope_type == "yarn" and rope.mscale_all_dim:
        scale *= yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
    return scale


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Rotary on x [T, heads, d] (cos, sin [T, 1, d]). ``interleave``: DeepSeek's pairs
    (x0, x1), (x2, x3), ... each turned by one frequency, the result laid out as all first
    then all second members — the same dot products as the pairs' own layout, since q and
    k are laid out alike."""
    if not interleave:
        return x * cos + rotate_half(x) * sin
    half = x.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1)


class LatentAttention(nn.Module):
    """DeepSeek's attention with the latent cache (see the module docstring)."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        mla = config.mla
        assert mla is not None
        self.mla = mla
        self.num_heads = heads = config.num_attention_heads
        self.backend = backend
        self.scale = softmax_scale(config)
        hidden, bias = config.hidden_size, config.qkv_bias
        q_width = heads * mla.qk_head_dim
        if mla.q_lora_rank is None:
            self.q_proj: Linear | None = Linear(hidden, q_width, bias=False)
        else:
            self.q_proj = None
            self.q_a_proj = Linear(hidden, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = Linear(mla.q_lora_rank, q_width, bias=False)
        self.kv_a_proj_with_mqa = Linear(hidden, mla.latent_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LORA_NORM_EPS)
        # Plain nn.Linear, never packed: its weight is read row-major, split per head into
        # the absorbed query and value products (einsums), and never called as a linear.
        self.kv_b_proj = nn.Linear(
            mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False
        )
        self.o_proj = Linear(heads * mla.v_head_dim, hidden, bias=bias)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """cos, sin: [T, 1, qk_rope_head_dim]; ``kv_cache``: the layer's latent tensor
        [num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim] (as K and as V)."""
        mla, heads, num_tokens = self.mla, self.num_heads, hidden.shape[0]
        rank, nope = mla.kv_lora_rank, mla.qk_nope_head_dim
        q = self._query(hidden).view(num_tokens, heads, mla.qk_head_dim)
        q_nope, q_pe = q.split([nope, mla.qk_rope_head_dim], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(hidden).split([rank, mla.qk_rope_head_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)
        q_pe = rotate(q_pe, cos, sin, mla.rope_interleave)
        k_pe = rotate(k_pe[:, None, :], cos, sin, mla.rope_interleave)
        w_kv = self.kv_b_proj.weight.view(heads, nope + mla.v_head_dim, rank)
        w_uk, w_uv = w_kv[:, :nope], w_kv[:, nope:]
        query = torch.cat((torch.einsum("thn,hnr->thr", q_nope, w_uk), q_pe), dim=-1)
        latent = torch.cat((c_kv[:, None, :], k_pe), dim=-1)
        cache = kv_cache[0]
        out = self.backend.forward(query, latent, latent, cache, cache, meta, self.scale)
        values = torch.einsum("thr,hvr->thv", out[..., :rank], w_uv)
        return self.o_proj(values.reshape(num_tokens, heads * mla.v_head_dim))

    def _query(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.q_proj is not None:
            return self.q_proj(hidden)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
