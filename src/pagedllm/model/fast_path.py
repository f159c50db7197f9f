"""The CPU fast path of the Llama-family decoder: the same computation as ``model/llama.py``'s
modules, through pagedllm's fused C++ ops (``kernels/``), which round where the torch
expressions round.

Per layer (``fused_layer``): residual add + RMSNorm in one op, the qkv linear, the rotary
embedding in place, attention, the o linear, add + norm, gate/up, SiLU-and-multiply, down.
Steps whose linears all run on ``small_gemm`` and whose attention the backend's kernel takes
whole (``AttentionBackend.kernel_step``; over a quantized cache ``quant_kernel_step``) go
through one C++ call for every layer (``decoder_layers``; ``quant_decoder_layers``, whose
layers write with ``quant_write`` and attend with ``quant_attention``): the same ops in the
same order without Python between them.

The model calls its fast path through the ``FastPath`` Protocol (``model/base.py``); the
loader gives the model ``CpuFastPath.build``, which says whether this CPU has one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from pagedllm.attention.base import (
    FULL_ATTENTION,
    AttentionBackend,
    AttentionKind,
    AttentionMetadata,
    KernelStep,
    QuantKernelStep,
)
from pagedllm.attention.quant import QuantizedCache
from pagedllm.kernels.linear import (
    SMALL_GEMM_MAX_ROWS_BF16,
    LinearTensors,
    linear,
    small_gemm_max_rows,
)
from pagedllm.kernels.quant import QuantParts, kernels_run
from pagedllm.model.base import KVCaches, StepHead, StepOutput
from pagedllm.model.llama import (
    DecoderLayer,
    Heads,
    LlamaForCausalLM,
    RMSNorm,
    RotaryTable,
    split_heads,
)

# Rows per tile of a prompt step's work after attention (``after_attention``): tiles keep
# the MLP's activations in cache; the measurements: docs/performance.md.
TILE_ROWS = 256

# Every rank's column shard of a tensor, side by side in rank order (tensor parallelism).
Gather = Callable[[torch.Tensor], torch.Tensor]


class CpuFastPath:
    """The fused C++ ops, layer by layer or all layers in one call (``decoder_layers``)."""

    def __init__(
        self,
        ops: Any,
        layers: list[FusedLayer],
        final_norm: RMSNorm,
        rotary_table: RotaryTable,
        gather: Gather | None = None,
    ) -> None:
        self.ops = ops
        self.layers = layers
        self.final_norm = final_norm
        self.rotary_table = rotary_table
        # Tensor parallelism (model/tensor_parallel.py): the ranks' pieces put together
        # between the ops; the one-call plan has no place for it.
        self.gather = gather
        # None keeps the per-layer loop (tests set it to None to compare the two).
        self.plan: DecoderPlan | None = None if gather else decoder_plan(layers, final_norm)

    @classmethod
    def build(cls, model: LlamaForCausalLM, ops: Any) -> CpuFastPath | None:
        """The fast path for ``model`` (its linears already packed), or None where the C++
        ops are missing or the model's dtype has none."""
        if ops is None or model.embed_tokens.weight.dtype not in (torch.float32, torch.bfloat16):
            return None
        layers = [fused_layer_of(layer) for layer in model.layers]
        quantized = any(
            t.quant is not None
            for layer in layers
            for t in (layer.qkv, layer.o, layer.gate_up, layer.down)
        )
        if quantized and not kernels_run(ops):
            return None  # its quantized linears stay on the modules' torch path
        return cls(ops, layers, model.norm, RotaryTable(model.inv_freq))

    def runs_head(self) -> bool:
        return self.plan is not None

    def route(self, kv_quantization: str | None = None) -> str:
        if self.gather is not None:
            return "fused C++ ops layer by layer, gathers between the ranks' ops"
        if self.plan is None:
            return "fused C++ ops, layer by layer from Python (not every linear on own kernel)"
        if kv_quantization is not None:
            return (
                "fused C++: every layer in one call (quant_decoder_layers: quant_write, "
                f"quant_attention over the {kv_quantization} cache) when the quantized "
                "attention kernel takes the step whole, else fused ops layer by layer"
            )
        return (
            "fused C++: every layer in one call (decoder_layers) when the attention kernel "
            "takes the step whole, else fused ops layer by layer"
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
        """The one-call loop (with ``head`` inside it) where it takes the step, else the
        loop of ``fused_layer`` (the hidden states alone)."""
        cos, sin = self.rotary_table.lookup(positions, hidden.dtype, meta.max_seq_len)
        plan = self.plan
        if plan is not None and hidden.shape[0] <= plan.max_rows:
            whole = self._one_call(plan, hidden, cos, sin, kv_caches, meta, output_rows, head)
            if whole is not None:
                return whole
        residual = None
        last = len(self.layers) - 1
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            rows = output_rows if i == last else None
            hidden, residual = fused_layer(
                self.ops,
                layer,
                hidden,
                residual,
                cos,
                sin,
                kv_cache,
                meta.for_layer(i),
                rows,
                self.gather,
            )
        norm = self.final_norm
        return StepOutput(self.ops.add_rms_norm(hidden, residual, norm.weight, norm.eps))

    def _one_call(
        self,
        plan: DecoderPlan,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_caches: KVCaches,
        meta: AttentionMetadata,
        output_rows: torch.Tensor | None,
        head: StepHead | None,
    ) -> StepOutput | None:
        """Every layer (and ``head``) in one C++ call when the attention kernels take the
        step whole (``decoder_layers``, or ``quant_decoder_layers`` over a quantized cache),
        else None."""
        if meta.quant is not None:
            step = quant_kernel_step(plan, hidden.dtype, kv_caches, meta)
            if step is None:
                return None
            return step_output(
                quant_decoder_layers(
                    self.ops, plan, step, hidden, cos, sin, kv_caches, meta, output_rows, head
                ),
                head,
            )
        steps = kernel_steps(plan.backend, plan.kind, hidden.dtype, plan.heads, kv_caches, meta)
        if steps is None:
            return None
        return step_output(
            decoder_layers(
                self.ops, plan, steps, hidden, cos, sin, kv_caches, meta, output_rows, head
            ),
            head,
        )


def step_output(
    result: tuple[torch.Tensor, torch.Tensor, torch.Tensor], head: StepHead | None
) -> StepOutput:
    """A one-call op's (hidden, logits, tokens) as a ``StepOutput``: only what ``head``
    asked for (the op returns empty tensors for the rest)."""
    hidden, logits, tokens = result
    if head is None:
        return StepOutput(hidden)
    return StepOutput(hidden, tokens=tokens) if head.argmax else StepOutput(hidden, logits)


def head_arguments(head: StepHead | None) -> tuple:
    """The one-call ops' last arguments: the head run after the final norm (none: None)."""
    if head is None:
        return (None, 0, None, False)
    return (head.weight, head.format, head.bias, head.argmax)


def fused_layer_of(layer: DecoderLayer) -> FusedLayer:
    """A layer's tensors and sizes for ``fused_layer`` (after ``Linear.pack``)."""
    attn, mlp = layer.self_attn, layer.mlp
    norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
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
        attn.kind,
    )


class FusedLayer(NamedTuple):
    """A decoder layer flattened for ``fused_layer``: plain tensors and sizes, so that a
    decode step makes no nn.Module calls or attribute lookups (on a 30-layer model those
    add up to a real share of a small batch's step)."""

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
    kind: AttentionKind = FULL_ATTENTION


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
    gather: Gather | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``DecoderLayer.forward`` with the fused C++ ops (cos, sin: [T, head_dim]; the rotary
    embedding applied in place by one op). The residual stream is carried separately and
    the previous layer's last add happens inside this layer's first norm::

        residual += hidden; x = norm(residual)   (one op, same roundings)

    Returns (this layer's MLP output, residual) for the next layer to add. ``rows``: only
    these rows go on after attention (the last layer, where only the rows that sample are
    read; every row's K/V is still written). ``gather``: under tensor parallelism, puts
    the ranks' column shards together after attention, o, SiLU-and-multiply and down."""
    if residual is None:
        residual = hidden
        x = ops.rms_norm(hidden, layer.norm1, layer.norm1_eps)
    else:
        x = ops.add_rms_norm(hidden, residual, layer.norm1, layer.norm1_eps)
    q, k, v = split_heads(linear(x, *layer.qkv, ops), layer.heads)
    ops.rope_(q, k, cos, sin)
    out = layer.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, layer.scale, layer.kind)
    if rows is not None:
        out, residual = out.index_select(0, rows), residual.index_select(0, rows)
    q_width = layer.heads.counts[0] * layer.heads.head_dim
    out = out.view(out.shape[0], q_width)
    if gather is None:
        return after_attention(ops, layer, out, residual), residual
    attn = gather(linear(gather(out), *layer.o, ops))
    x = ops.add_rms_norm(attn, residual, layer.norm2, layer.norm2_eps)
    mid = gather(ops.silu_mul(linear(x, *layer.gate_up, ops)))
    return gather(linear(mid, *layer.down, ops)), residual


def after_attention(
    ops: Any, layer: FusedLayer, out: torch.Tensor, residual: torch.Tensor
) -> torch.Tensor:
    """o, add + norm (``residual`` updated in place), gate/up, SiLU-and-multiply, down: the
    layer's MLP output. Prompt steps take it in tiles of ``TILE_ROWS`` rows, so that a tile's
    activations (gate/up is twice the intermediate size wide) are still in cache for the next
    op instead of going out to memory and back between ops; on small_gemm every row's result
    is the same whichever tile holds it."""
    num_rows = out.shape[0]
    if num_rows <= 2 * TILE_ROWS:
        return _after_attention(ops, layer, out, residual)
    hidden = out.new_empty(num_rows, residual.shape[1])
    for start in range(0, num_rows, TILE_ROWS):
        tile = slice(start, start + TILE_ROWS)
        hidden[tile] = _after_attention(ops, layer, out[tile], residual[tile])
    return hidden


def _after_attention(
    ops: Any, layer: FusedLayer, out: torch.Tensor, residual: torch.Tensor
) -> torch.Tensor:
    attn = linear(out, *layer.o, ops)
    x = ops.add_rms_norm(attn, residual, layer.norm2, layer.norm2_eps)
    return linear(ops.silu_mul(linear(x, *layer.gate_up, ops)), *layer.down, ops)


class DecoderPlan(NamedTuple):
    """Every layer's tensors as ``decoder_layers`` (``kernels/csrc/decoder_layers.cpp``)
    takes them: one C++ call runs ``fused_layer`` for all layers, without Python between
    the ops (a real share of a small decode step)."""

    norm1: list[torch.Tensor]
    # Each layer's fused q/k/v, or where some layer keeps them apart, each layer's q, k and v
    # in turn (``qkv_arguments``).
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
    backend: AttentionBackend  # every layer's: its kernel_step says which steps it takes whole
    max_rows: int
    # Each layer's window and soft-cap as paged_attention takes them (0: none), and the kind
    # whose route decides whether the kernel takes a step whole: full attention when any
    # layer has it (the kernel takes every query of the others).
    sliding_windows: list[int]
    softcaps: list[float]
    kind: AttentionKind
    # Per layer the formats of qkv (or q, k and v), o, gate_up and down (``kernel_format``),
    # or empty where every linear is on small_gemm.
    weight_formats: list[int]


def decoder_plan(layers: list[FusedLayer], final_norm: RMSNorm) -> DecoderPlan | None:
    """The plan for ``decoder_layers``, or None where it cannot stand in for the loop of
    ``fused_layer``: every linear needs its small-batch copy (``small_gemm``) or its
    quantized weight (``quant_gemm``), one norm epsilon and one attention backend, and no
    q/k norms."""
    if not layers:
        return None
    first = layers[0]
    linears = [t for layer in layers for t in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    qkv = qkv_arguments([layer.qkv for layer in layers], first.heads)
    if (
        qkv is None
        or not on_own_kernels(linears)
        or any(kept_apart(t) for layer in layers for t in (layer.o, layer.gate_up, layer.down))
        or any(layer.heads != first.heads or layer.scale != first.scale for layer in layers)
        or first.heads.qk_norm is not None
        or any(layer.backend is not first.backend for layer in layers)
        or {final_norm.eps} != {e for layer in layers for e in (layer.norm1_eps, layer.norm2_eps)}
    ):
        return None
    sliding_windows, softcaps, kind = kind_arguments([layer.kind for layer in layers])
    formats = layer_formats(qkv[2], [(layer.o, layer.gate_up, layer.down) for layer in layers])
    return DecoderPlan(
        norm1=[layer.norm1 for layer in layers],
        qkv=qkv[0],
        qkv_bias=qkv[1],
        o=[kernel_weight(layer.o) for layer in layers],
        o_bias=[layer.o.bias for layer in layers],
        norm2=[layer.norm2 for layer in layers],
        gate_up=[kernel_weight(layer.gate_up) for layer in layers],
        gate_up_bias=[layer.gate_up.bias for layer in layers],
        down=[kernel_weight(layer.down) for layer in layers],
        down_bias=[layer.down.bias for layer in layers],
        final_norm=final_norm.weight,
        eps=final_norm.eps,
        heads=first.heads,
        scale=first.scale,
        backend=first.backend,
        max_rows=min(kernel_max_rows(t) for t in linears),
        sliding_windows=sliding_windows,
        softcaps=softcaps,
        kind=kind,
        weight_formats=formats,
    )


def on_own_kernels(linears: list[LinearTensors]) -> bool:
    """Every linear on one of pagedllm's kernels (``decoder_layers`` runs each on its own):
    ``small_gemm`` (all in one dtype) or, kept quantized, ``quant_gemm``."""
    dtypes = {t.small.dtype for t in linears if t.small is not None}
    return all(t.small is not None or t.quant is not None for t in linears) and len(dtypes) <= 1


def kept_apart(t: LinearTensors) -> bool:
    """``t``'s weight is kept in parts (``QuantParts``): the one-call loops take that for
    q/k/v only (``qkv_arguments``)."""
    return isinstance(t.quant, QuantParts)


def qkv_arguments(
    qkvs: list[LinearTensors], heads: Heads
) -> tuple[list[torch.Tensor], list[torch.Tensor | None], list[int]] | None:
    """Every layer's q/k/v as the one-call loops take them: (weights, biases, formats), one
    fused weight a layer; where some layer keeps them apart (their stored formats differ),
    three a layer, q, k and v (a fused weight's rows as views, no copy). None where the
    loops cannot take them: parts that are not q, k and v, or a layer on small_gemm beside
    one kept apart, or a layer on neither kernel (oneDNN, torch)."""
    if not on_own_kernels(qkvs):
        return None
    if not any(kept_apart(t) for t in qkvs):
        return (
            [kernel_weight(t) for t in qkvs],
            [t.bias for t in qkvs],
            [kernel_format(t) for t in qkvs],
        )
    q, kv = heads.counts[0] * heads.head_dim, heads.counts[1] * heads.head_dim
    bounds = ((0, q), (q, q + kv), (q + kv, q + 2 * kv))
    weights, biases, formats = [], [], []
    for t in qkvs:
        if t.quant is None:
            return None
        parts = (
            t.quant.parts
            if isinstance(t.quant, QuantParts)
            else [t.quant.rows(slice(a, b)) for a, b in bounds]
        )
        if [p.shape[0] for p in parts] != [b - a for a, b in bounds]:
            return None
        weights += [p.data for p in parts]
        biases += [None if t.bias is None else t.bias[a:b] for a, b in bounds]
        formats += [p.code for p in parts]
    return weights, biases, formats


def layer_formats(qkv_formats: list[int], others: list[tuple[LinearTensors, ...]]) -> list[int]:
    """The one-call loops' ``weight_formats``: per layer its q/k/v weights' (one or three,
    from ``qkv_arguments``), then o's, gate_up's and down's; empty where every linear is on
    small_gemm."""
    per = len(qkv_formats) // len(others)
    formats = [
        f
        for i, layer in enumerate(others)
        for f in (*qkv_formats[per * i : per * (i + 1)], *(kernel_format(t) for t in layer))
    ]
    return formats if any(formats) else []


def kernel_weight(t: LinearTensors) -> torch.Tensor:
    """The weight ``decoder_layers`` takes: small_gemm's copy, or the quantized layout."""
    if t.small is not None:
        return t.small
    assert t.quant is not None
    return t.quant.data


def kernel_format(t: LinearTensors) -> int:
    """The format ``decoder_layers`` takes with the weight: 0 for small_gemm's copy, else
    the quantized layout's (its GGML type number), which sends it to quant_gemm."""
    return 0 if t.small is not None or t.quant is None else t.quant.code


def kernel_max_rows(t: LinearTensors) -> int:
    """The most rows ``t``'s kernel takes in the one-call loop: quant_gemm takes any number
    (dequantised tiles on small_gemm beyond its integer rows), capped as bf16 small_gemm is."""
    return SMALL_GEMM_MAX_ROWS_BF16 if t.quant is not None else small_gemm_max_rows(t.small)


def kind_arguments(kinds: list[AttentionKind]) -> tuple[list[int], list[float], AttentionKind]:
    """Each layer's window and soft-cap as ``paged_attention`` takes them (0: none), and the
    kind whose route decides whether the kernel takes a step whole: full attention when any
    layer has it (the kernel takes every query of the others)."""
    return (
        [kind.sliding_window or 0 for kind in kinds],
        [kind.softcap or 0.0 for kind in kinds],
        next((kind for kind in kinds if kind.is_full), kinds[0]),
    )


def decoder_layers(
    ops: Any,
    plan: DecoderPlan,
    steps: list[KernelStep],
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_caches: KVCaches,
    meta: AttentionMetadata,
    output_rows: torch.Tensor | None,
    head: StepHead | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The loop of ``fused_layer`` plus the final norm (and ``head``) in one C++ call, for a
    step the attention backend's kernel takes whole (``step``: its ``kernel_step``): the
    hidden states, the head's logits and argmax (``step_output``)."""
    return ops.decoder_layers(
        hidden,
        cos,
        sin,
        *weight_arguments(plan),
        *step_arguments(steps[0], kv_caches, meta, plan.heads, plan.scale),
        output_rows,
        plan.sliding_windows,
        plan.softcaps,
        *group_arguments(steps, meta),
        plan.weight_formats,
        *head_arguments(head),
    )


def quant_decoder_layers(
    ops: Any,
    plan: DecoderPlan,
    step: QuantKernelStep,
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_caches: KVCaches,
    meta: AttentionMetadata,
    output_rows: torch.Tensor | None,
    head: StepHead | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``decoder_layers`` over a quantized cache: per layer ``quant_write`` (the step's
    windows, seals and staging: ``meta.quant``) and ``quant_attention`` in one C++ call, for
    a step the backend's ``quant_kernel_step`` takes whole."""
    num_heads, num_kv_heads, _ = plan.heads.counts
    quant = meta.quant
    return ops.quant_decoder_layers(
        hidden,
        cos,
        sin,
        *weight_arguments(plan),
        *side_arguments([k for k, _ in kv_caches]),
        *side_arguments([v for _, v in kv_caches]),
        *quant.write_args(),
        quant.window_start,
        quant.first_slots,
        step.block_tables,
        step.seq_lens,
        step.query_start_loc,
        num_heads,
        num_kv_heads,
        plan.heads.head_dim,
        plan.scale,
        output_rows,
        plan.weight_formats,
        *head_arguments(head),
    )


def quant_kernel_step(
    plan: DecoderPlan, dtype: torch.dtype, kv_caches: KVCaches, meta: AttentionMetadata
) -> QuantKernelStep | None:
    """The backend's ``quant_kernel_step`` where every layer has full attention (the only
    kind a quantized cache serves) and one format a side, else None."""
    k_cache, v_cache = kv_caches[0]
    if (
        any(plan.sliding_windows)
        or any(plan.softcaps)
        or meta.layer_groups
        or any(k.codec != k_cache.codec or v.codec != v_cache.codec for k, v in kv_caches)
    ):
        return None
    return plan.backend.quant_kernel_step(
        dtype, plan.heads.head_dim, k_cache, v_cache, meta, FULL_ATTENTION
    )


def weight_arguments(plan: DecoderPlan) -> tuple:
    """The one-call layer ops' weights, in their order (after hidden, cos, sin)."""
    return (
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
    )


def side_arguments(caches: list[QuantizedCache]) -> tuple:
    """One side's (K or V) per-layer tensors as ``quant_decoder_layers`` takes them, and its
    format."""
    return (
        [c.data for c in caches],
        [c.scale for c in caches],
        [c.minimum for c in caches],
        [c.stage for c in caches],
        caches[0].codec.code,
    )


def kernel_steps(
    backend: AttentionBackend,
    kind: AttentionKind,
    dtype: torch.dtype,
    heads: Heads,
    kv_caches: KVCaches,
    meta: AttentionMetadata,
) -> list[KernelStep] | None:
    """The attention kernel's step of each KV cache group (group 0 first: one for a model
    whose layers share one block table) when it takes the step whole, else None."""
    k_cache, v_cache = kv_caches[0]
    steps = []
    for group in (meta, *meta.groups):
        step = backend.kernel_step(
            dtype, heads.counts[0], heads.head_dim, k_cache, v_cache, group, kind
        )
        if step is None:
            return None
        steps.append(step)
    return steps


def group_arguments(steps: list[KernelStep], meta: AttentionMetadata) -> tuple:
    """The one-call ops' last arguments: groups 1..'s block tables and slots, and each
    layer's group (all empty for one group)."""
    return (
        [step.block_tables for step in steps[1:]],
        [group.slot_mapping for group in meta.groups],
        list(meta.layer_groups),
    )


def step_arguments(
    step: KernelStep, kv_caches: KVCaches, meta: AttentionMetadata, heads: Heads, scale: float
) -> tuple:
    """The arguments the one-call layer ops (``decoder_layers``, ``gemma_layers``) take
    after their weights, in their order: caches, K/V slots, ``paged_attention``'s step
    (group 0's)."""
    num_heads, num_kv_heads, _ = heads.counts
    return (
        [k for k, _ in kv_caches],
        [v for _, v in kv_caches],
        meta.slot_mapping,
        step.block_tables,
        step.seq_lens,
        step.query_start_loc,
        step.handled,
        num_heads,
        num_kv_heads,
        heads.head_dim,
        scale,
        step.rows_per_task,
        step.fast_bf16,
        step.use_amx,
    )
