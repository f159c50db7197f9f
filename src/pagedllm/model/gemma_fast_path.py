"""The CPU fast path of Gemma 2 / Gemma 3 (``model/decoder.py``): every layer of a step in
one C++ call (``gemma_layers``, ``kernels/csrc/gemma_layers.cpp``) with the module loop's
roundings — Gemma's (1 + weight) float32 norms, q/k norms, sandwich norms, GELU (tanh)
gating, the local rope of the sliding layers, per-layer windows and soft-capping in
``paged_attention``.

It takes the steps the attention kernel takes whole (``AttentionBackend.kernel_step``)
with at most ``small_gemm``'s rows (any number where every linear is kept quantized:
``gemma_max_rows``), its linears on ``small_gemm`` or, kept quantized (a GGUF's), on
``quant_gemm`` as ``decoder_layers`` runs them; every other step runs the model's own module loop, on
the same packed weights. ``GemmaFastPath.build`` says whether a model has one.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from pagedllm.attention.base import AttentionBackend, AttentionKind, AttentionMetadata
from pagedllm.kernels.quant import kernels_run
from pagedllm.model.base import KVCaches, StepHead, StepOutput
from pagedllm.model.fast_path import (
    group_arguments,
    head_arguments,
    kept_apart,
    kernel_max_rows,
    kernel_steps,
    kernel_weight,
    kind_arguments,
    layer_formats,
    on_own_kernels,
    qkv_arguments,
    step_arguments,
    step_output,
)
from pagedllm.model.llama import Heads, RotaryTable

# The model's own loop: (hidden, positions, kv_caches, meta, output_rows) -> hidden states.
ModuleLoop = Callable[
    [torch.Tensor, torch.Tensor, KVCaches, AttentionMetadata, torch.Tensor | None], torch.Tensor
]


class GemmaPlan(NamedTuple):
    """Every layer's tensors as ``gemma_layers`` takes them (norms as float32 1 + weight)."""

    in_norm: list[torch.Tensor]
    q_norm: list[torch.Tensor | None]
    k_norm: list[torch.Tensor | None]
    qkv: list[torch.Tensor]  # as DecoderPlan's: fused, or q, k and v a layer
    qkv_bias: list[torch.Tensor | None]
    o: list[torch.Tensor]
    o_bias: list[torch.Tensor | None]
    post_attn_norm: list[torch.Tensor]
    pre_ff_norm: list[torch.Tensor]
    gate_up: list[torch.Tensor]
    gate_up_bias: list[torch.Tensor | None]
    down: list[torch.Tensor]
    down_bias: list[torch.Tensor | None]
    post_ff_norm: list[torch.Tensor]
    final_norm: torch.Tensor
    eps: float
    heads: Heads
    scale: float
    backend: AttentionBackend
    max_rows: int
    sliding_windows: list[int]
    softcaps: list[float]
    kind: AttentionKind  # the kind whose route decides whether the kernel takes a step
    # Per layer the formats of qkv (or q, k and v), o, gate_up and down (``layer_formats``),
    # or empty where every linear is on small_gemm.
    weight_formats: list[int]


class GemmaFastPath:
    """``gemma_layers`` for the steps the attention kernel takes whole, else the module
    loop."""

    def __init__(
        self,
        ops: Any,
        plan: GemmaPlan,
        rotary: RotaryTable,
        local_rotary: RotaryTable,
        module_loop: ModuleLoop,
    ) -> None:
        self.ops = ops
        self.plan = plan
        self.rotary = rotary
        self.local_rotary = local_rotary
        self.module_loop = module_loop

    @classmethod
    def build(cls, model: Any, ops: Any) -> GemmaFastPath | None:
        """The fast path of a Gemma ``DecoderForCausalLM`` (its linears packed), or None
        where it has none: no C++ ops, another family, a mixture of experts, a linear
        without its ``small_gemm`` copy or quantized layout (or a quantized one where the
        integer kernels do not run), or a rope the table does not hold (YaRN scale)."""
        config = model.config
        if (
            ops is None
            or not (config.norm_offset and config.sandwich_norm)
            or config.moe is not None
            or config.mla is not None
            or config.hidden_act != "gelu_pytorch_tanh"
            or model.rope_scale != 1.0
            or model.embed_tokens.weight.dtype not in (torch.float32, torch.bfloat16)
        ):
            return None
        plan = gemma_plan(model)
        if plan is None or (plan.weight_formats and not kernels_run(ops)):
            return None
        local = model.local_inv_freq if model.local_inv_freq is not None else model.inv_freq
        rotary = RotaryTable(model.inv_freq)
        local_rotary = rotary if local is model.inv_freq else RotaryTable(local)
        return cls(ops, plan, rotary, local_rotary, model.module_loop)

    def runs_head(self) -> bool:
        return True

    def route(self, kv_quantization: str | None = None) -> str:
        if kv_quantization is not None:  # the one-call loop reads plain blocks only
            return (
                f"module by module (torch ops): a {kv_quantization} cache's attention is not "
                "in the one-call loop"
            )
        return (
            "fused C++: every Gemma layer in one call (gemma_layers) when the attention "
            "kernel takes the step whole, else module by module (torch ops)"
        )

    def forward_head(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: KVCaches,
        meta: AttentionMetadata,
        output_rows: torch.Tensor | None,
        head: StepHead | None,
    ) -> StepOutput:
        """``gemma_layers`` (with ``head`` inside it) where it takes the step, else the
        module loop (the hidden states alone)."""
        plan = self.plan
        if hidden.shape[0] <= plan.max_rows:
            heads = plan.heads
            steps = kernel_steps(plan.backend, plan.kind, hidden.dtype, heads, kv_caches, meta)
            if steps is not None:
                cos, sin = self.rotary.lookup(positions, hidden.dtype, meta.max_seq_len)
                local_cos, local_sin = (
                    (cos, sin)
                    if self.local_rotary is self.rotary
                    else self.local_rotary.lookup(positions, hidden.dtype, meta.max_seq_len)
                )
                result = self.ops.gemma_layers(
                    hidden,
                    cos,
                    sin,
                    local_cos,
                    local_sin,
                    plan.in_norm,
                    plan.q_norm,
                    plan.k_norm,
                    plan.qkv,
                    plan.qkv_bias,
                    plan.o,
                    plan.o_bias,
                    plan.post_attn_norm,
                    plan.pre_ff_norm,
                    plan.gate_up,
                    plan.gate_up_bias,
                    plan.down,
                    plan.down_bias,
                    plan.post_ff_norm,
                    plan.final_norm,
                    plan.eps,
                    *step_arguments(steps[0], kv_caches, meta, heads, plan.scale),
                    output_rows,
                    plan.sliding_windows,
                    plan.softcaps,
                    *group_arguments(steps, meta),
                    plan.weight_formats,
                    *head_arguments(head),
                )
                return step_output(result, head)
        return StepOutput(self.module_loop(hidden, positions, kv_caches, meta, output_rows))


def gemma_max_rows(linears: list[Any]) -> int:
    """The most rows ``gemma_layers`` takes: any number where every linear is kept
    block-quantized (``quant_gemm`` takes any), else ``kernel_max_rows``' cap. The module
    loop's norms and rope are torch composites: Gemma-3-270M's 2,048-token prompt steps ran
    ~10% faster in the one call (docs/performance.md, Gemma's prompts in one call);
    ``decoder_layers`` keeps the cap (Qwen2.5-Coder's ran ~4% slower there)."""
    if all(t.quant is not None for t in linears):
        return sys.maxsize
    return min(kernel_max_rows(t) for t in linears)


def offset_weight(norm: Any) -> torch.Tensor:
    """A Gemma norm's scale as the module computes it: float32 (1 + weight)."""
    return (1.0 + norm.weight.float()).contiguous()


def gemma_plan(model: Any) -> GemmaPlan | None:
    """The plan for ``gemma_layers``, or None where a layer does not fit it: every linear
    needs its ``small_gemm`` copy (one dtype) or its quantized layout (``quant_gemm``), and
    every layer one head shape, scale and backend."""
    layers = list(model.layers)
    attns = [layer.self_attn for layer in layers]
    mlps = [layer.mlp for layer in layers]
    modules = [m for a in attns for m in (a.qkv_proj, a.o_proj)]
    modules += [m for p in mlps for m in (p.gate_up_proj, p.down_proj)]
    linears = [m.tensors for m in modules]
    first = attns[0]
    qkv = qkv_arguments([a.qkv_proj.tensors for a in attns], first.heads)
    others = [
        (a.o_proj.tensors, p.gate_up_proj.tensors, p.down_proj.tensors)
        for a, p in zip(attns, mlps, strict=True)
    ]
    if (
        qkv is None
        or not on_own_kernels(linears)
        or any(kept_apart(t) for layer in others for t in layer)
    ) or any(
        a.heads.counts != first.heads.counts
        or a.head_dim != first.head_dim
        or a.scale != first.scale
        or a.backend is not first.backend
        for a in attns
    ):
        return None
    sliding_windows, softcaps, kind = kind_arguments([a.kind for a in attns])
    return GemmaPlan(
        in_norm=[offset_weight(layer.input_layernorm) for layer in layers],
        q_norm=[None if a.q_norm is None else offset_weight(a.q_norm) for a in attns],
        k_norm=[None if a.k_norm is None else offset_weight(a.k_norm) for a in attns],
        qkv=qkv[0],
        qkv_bias=qkv[1],
        o=[kernel_weight(a.o_proj.tensors) for a in attns],
        o_bias=[a.o_proj.tensors.bias for a in attns],
        post_attn_norm=[offset_weight(layer.post_attention_layernorm) for layer in layers],
        pre_ff_norm=[offset_weight(layer.pre_feedforward_layernorm) for layer in layers],
        gate_up=[kernel_weight(p.gate_up_proj.tensors) for p in mlps],
        gate_up_bias=[p.gate_up_proj.tensors.bias for p in mlps],
        down=[kernel_weight(p.down_proj.tensors) for p in mlps],
        down_bias=[p.down_proj.tensors.bias for p in mlps],
        post_ff_norm=[offset_weight(layer.post_feedforward_layernorm) for layer in layers],
        final_norm=offset_weight(model.norm),
        eps=model.config.rms_norm_eps,
        heads=first.heads,
        scale=first.scale,
        backend=first.backend,
        max_rows=gemma_max_rows(linears),
        sliding_windows=sliding_windows,
        softcaps=softcaps,
        kind=kind,
        weight_formats=layer_formats(qkv[2], others),
    )
