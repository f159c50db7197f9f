"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a paged KV cache.

The model sees only flattened tensors and ``AttentionMetadata``: a step's tokens of
all sequences are one ``[num_tokens]`` batch; the attention backend is the only
part that knows about sequences, slots and block tables.

q/k/v are fused into one linear (``qkv_proj``) and gate/up into another
(``gate_up_proj``) at load time: fewer, larger matmuls.

``optimize_for_cpu()`` (the runner calls it) switches on the CPU fast paths, which give
the plain code's results: linear weights pre-packed in the layout of pagedllm's small-batch
kernel (``small_gemm``, for up to 256 rows: the decode steps, which stream every weight from
memory; bf16 on the tile unit, 1.3-2x faster than oneDNN there, outputs equal but for rare
one-ulp differences in the order of the sums; float32 with AVX-512, up to 2.4x faster than
MKL at 8 rows, within fp32 rounding), else bf16 weights in oneDNN's blocked layout
(identical outputs, ~1.5x faster at decode batch sizes), and fused C++ layer ops from
``kernels/csrc`` (residual add + RMSNorm, rotary embedding in place, SiLU-and-multiply),
which round where the torch expressions round. Steps whose linears and attention all run
on those kernels go through one C++ call for every layer (``decoder_layers``), the same ops
in the same order without Python between them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.base import AttentionBackend, AttentionMetadata
from pagedllm.model.config import ModelConfig, RopeConfig

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


# Up to this many rows (the default max_num_seqs: every decode batch), linears run on
# pagedllm's small-batch kernel (``small_gemm``: AMX for bf16, AVX-512 for float32), which
# streams decode-step weights faster than oneDNN and MKL (all 33 bf16 linears of the
# benchmark model, 2 threads, before its 2 x 2 tile blocks: 5.2 vs 6.4 ms oneDNN-packed vs
# 9.8 ms plain at 64 rows, 30.9 vs 39.1 vs 43.3 ms at 256; the blocks took 256 rows from
# 20.9 to 14.4 ms); more rows go to torch (MKL's sgemm for float32).
SMALL_GEMM_MAX_ROWS = 256
# bf16 goes on with the tile kernel up to this many rows (prompt chunks of a few hundred
# tokens): against F.linear on all the linears of model (a) / (b), 2 threads, median of 7,
# alternated: 384 rows 12.5 vs 18.4 / 51 vs 69 ms, 512 rows 15.5 vs 24.2 / 71 vs 95 ms,
# 768 rows 45 vs 45 / 99 vs 155 ms, 1024 rows 34 vs 40 / 199 vs 204 ms; from 1536 rows on
# oneDNN is 5-28% faster.
SMALL_GEMM_MAX_ROWS_BF16 = 1024


def small_gemm_max_rows(small: torch.Tensor) -> int:
    """The most rows ``small_gemm`` takes for a weight packed as ``small``."""
    return SMALL_GEMM_MAX_ROWS_BF16 if small.dtype == torch.bfloat16 else SMALL_GEMM_MAX_ROWS


def pack_small_weight(weight: torch.Tensor, ops: Any) -> torch.Tensor | None:
    """The weight laid out for ``ops.small_gemm`` (``kernels/csrc/small_gemm.cpp``), or
    None where that kernel does not apply: bf16 needs the tile unit and rows in 16s,
    columns in 32s; float32 needs AVX-512 and rows in 16s."""
    bf16 = weight.dtype == torch.bfloat16
    if (
        ops is None
        or weight.device.type != "cpu"
        or weight.dtype not in (torch.bfloat16, torch.float32)
        or weight.dim() != 2
        or weight.shape[0] % 16
        or (bf16 and weight.shape[1] % 32)
        or not ops.small_gemm_available(bf16)
    ):
        return None
    return ops.pack_small_gemm(weight.detach())


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


class Linear(nn.Linear):
    """``nn.Linear`` that uses a pre-packed weight once ``pack()`` has made one: the
    small-batch kernel's layout (up to ``small_gemm_max_rows`` rows; more rows use the
    plain weight) where the CPU has the tile unit, else oneDNN's."""

    packed: torch.Tensor | None = None
    small: torch.Tensor | None = None
    ops: Any = None

    def pack(self, ops: Any = None) -> None:
        self.packed, self.small = pack_for_cpu(self.weight, ops)
        self.ops = ops if self.small is not None else None

    @property
    def tensors(self) -> LinearTensors:
        return LinearTensors(self.weight, self.bias, self.packed, self.small)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed, self.small, self.ops)


class LinearTensors(NamedTuple):
    """A linear's weight and bias with its pre-packed copies: ``linear``'s arguments."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    packed: torch.Tensor | None
    small: torch.Tensor | None


def pack_for_cpu(weight: torch.Tensor, ops: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(oneDNN copy, small-batch copy) of a linear weight, one of them at most: with the
    small-batch layout, larger batches use the plain weight (F.linear reorders it per call,
    measured within 5% of the packed copy at prefill sizes, where the reorder is small next
    to the work)."""
    small = pack_small_weight(weight, ops)
    return (pack_weight(weight) if small is None else None), small


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    packed: torch.Tensor | None,
    small: torch.Tensor | None,
    ops: Any,
) -> torch.Tensor:
    """x @ weight.T (+ bias) on the fastest form of the weight for x's row count."""
    if small is not None and x.dim() == 2 and x.shape[0] <= small_gemm_max_rows(small):
        return ops.small_gemm(x, small, bias)
    if packed is not None:
        return packed_linear(x, packed, bias)
    return F.linear(x, weight, bias)


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, cast back before the weight (as transformers does)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] for the "default" and "llama3" rope types."""
    # Explicit CPU device: the model may be built under a meta-device context.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "default":
        return inv_freq
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rotary(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, head_dim] of ``positions`` [T], computed in float32 then cast (as
    transformers does)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class RotaryTable:
    """``rotary`` of every position below the largest one seen so far, kept in one dtype:
    a step's cos and sin are then two row gathers instead of seven small ops (0.13-0.17 ms
    of a 64-sequence decode step, measured). Rows are computed by ``rotary`` itself, all at
    once when the table grows (to the next power of two), so a row can differ from a per-step
    ``rotary`` only where torch's vector and scalar cos/sin differ (a float32 ulp)."""

    def __init__(self, inv_freq: torch.Tensor) -> None:
        self.inv_freq = inv_freq
        self.table: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin

    def lookup(
        self, positions: torch.Tensor, dtype: torch.dtype, num_positions: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, head_dim] of ``positions``, all of which are below
        ``num_positions``."""
        table = self.table
        if (
            table is None
            or table[0].shape[0] < num_positions
            or table[0].dtype != dtype
            or table[0].device != positions.device
        ):
            size = 1 << max(10, (num_positions - 1).bit_length())
            inv_freq = self.inv_freq.to(positions.device)
            every = torch.arange(size, dtype=torch.int64, device=positions.device)
            table = self.table = rotary(every, inv_freq, dtype)
        cos, sin = table
        return cos.index_select(0, positions), sin.index_select(0, positions)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.backend = backend
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

    @property
    def heads(self) -> Heads:
        return Heads(
            (self.num_heads, self.num_kv_heads, self.num_kv_heads),
            self.head_dim,
            None if self.q_norm is None or self.k_norm is None else (self.q_norm, self.k_norm),
        )

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """cos, sin: [T, 1, head_dim]."""
        num_tokens = hidden.shape[0]
        q, k, v = split_heads(self.qkv_proj(hidden), self.heads)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        out = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class Heads(NamedTuple):
    """How a layer's fused q/k/v projection splits into heads."""

    counts: tuple[int, int, int]  # q, k, v heads
    head_dim: int
    qk_norm: tuple[RMSNorm, RMSNorm] | None  # q and k RMSNorms (Qwen3), or None


def split_heads(qkv: torch.Tensor, heads: Heads) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[T, q + 2 kv] -> q [T, H, D], k, v [T, KV, D], q and k RMS-normalized where configured.
    One view and one split (Tensor.split's Python wrapper alone took ~10 us)."""
    rows = qkv.view(qkv.shape[0], sum(heads.counts), heads.head_dim)
    q, k, v = rows.split_with_sizes(heads.counts, dim=1)
    if heads.qk_norm is not None:
        q, k = heads.qk_norm[0](q), heads.qk_norm[1](k)
    return q, k, v


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(
            config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias
        )
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, kv_cache, meta)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))

    def fused(self) -> FusedLayer:
        """This layer's tensors and sizes for ``fused_layer`` (after ``Linear.pack``)."""
        attn, mlp = self.self_attn, self.mlp
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        return FusedLayer(
            norm1.weight,
            norm1.eps,
            norm2.weight,
            norm2.eps,
            attn.qkv_proj.tensors,
            attn.o_proj.tensors,
            mlp.gate_up_proj.tensors,
            mlp.down_proj.tensors,
            attn.heads,
            attn.scale,
            attn.backend,
        )


class FusedLayer(NamedTuple):
    """A decoder layer flattened for ``fused_layer``: plain tensors and sizes, so that a
    decode step makes no nn.Module calls or attribute lookups (on a 30-layer model those
    cost about 0.1 ms a layer, several percent of a small batch's step)."""

    norm1: torch.Tensor
    norm1_eps: float
    norm2: torch.Tensor
    norm2_eps: float
    qkv: LinearTensors
    o: LinearTensors
    gate_up: LinearTensors
    down: LinearTensors
    heads: Heads
    scale: float
    backend: AttentionBackend


def fused_layer(
    ops: Any,
    layer: FusedLayer,
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    meta: AttentionMetadata,
    rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``DecoderLayer.forward`` with the fused C++ ops (cos, sin: [T, head_dim]; the rotary
    embedding applied in place by one op). The residual stream is carried separately and
    the previous layer's last add happens inside this layer's first norm::

        residual += hidden; x = norm(residual)   (one op, same roundings)

    Returns (this layer's MLP output, residual) for the next layer to add. ``rows``: only
    these rows go on after attention (the last layer, where only the rows that sample are
    read; every row's K/V is still written)."""
    if residual is None:
        residual = hidden
        x = ops.rms_norm(hidden, layer.norm1, layer.norm1_eps)
    else:
        x = ops.add_rms_norm(hidden, residual, layer.norm1, layer.norm1_eps)
    q, k, v = split_heads(linear(x, *layer.qkv, ops), layer.heads)
    ops.rope_(q, k, cos, sin)
    out = layer.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, layer.scale)
    if rows is not None:
        out, residual = out.index_select(0, rows), residual.index_select(0, rows)
    q_width = layer.heads.counts[0] * layer.heads.head_dim
    attn = linear(out.view(out.shape[0], q_width), *layer.o, ops)
    x = ops.add_rms_norm(attn, residual, layer.norm2, layer.norm2_eps)
    return linear(ops.silu_mul(linear(x, *layer.gate_up, ops)), *layer.down, ops), residual


class DecoderPlan(NamedTuple):
    """Every layer's tensors as ``decoder_layers`` (``kernels/csrc/decoder_layers.cpp``)
    takes them: one C++ call runs ``fused_layer`` for all layers, without Python between
    the ops (1-2 ms of a 5-20 ms decode step on the benchmark model)."""

    norm1: list[torch.Tensor]
    qkv: list[torch.Tensor]
    qkv_bias: list[torch.Tensor | None]
    o: list[torch.Tensor]
    o_bias: list[torch.Tensor | None]
    norm2: list[torch.Tensor]
    gate_up: list[torch.Tensor]
    gate_up_bias: list[torch.Tensor | None]
    down: list[torch.Tensor]
    down_bias: list[torch.Tensor | None]
    final_norm: torch.Tensor
    eps: float
    heads: Heads
    scale: float
    backend: Any  # the attention backend of every layer (a CpuAttention: has kernel_step)
    max_rows: int


def decoder_plan(layers: list[FusedLayer], final_norm: RMSNorm) -> DecoderPlan | None:
    """The plan for ``decoder_layers``, or None where it cannot stand in for the loop of
    ``fused_layer``: every linear needs its small-batch copy (``small_gemm``), one norm
    epsilon and one attention backend with ``kernel_step``, and no q/k norms."""
    if not layers:
        return None
    first = layers[0]
    linears = [t for layer in layers for t in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    if (
        any(t.small is None for t in linears)
        or len({t.small.dtype for t in linears}) != 1
        or any(layer.heads != first.heads or layer.scale != first.scale for layer in layers)
        or first.heads.qk_norm is not None
        or any(layer.backend is not first.backend for layer in layers)
        or not hasattr(first.backend, "kernel_step")
        or {final_norm.eps} != {e for layer in layers for e in (layer.norm1_eps, layer.norm2_eps)}
    ):
        return None
    return DecoderPlan(
        norm1=[layer.norm1 for layer in layers],
        qkv=[layer.qkv.small for layer in layers],
        qkv_bias=[layer.qkv.bias for layer in layers],
        o=[layer.o.small for layer in layers],
        o_bias=[layer.o.bias for layer in layers],
        norm2=[layer.norm2 for layer in layers],
        gate_up=[layer.gate_up.small for layer in layers],
        gate_up_bias=[layer.gate_up.bias for layer in layers],
        down=[layer.down.small for layer in layers],
        down_bias=[layer.down.bias for layer in layers],
        final_norm=final_norm.weight,
        eps=final_norm.eps,
        heads=first.heads,
        scale=first.scale,
        backend=first.backend,
        max_rows=small_gemm_max_rows(first.qkv.small),
    )


def decoder_layers(
    ops: Any,
    plan: DecoderPlan,
    step: Any,
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_caches: KVCaches,
    meta: AttentionMetadata,
    output_rows: torch.Tensor | None,
) -> torch.Tensor:
    """The loop of ``fused_layer`` plus the final norm in one C++ call, for a step the
    attention backend's kernel takes whole (``step``: its ``kernel_step``)."""
    route = step.route
    num_heads, num_kv_heads, _ = plan.heads.counts
    return ops.decoder_layers(
        hidden,
        cos,
        sin,
        plan.norm1,
        plan.qkv,
        plan.qkv_bias,
        plan.o,
        plan.o_bias,
        plan.norm2,
        plan.gate_up,
        plan.gate_up_bias,
        plan.down,
        plan.down_bias,
        plan.final_norm,
        plan.eps,
        [k for k, _ in kv_caches],
        [v for _, v in kv_caches],
        meta.slot_mapping,
        route.block_tables,
        route.seq_lens,
        route.query_start_loc,
        route.kernel,
        num_heads,
        num_kv_heads,
        plan.heads.head_dim,
        plan.scale,
        step.rows_per_task,
        step.fast_bf16,
        step.use_amx,
        output_rows,
    )


class LlamaForCausalLM(nn.Module):
    """Decoder + LM head. ``forward`` -> final hidden states; ``compute_logits`` -> logits."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.backend = backend
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, backend) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        # A plain attribute, not a buffer: .to(dtype) and to_empty() must not touch it
        # (rotary frequencies stay float32, as in transformers).
        self.inv_freq = rope_inv_freq(config.rope, config.head_dim)
        # The fused CPU path's cos/sin (the plain path computes them each step).
        self.rotary_table = RotaryTable(self.inv_freq)
        # Set by optimize_for_cpu(): the fused ops namespace and a packed tied LM head.
        self.fused_ops: Any = None
        self.fused_layers: list[FusedLayer] = []
        # Set by optimize_for_cpu() where one C++ call can run all the fused layers; None
        # keeps the per-layer loop (tests set it to None to compare the two).
        self.decoder_plan: DecoderPlan | None = None
        self.packed_head: torch.Tensor | None = None
        self.small_head: torch.Tensor | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: KVCaches,
        meta: AttentionMetadata,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions [T] -> final-normed hidden states [T, hidden_size], or only
        the rows ``output_rows`` (int64 [S], in that order) when given. The fused CPU path
        then skips, in the last layer, everything after attention for the other rows (as
        llama.cpp does): a prompt's rows but its last are only needed for their K/V."""
        hidden = self.embed_tokens(input_ids)
        if self.fused_ops is not None and hidden.device.type == "cpu":
            cos, sin = self.rotary_table.lookup(positions, hidden.dtype, meta.max_seq_len)
            return self._forward_fused(hidden, cos, sin, kv_caches, meta, output_rows)
        cos, sin = self._rotary(positions, hidden.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(hidden, cos, sin, kv_cache, meta)
        hidden = self.norm(hidden)
        return hidden if output_rows is None else hidden[output_rows]

    def optimize_for_cpu(self) -> None:
        """Switch on the CPU fast paths (see the module docstring); a no-op elsewhere.
        Call after the weights are loaded: packed weights are copies."""
        if self.embed_tokens.weight.device.type != "cpu":
            return
        from pagedllm.kernels.ops import layer_ops

        ops = layer_ops()
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack(ops)
        if self.lm_head is None:
            self.packed_head, self.small_head = pack_for_cpu(self.embed_tokens.weight, ops)
        if self.embed_tokens.weight.dtype in (torch.float32, torch.bfloat16):
            self.fused_ops = ops
            self.fused_layers = [layer.fused() for layer in self.layers]
            self.decoder_plan = decoder_plan(self.fused_layers, self.norm)

    def _forward_fused(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_caches: KVCaches,
        meta: AttentionMetadata,
        output_rows: torch.Tensor | None,
    ) -> torch.Tensor:
        ops = self.fused_ops
        plan = self.decoder_plan
        if plan is not None and hidden.shape[0] <= plan.max_rows:
            k_cache, v_cache = kv_caches[0]
            heads = plan.heads
            step = plan.backend.kernel_step(
                hidden.dtype, heads.counts[0], heads.head_dim, k_cache, v_cache, meta
            )
            if step is not None:
                return decoder_layers(
                    ops, plan, step, hidden, cos, sin, kv_caches, meta, output_rows
                )
        residual = None
        last = len(self.fused_layers) - 1
        for i, (layer, kv_cache) in enumerate(zip(self.fused_layers, kv_caches, strict=True)):
            rows = output_rows if i == last else None
            hidden, residual = fused_layer(
                ops, layer, hidden, residual, cos, sin, kv_cache, meta, rows
            )
        return ops.add_rms_norm(hidden, residual, self.norm.weight, self.norm.eps)

    def compute_logits(self, hidden: torch.Tensor, *, float32: bool = True) -> torch.Tensor:
        """hidden [S, hidden_size] -> float32 logits [S, vocab_size]; ``float32=False``
        leaves them in the head's dtype (for the sampler's greedy argmax, which needs no
        float32 copy)."""
        logits = linear(hidden, *self._head(), self.fused_ops)
        return logits.float() if float32 else logits

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [S, hidden_size] -> the argmax of each row's logits [S] (int64), computed
        inside the LM head without writing the logits (``small_gemm_argmax``: the same
        roundings and ties as an argmax of ``compute_logits(hidden, float32=False)``), or
        None where that kernel does not apply (then use ``compute_logits``)."""
        _, bias, _, packed = self._head()
        if (
            packed is None
            or packed.dtype != torch.bfloat16
            or hidden.dtype != torch.bfloat16
            or hidden.dim() != 2
            or hidden.shape[0] > small_gemm_max_rows(packed)
        ):
            return None
        return self.fused_ops.small_gemm_argmax(hidden, packed, bias)

    def _head(self) -> tuple[torch.Tensor, torch.Tensor | None, Any, Any]:
        """The LM head's (weight, bias, oneDNN copy, small-batch copy): the embedding's
        when the two are tied."""
        if self.lm_head is not None:
            head = self.lm_head
            return head.weight, head.bias, head.packed, head.small
        return self.embed_tokens.weight, None, self.packed_head, self.small_head

    def _rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos, sin [T, 1, head_dim] (``rotary``)."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        cos, sin = rotary(positions, self.inv_freq, dtype)
        return cos[:, None, :], sin[:, None, :]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in, fusing q/k/v and gate/up.

        Raises ``ValueError`` for an unknown tensor name, a shape mismatch, or a
        parameter left unset.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            target = _map_name(hf_name, self.config)
            if target is None:
                continue
            name, part = target
            if name not in params:
                raise ValueError(f"unexpected weight {hf_name!r} for {self.config.architecture}")
            _copy_into(params[name], tensor, part, hf_name, self.config)
            loaded.add(f"{name}@{part}")
        missing = [key for key in self._expected_keys() if key not in loaded]
        if missing:
            raise ValueError(f"checkpoint lacks weights: {', '.join(missing[:8])}")

    def _expected_keys(self) -> list[str]:
        keys = []
        for name, _ in self.named_parameters():
            if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
                keys += [f"{name}@{part}" for part in ("q", "k", "v")]
            elif name.endswith("gate_up_proj.weight") or name.endswith("gate_up_proj.bias"):
                keys += [f"{name}@{part}" for part in ("gate", "up")]
            else:
                keys.append(f"{name}@")
        return keys


_FUSED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}


def _map_name(hf_name: str, config: ModelConfig) -> tuple[str, str] | None:
    """HF name -> (our parameter name, fused part or ""); None for tensors to skip."""
    if "rotary_emb" in hf_name:
        return None
    name = hf_name.removeprefix("model.")
    if name == "lm_head.weight" and config.tie_word_embeddings:
        return None  # some tied checkpoints still store the (identical) head
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in _FUSED:
        fused, part = _FUSED[parts[-2]]
        return ".".join([*parts[:-2], fused, parts[-1]]), part
    return name, ""


def _copy_into(
    param: nn.Parameter, tensor: torch.Tensor, part: str, hf_name: str, config: ModelConfig
) -> None:
    target = param.data
    if part:
        start, stop = _fused_rows(part, config)
        target = target[start:stop]
    if tuple(target.shape) != tuple(tensor.shape):
        raise ValueError(
            f"weight {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
        )
    with torch.no_grad():
        target.copy_(tensor)


def _fused_rows(part: str, config: ModelConfig) -> tuple[int, int]:
    """Row range of one part (q, k, v, gate, up) inside its fused weight or bias."""
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    inter = config.intermediate_size
    ranges = {
        "q": (0, q),
        "k": (q, q + kv),
        "v": (q + kv, q + 2 * kv),
        "gate": (0, inter),
        "up": (inter, 2 * inter),
    }
    return ranges[part]
