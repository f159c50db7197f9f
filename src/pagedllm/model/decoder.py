"""The decoder of the families beyond plain Llama: Gemma 2 / Gemma 3 (text) and the
mixtures of experts (Mixtral, Qwen3-MoE), over the same paged KV cache.

What differs from ``model/llama.py``, all read from the ``ModelConfig``:

- per-layer attention kinds: sliding-window layers (Gemma's local layers) with their own
  rope base, Gemma 2's score soft-capping, Gemma's ``query_pre_attn_scalar`` scale;
- Gemma's norms (scale by 1 + weight, computed in float32), the "sandwich" norms after
  attention and around the MLP, embeddings times sqrt(hidden_size), GELU (tanh) gating,
  soft-capped logits;
- sparse MLPs: a router picks ``top_k`` experts per token (softmax, renormalised where
  the model says so); the experts run grouped by expert — the step's (token, expert)
  pairs sorted by expert, one matmul pair per expert over its rows — never a loop per token.

Linears use ``llama.Linear`` (packed for the CPU by ``optimize_for_cpu``); attention goes
through the backend like every model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.base import AttentionBackend, AttentionKind, AttentionMetadata
from pagedllm.kernels.linear import Packs, linear
from pagedllm.model.base import FastPath, FastPathBuilder, StepOutput
from pagedllm.model.config import ModelConfig, MoeConfig
from pagedllm.model.llama import (
    MLP,
    Attention,
    Embedding,
    KVCaches,
    Linear,
    RMSNorm,
    activation,
    describe_routes,
    head_tensors,
    pack_linears,
    rope_inv_freq,
    rotary,
    step_head,
)
from pagedllm.model.mla import LatentAttention, rope_frequencies
from pagedllm.routes import Routes


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm: float32 throughout, scaled by (1 + weight), then cast back."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


def make_norm(config: ModelConfig, size: int) -> nn.Module:
    if config.norm_offset:
        return OffsetRMSNorm(size, config.rms_norm_eps)
    return RMSNorm(size, config.rms_norm_eps)


def route(
    logits: torch.Tensor, moe: MoeConfig, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, expert ids) [T, top_k] as each model routes: scores by softmax (or
    sigmoid, DeepSeek-V3) over all experts in float32; the top_k chosen among all experts
    ("greedy"), among the ``topk_groups`` groups holding the best expert
    ("group_limited_greedy", DeepSeek-V2), or on scores + the correction ``bias`` among
    the groups with the best two-expert sums ("noaux_tc", V3) and weighted by the unbiased
    scores; renormalised to sum 1 where ``norm_topk_prob``; times
    ``routed_scaling_factor``."""
    logits = logits.float()
    scores = logits.sigmoid() if moe.scoring == "sigmoid" else torch.softmax(logits, dim=-1)
    if moe.method == "greedy":
        weights, ids = torch.topk(scores, moe.top_k, dim=-1)
    elif moe.method == "group_limited_greedy":
        kept = _keep_groups(scores, scores, moe, lambda g: g.max(dim=-1).values)
        weights, ids = torch.topk(kept.masked_fill(kept.isinf(), 0.0), moe.top_k, dim=-1)
    else:
        choice = scores if bias is None else scores + bias.float()
        kept = _keep_groups(choice, choice, moe, lambda g: g.topk(2, dim=-1).values.sum(-1))
        ids = torch.topk(kept, moe.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * moe.routed_scaling_factor, ids


def _keep_groups(
    values: torch.Tensor,
    ranked: torch.Tensor,
    moe: MoeConfig,
    group_score: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """``values`` [T, E] with the experts outside each token's ``topk_groups`` best groups
    (by ``group_score`` of ``ranked`` per group) set to -inf."""
    num_tokens, num_experts = values.shape
    groups = ranked.view(num_tokens, moe.num_groups, num_experts // moe.num_groups)
    best = torch.topk(group_score(groups), moe.topk_groups, dim=-1).indices
    mask = torch.zeros(num_tokens, moe.num_groups, dtype=torch.bool, device=values.device)
    mask.scatter_(1, best, True)
    mask = mask[:, :, None].expand_as(groups).reshape(num_tokens, num_experts)
    return values.masked_fill(~mask, float("-inf"))


def grouped_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """sum over k of weights[t, k] * expert_{ids[t, k]}(x[t]), computed by expert: the
    (token, slot) pairs sorted by expert id, each expert's rows one contiguous slice
    through its gate_up [E, 2I, H] and down [E, H, I] weights, the results scattered back
    and summed per token."""
    num_tokens, top_k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    tokens = order // top_k
    rows = x.index_select(0, tokens)
    out = torch.empty_like(rows)
    inter = down.shape[2]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        part = rows[start : start + count]
        gate, up = F.linear(part, gate_up[expert]).split(inter, dim=-1)
        out[start : start + count] = F.linear(act(gate) * up, down[expert])
        start += count
    out *= weights.reshape(-1).index_select(0, order).to(out.dtype)[:, None]
    return torch.zeros_like(x).index_add_(0, tokens, out)


class Router(nn.Module):
    """The router's weight [E, hidden] and DeepSeek-V3's per-expert correction bias."""

    def __init__(self, hidden: int, num_experts: int, *, correction_bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.e_score_correction_bias = (
            nn.Parameter(torch.empty(num_experts)) if correction_bias else None
        )


class SparseMoe(nn.Module):
    """Router + experts (weights stacked per expert: ``experts_gate_up`` [E, 2I, H],
    ``experts_down`` [E, H, I]) + shared experts where the model has them."""

    def __init__(self, config: ModelConfig, moe: MoeConfig) -> None:
        super().__init__()
        self.moe = moe
        self.act = activation(config.hidden_act)
        hidden, inter, num = config.hidden_size, moe.intermediate_size, moe.num_experts
        self.gate = Router(hidden, num, correction_bias=moe.method == "noaux_tc")
        self.experts_gate_up = nn.Parameter(torch.empty(num, 2 * inter, hidden))
        self.experts_down = nn.Parameter(torch.empty(num, hidden, inter))
        self.shared_experts = (
            MLP(config, inter * moe.num_shared_experts) if moe.num_shared_experts else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate
        # DeepSeek's routers take float32 products; Mixtral's and Qwen's the model dtype's.
        if self.moe.scoring == "sigmoid" or self.moe.method != "greedy":
            logits = F.linear(x.float(), gate.weight.float())
        else:
            logits = F.linear(x, gate.weight)
        weights, ids = route(logits, self.moe, gate.e_score_correction_bias)
        out = grouped_experts(x, weights, ids, self.experts_gate_up, self.experts_down, self.act)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


class GeneralDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, layer: int) -> None:
        super().__init__()
        size = config.hidden_size
        self.input_layernorm = make_norm(config, size)
        kind = AttentionKind(config.layer_window(layer), config.attn_softcap)
        norm = OffsetRMSNorm if config.norm_offset else RMSNorm
        self.self_attn: nn.Module = (
            Attention(config, backend, kind, norm)
            if config.mla is None
            else LatentAttention(config, backend)
        )
        moe = config.moe
        sparse = moe is not None and moe.sparse_layers[layer]
        self.mlp: nn.Module = SparseMoe(config, moe) if sparse else MLP(config)
        self.post_attention_layernorm = make_norm(config, size)
        # Gemma's sandwich: the attention output is normed before the residual add (by
        # post_attention_layernorm), and the MLP sits between its own pre/post norms.
        self.pre_feedforward_layernorm = make_norm(config, size) if config.sandwich_norm else None
        self.post_feedforward_layernorm = make_norm(config, size) if config.sandwich_norm else None

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(hidden), cos, sin, kv_cache, meta)
        if self.pre_feedforward_layernorm is None:
            hidden = hidden + attn
            return hidden + self.mlp(self.post_attention_layernorm(hidden))
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp)


class DecoderForCausalLM(nn.Module):
    """Decoder + LM head for the families above, with ``LlamaForCausalLM``'s interface:
    ``forward`` -> final hidden states, ``compute_logits`` -> logits."""

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        fast_path_builder: FastPathBuilder | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.backend = backend
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            GeneralDecoderLayer(config, backend, i) for i in range(config.num_hidden_layers)
        )
        # Set by optimize_for_cpu() where the builder gives one (Gemma: gemma_fast_path.py);
        # None keeps the module loop, which stays the ground truth.
        self.fast_path_builder = fast_path_builder
        self.fast_path: FastPath | None = None
        self.norm = make_norm(config, config.hidden_size)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        # Plain attributes (float32 frequencies, untouched by .to(dtype)): the full layers'
        # rope and the sliding layers' where it differs (Gemma 3's local base).
        self.inv_freq, self.rope_scale = rope_frequencies(config.rope, config.head_dim)
        local = config.local_rope
        self.local_inv_freq = None if local is None else rope_inv_freq(local, config.head_dim)
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
        """input_ids, positions [T] -> final-normed hidden states [T or S, hidden_size]."""
        hidden = self._embed(input_ids)
        if self.fast_path is not None and hidden.device.type == "cpu":
            return self.fast_path.forward_head(
                hidden, positions, kv_caches, meta, output_rows, None
            ).hidden
        return self.module_loop(hidden, positions, kv_caches, meta, output_rows)

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
        """``forward``, with a block-quantized LM head run inside the fast path's one-call
        loop where it takes the step (``LlamaForCausalLM.forward_head``); not where the
        logits are soft-capped (the cap is applied on torch, in ``compute_logits``)."""
        head = step_head(head_tensors(self), argmax)
        if head is None or self.fast_path is None or self.config.final_softcap is not None:
            return StepOutput(self(input_ids, positions, kv_caches, meta, output_rows))
        hidden = self._embed(input_ids)
        return self.fast_path.forward_head(hidden, positions, kv_caches, meta, output_rows, head)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if self.config.embed_scale:
            # Rounded to the model's dtype first, as transformers does.
            hidden = hidden * torch.tensor(self.config.hidden_size**0.5, dtype=hidden.dtype)
        return hidden

    def module_loop(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: KVCaches,
        meta: AttentionMetadata,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The embedded tokens [T, hidden] through every layer module and the final norm."""
        full = self._rotary(self.inv_freq, positions, hidden.dtype)
        local = full
        if self.local_inv_freq is not None:
            local = self._rotary(self.local_inv_freq, positions, hidden.dtype)
        windows = self.config.sliding_windows
        layers = zip(self.layers, kv_caches, windows, strict=True)
        for index, (layer, kv_cache, window) in enumerate(layers):
            cos, sin = full if window is None else local
            hidden = layer(hidden, cos, sin, kv_cache, meta.for_layer(index))
        hidden = self.norm(hidden)
        return hidden if output_rows is None else hidden[output_rows]

    def compute_logits(self, hidden: torch.Tensor, *, float32: bool = True) -> torch.Tensor:
        """hidden [S, hidden_size] -> logits [S, vocab_size] (float32 unless ``float32`` is
        False), soft-capped where the model says so."""
        logits = linear(hidden, *head_tensors(self), self.head_ops)
        cap = self.config.final_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float() if float32 else logits

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """None: no argmax inside the head here (Gemma soft-caps its logits first); the
        runner takes the argmax of ``compute_logits``."""
        return None

    def routes(self, kv_quantization: str | None = None) -> Routes:
        """Which implementation runs each capability of this model's steps."""
        decode = (
            "module by module (torch ops)"
            if self.fast_path is None
            else self.fast_path.route(kv_quantization)
        )
        in_step = (
            self.fast_path is not None
            and self.fast_path.runs_head()
            and self.config.final_softcap is None
        )
        return describe_routes(
            self,
            self.backend,
            decode,
            greedy_in_head=False,
            kv_quantization=kv_quantization,
            head_in_step=in_step,
        )

    def optimize_for_cpu(self) -> None:
        """Pack the linears (and a tied head) for the CPU kernels; a no-op elsewhere."""
        if self.embed_tokens.weight.device.type != "cpu":
            return
        from pagedllm.kernels.ops import layer_ops

        ops = layer_ops()
        pack_linears(self, ops)
        self.head_ops = ops
        if self.fast_path_builder is not None:
            self.fast_path = self.fast_path_builder(self, ops)

    def _rotary(
        self, inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rotary(positions, inv_freq.to(positions.device), dtype, self.rope_scale)
        return cos[:, None, :], sin[:, None, :]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in (q/k/v, gate/up and the experts fused).
        ``ValueError`` for an unknown name, a shape mismatch or a missing weight."""
        from pagedllm.model.weights import load_into

        load_into(self, weights)
