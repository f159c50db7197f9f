"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a paged KV cache.

The model sees only flattened tensors and ``AttentionMetadata``: a step's tokens of
all sequences are one ``[num_tokens]`` batch; the attention backend is the only
part that knows about sequences, slots and block tables.

q/k/v are fused into one linear (``qkv_proj``) and gate/up into another
(``gate_up_proj``) at load time: fewer, larger matmuls.

``optimize_for_cpu()`` (the runner calls it) packs the linears for this CPU's kernels
(``kernels/linear.py``; the packed copy replaces the plain weight) and switches on the fast path (``model/fast_path.py``), which gives
this module's results through fused C++ ops; this module's forward stays the ground truth.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.base import AttentionBackend, AttentionKind, AttentionMetadata
from pagedllm.kernels.linear import (
    LinearTensors,
    Packs,
    dense_weight,
    linear,
    pack_for_cpu,
    small_gemm_max_rows,
    small_rows,
)
from pagedllm.kernels.quant import Quantized, QuantWeight, dequantize_rows, kernels_run
from pagedllm.kernels.routes import head_route, linear_route, sampler_route
from pagedllm.model.base import FastPath, FastPathBuilder, KVCaches, StepHead, StepOutput
from pagedllm.model.config import ModelConfig, RopeConfig
from pagedllm.routes import Routes


def pack_linears(model: nn.Module, ops: Any) -> None:
    """Pack every ``Linear`` of ``model`` for this CPU's kernels, one at a time (each plain
    weight is dropped before the next is packed, so the two copies are never both held
    for the whole model), and a head tied to the embedding (``lm_head`` None) too
    (``tied_packs``): the embedding then looks its rows up in small_gemm's copy."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.pack(ops)
    table = model.embed_tokens
    unpacked = all(copy is None for copy in model.tied_packs)
    if model.lm_head is None and table.quant is None and unpacked:
        model.tied_packs = pack_for_cpu(table.weight, ops)
        small = model.tied_packs[1]
        # oneDNN's blocked layout has no rows to look tokens up in: there the table stays.
        if small is not None and isinstance(table, ReadsFromPacked):
            table.read_from_packed(small)


@runtime_checkable
class ReadsFromPacked(Protocol):
    """A token table that can give its rows from its tied head's small_gemm copy
    (``Embedding``, a tensor-parallel rank's ``VocabEmbedding``), dropping its own."""

    def read_from_packed(self, small: torch.Tensor) -> None: ...


class Linear(nn.Linear):
    """``nn.Linear`` whose weight, once ``pack()`` has run, is held packed for this CPU:
    the small-batch kernel's layout where this CPU runs that kernel, else oneDNN's; the
    packed copy replaces the plain weight (``dense_weight`` makes a row-major one on
    demand). A weight kept quantized (``keep_quantized``) is its only copy and runs on
    ``kernels/quant.py``."""

    packed: torch.Tensor | None = None
    small: torch.Tensor | None = None
    quant: Quantized | None = None
    ops: Any = None

    def keep_quantized(self, weight: Quantized) -> None:
        """Run on ``weight`` as stored; the float weight is dropped (an empty tensor of
        the model's dtype stands in its place)."""
        if weight.shape != tuple(self.weight.shape):
            raise ValueError(f"quantized weight {weight.shape} != {tuple(self.weight.shape)}")
        self.quant = weight
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def pack(self, ops: Any = None) -> None:
        """Pack the weight (once; a second call keeps the packed copy) and drop the plain
        one where a packed layout takes it; else the plain weight stays."""
        if self.quant is not None:
            self.ops = ops if kernels_run(ops) else None
            return
        if self.packed is None and self.small is None:
            self.packed, self.small = pack_for_cpu(self.weight, ops)
            if self.packed is not None or self.small is not None:
                self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)
        self.ops = ops if self.small is not None else None

    def dense_weight(self) -> torch.Tensor:
        """The row-major weight, made from the held form where it is not plain."""
        return dense_weight(self.tensors)

    @property
    def tensors(self) -> LinearTensors:
        return LinearTensors(self.weight, self.bias, self.packed, self.small, self.quant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, *self.tensors, self.ops)


class Embedding(nn.Embedding):
    """``nn.Embedding`` whose table may be kept quantized as stored (``keep_quantized``: a
    GGUF's token embedding, which a tied LM head also reads): its only copy; the rows a
    step looks up are dequantised. A table tied to a head on small_gemm is held once, in
    the head's packed copy (``read_from_packed``), and its rows gathered from there."""

    quant: QuantWeight | None = None
    small: torch.Tensor | None = None

    def read_from_packed(self, small: torch.Tensor) -> None:
        """Look rows up in ``small`` (``pack_small_gemm`` of this table); the plain table is
        dropped (an empty tensor of the model's dtype stands in its place)."""
        self.small = packed_table(self.weight, small)
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def reset_parameters(self) -> None:
        # A table built on the meta device is loaded, never drawn: torch's normal_ under a
        # device context runs a decomposition that imports torch._dynamo (70 MiB resident).
        if not self.weight.is_meta:
            super().reset_parameters()

    def keep_quantized(self, weight: QuantWeight) -> None:
        """Look rows up in ``weight``; the float table is dropped (an empty tensor of the
        model's dtype stands in its place)."""
        if weight.shape != tuple(self.weight.shape):
            raise ValueError(f"quantized table {weight.shape} != {tuple(self.weight.shape)}")
        self.quant = weight
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.small is not None:
            return small_rows(self.small, input_ids)
        if self.quant is None:
            return super().forward(input_ids)
        from pagedllm.kernels.ops import layer_ops

        rows = self.quant.rows(input_ids.reshape(-1).cpu())
        table = dequantize_rows(rows, self.weight.dtype, layer_ops())
        return table.view(*input_ids.shape, self.embedding_dim)


def packed_table(table: torch.Tensor, small: torch.Tensor) -> torch.Tensor:
    """``small`` where it is ``table`` packed for small_gemm, else ``ValueError``."""
    if small.numel() != table.numel() or small.dtype != table.dtype:
        raise ValueError("the packed copy is not this table's")
    return small


def describe_routes(
    model: nn.Module,
    backend: AttentionBackend,
    decode_loop: str,
    *,
    greedy_in_head: bool = True,
    kv_quantization: str | None = None,
    head_in_step: bool = False,
) -> Routes:
    """A model's ``Routes``: its attention backend's (over a cache quantized as
    ``kv_quantization``, if any), its ``Linear`` modules' and its LM head's (tied or not),
    its decode loop and its greedy sampler (``greedy_in_head``: the model offers
    ``greedy_tokens``; ``head_in_step``: a quantized head runs inside the one-call decode
    loop, ``forward_head``)."""
    head = head_tensors(model)
    dtype = head.weight.dtype
    linears = [m.tensors for m in model.modules() if isinstance(m, Linear)]
    if not any(t.weight is head.weight for t in linears):
        linears.append(head)
    return Routes(
        attention=(
            backend.route(dtype)
            if kv_quantization is None
            else backend.quant_route(dtype, kv_quantization)
        ),
        windowed_attention=kinds_route(model, backend, dtype),
        linears=linear_route(linears),
        lm_head=head_route(head, in_step=head_in_step),
        decode_loop=decode_loop,
        sampler=sampler_route(head, in_head=greedy_in_head, in_step=head_in_step),
    )


def head_tensors(model: nn.Module) -> LinearTensors:
    """The LM head's weight, bias and packed copies: the embedding's weight and
    ``tied_packs`` (or its table kept quantized) when the two are tied (``lm_head`` None)."""
    if model.lm_head is not None:
        return model.lm_head.tensors
    # The weight is read here, not kept: loading (to_empty) replaces the parameter.
    table = model.embed_tokens
    return LinearTensors(table.weight, None, *model.tied_packs, table.quant)


def step_head(head: LinearTensors, argmax: bool) -> StepHead | None:
    """``head`` as the one-call layer loops run it (``StepHead``), or None where they do not:
    only a head kept block-quantized runs there (on quant_gemm, in the layers' step team)."""
    if head.quant is None:
        return None
    return StepHead(head.quant.data, head.quant.code, head.bias, argmax)


def kinds_route(model: nn.Module, backend: AttentionBackend, dtype: torch.dtype) -> str:
    """How the model's layers with a window or soft-capping attend, one part per kind:
    "sliding window 512 (15 of 18 layers): <route>"; empty when every layer is full."""
    kinds = [m.kind for m in model.modules() if isinstance(m, Attention)]
    counts = Counter(kind for kind in kinds if not kind.is_full)
    return "; ".join(
        f"{kind.describe()} ({n} of {len(kinds)} layers): {backend.kind_route(dtype, kind)}"
        for kind, n in counts.items()
    )


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
    """Inverse frequencies [head_dim // 2] for the "default", "linear" and "llama3" rope
    types."""
    # Explicit CPU device: the model may be built under a meta-device context.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "default":
        return inv_freq
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
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
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, head_dim] of ``positions`` [T], computed in float32 then cast (as
    transformers does). ``scale``: YaRN's factor on cos and sin (in float32, before the
    cast, as transformers does)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype), sin.to(dtype)


class RotaryTable:
    """``rotary`` of every position below the largest one seen so far, kept in one dtype:
    a step's cos and sin are then two row gathers instead of seven small ops. Rows are
    computed by ``rotary`` itself, all at once when the table grows (to the next power of
    two), so a row can differ from a per-step ``rotary`` only where torch's vector and scalar
    cos/sin differ (a float32 ulp)."""

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


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The MLP gate's activation by its transformers name (validated by the config)."""
    if name == "gelu_pytorch_tanh":
        return functools.partial(F.gelu, approximate="tanh")
    return F.silu


class Attention(nn.Module):
    """Fused q/k/v, q/k norms where configured (``norm``: their class), rotary, the
    backend with the layer's ``kind``, the output projection."""

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        kind: AttentionKind | None = None,
        norm: Callable[[int, float], nn.Module] = RMSNorm,
    ) -> None:
        super().__init__()
        self.kind = kind or AttentionKind()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = config.attn_scale or self.head_dim**-0.5
        self.backend = backend
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        self.q_norm = norm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = norm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

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
        out = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, self.kind)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class Heads(NamedTuple):
    """How a layer's fused q/k/v projection splits into heads."""

    counts: tuple[int, int, int]  # q, k, v heads
    head_dim: int
    qk_norm: tuple[RMSNorm, RMSNorm] | None  # q and k RMSNorms (Qwen3), or None


def split_heads(qkv: torch.Tensor, heads: Heads) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[T, q + 2 kv] -> q [T, H, D], k, v [T, KV, D], q and k RMS-normalized where configured.
    One view and one split (Tensor.split's Python wrapper is dear at decode sizes)."""
    rows = qkv.view(qkv.shape[0], sum(heads.counts), heads.head_dim)
    q, k, v = rows.split_with_sizes(heads.counts, dim=1)
    if heads.qk_norm is not None:
        q, k = heads.qk_norm[0](q), heads.qk_norm[1](k)
    return q, k, v


class MLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up fused into one linear; ``intermediate_size``
    defaults to the config's (experts and shared experts pass their own)."""

    def __init__(self, config: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        inter = intermediate_size or config.intermediate_size
        self.intermediate_size = inter
        self.act = activation(config.hidden_act)
        self.gate_up_proj = Linear(config.hidden_size, 2 * inter, bias=config.mlp_bias)
        self.down_proj = Linear(inter, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, layer: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        kind = AttentionKind(sliding_window=config.layer_window(layer))
        self.self_attn = Attention(config, backend, kind)
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


class LlamaForCausalLM(nn.Module):
    """Decoder + LM head. ``forward`` -> final hidden states; ``compute_logits`` -> logits."""

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        fast_path_builder: FastPathBuilder | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.backend = backend
        # Builds the CPU fast path in optimize_for_cpu() (the loader gives
        # ``fast_path.CpuFastPath.build``); None keeps the modules.
        self.fast_path_builder = fast_path_builder
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, backend, i) for i in range(config.num_hidden_layers)
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
        # Set by optimize_for_cpu(): the CPU fast path (``model/fast_path.py``), or None: the
        # module-by-module forward below, which stays the ground truth.
        self.fast_path: FastPath | None = None
        # Set by optimize_for_cpu() when the head is tied: the embedding's packed copies
        # (oneDNN's, small_gemm's; ``head_tensors``).
        self.tied_packs: Packs = (None, None)
        self.head_ops: Any = None

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
        if self.fast_path is not None and hidden.device.type == "cpu":
            return self.fast_path.forward_head(
                hidden, positions, kv_caches, meta, output_rows, None
            ).hidden
        cos, sin = self._rotary(positions, hidden.dtype)
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            hidden = layer(hidden, cos, sin, kv_cache, meta.for_layer(index))
        hidden = self.norm(hidden)
        return hidden if output_rows is None else hidden[output_rows]

    def forward_head(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: KVCaches,
        meta: AttentionMetadata,
        output_rows: torch.Tensor | None = None,
        *,
        argmax: bool,
    ) -> StepOutput:
        """``forward``, with a block-quantized LM head (``step_head``) run inside the fast
        path's one-call loop where it takes the step: its logits in the model's dtype
        (``argmax``: each row's argmax instead), as ``compute_logits(hidden, float32=False)``
        gives them; elsewhere the hidden states alone."""
        head = step_head(head_tensors(self), argmax)
        if head is None or self.fast_path is None:
            return StepOutput(self(input_ids, positions, kv_caches, meta, output_rows))
        hidden = self.embed_tokens(input_ids)
        return self.fast_path.forward_head(hidden, positions, kv_caches, meta, output_rows, head)

    def optimize_for_cpu(self) -> None:
        """Pack the linears for this CPU's kernels and switch on the fast path (see
        ``model/fast_path.py``); a no-op elsewhere. Call after the weights are loaded:
        the packed copies replace the plain weights."""
        if self.embed_tokens.weight.device.type != "cpu":
            return
        from pagedllm.kernels.ops import layer_ops

        ops = layer_ops()
        pack_linears(self, ops)
        self.head_ops = ops
        if self.fast_path_builder is not None:
            self.fast_path = self.fast_path_builder(self, ops)

    def compute_logits(self, hidden: torch.Tensor, *, float32: bool = True) -> torch.Tensor:
        """hidden [S, hidden_size] -> float32 logits [S, vocab_size]; ``float32=False``
        leaves them in the head's dtype (for the sampler's greedy argmax, which needs no
        float32 copy)."""
        logits = linear(hidden, *head_tensors(self), self.head_ops)
        return logits.float() if float32 else logits

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [S, hidden_size] -> the argmax of each row's logits [S] (int64), computed
        inside the LM head without writing the logits (``small_gemm_argmax``: the same
        roundings and ties as an argmax of ``compute_logits(hidden, float32=False)``), or
        None where that kernel does not apply (then use ``compute_logits``)."""
        head = head_tensors(self)
        bias, packed = head.bias, head.small
        if (
            packed is None
            or packed.dtype != torch.bfloat16
            or hidden.dtype != torch.bfloat16
            or hidden.dim() != 2
            or hidden.shape[0] > small_gemm_max_rows(packed)
        ):
            return None
        return self.head_ops.small_gemm_argmax(hidden, packed, bias)

    def routes(self, kv_quantization: str | None = None) -> Routes:
        """Which implementation runs each capability of this model's steps."""
        decode = (
            "module by module (torch ops)"
            if self.fast_path is None
            else self.fast_path.route(kv_quantization)
        )
        in_step = self.fast_path is not None and self.fast_path.runs_head()
        return describe_routes(
            self, self.backend, decode, kv_quantization=kv_quantization, head_in_step=in_step
        )

    def _rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos, sin [T, 1, head_dim] (``rotary``)."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        cos, sin = rotary(positions, self.inv_freq, dtype)
        return cos[:, None, :], sin[:, None, :]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in, fusing q/k/v and gate/up
        (``model/weights.py``). Raises ``ValueError`` for an unknown tensor name, a shape
        mismatch, or a parameter left unset."""
        from pagedllm.model.weights import load_into

        load_into(self, weights)
