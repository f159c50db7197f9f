"""How a model's linears and sampler run on pagedllm's kernels, in words for ``Routes``."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch

from pagedllm.kernels.linear import LinearTensors, small_gemm_refusal
from pagedllm.kernels.ops import layer_ops
from pagedllm.kernels.quant import Quantized, QuantParts, kernels_run

# The routes read the kernels from layer_ops() rather than from a model: a model keeps
# ops only beside the weights it packed, so an unpacked head has none to describe others.


def small_gemm_route(dtype: torch.dtype) -> str:
    """The ISA ``small_gemm`` runs ``dtype`` on: bf16 "amx" or "avx512_bf16", float32
    "avx512" or "avx2" ("none" where it has none)."""
    ops = layer_ops()
    if ops is None:
        return "none"
    return ops.small_gemm_isa() if dtype == torch.bfloat16 else ops.small_gemm_f32_isa()


def linear_path(linear: LinearTensors) -> str:
    """Where one linear runs, as ``kernels/linear.py``'s ``linear`` picks: pagedllm's own
    kernel, oneDNN's packed layout, or plain torch."""
    if linear.quant is not None:
        return quant_path(linear.quant, linear.weight.dtype)
    small = linear.small
    if small is not None:
        return f"own kernel small_gemm ({small_gemm_route(small.dtype)})"
    if linear.packed is not None:
        return "oneDNN (packed bf16)"
    return "torch F.linear"


def quant_path(weight: Quantized, dtype: torch.dtype) -> str:
    """Where a linear kept quantized runs, with activations of ``dtype``: its format (each
    part's, for one kept in parts), the integer kernel's ISA and row limit, and the
    dequantised tiles' GEMM beyond."""
    ops = layer_ops()
    if not kernels_run(ops):
        return f"torch, {weight.format} dequantised per call (no quant_gemm here)"
    # model/quantize.py's weights: "int8 at load"
    held = (
        f"{weight.format}, {weight.stored}" if weight.stored else f"{weight.format} kept as stored"
    )
    if isinstance(weight, QuantParts):
        held += ", a call a part"
    bf16_tiles = dtype == torch.bfloat16 and small_gemm_route(dtype) != "none"
    tiles = small_gemm_route(torch.bfloat16 if bf16_tiles else torch.float32)
    rows, tiled = integer_rows(weight, dtype)
    beyond = f", dequantised tiles on small_gemm ({tiles}) beyond" if tiled else ""
    return f"own kernel quant_gemm ({ops.quant_gemm_isa()}, {held}) {rows}{beyond}"


def integer_rows(weight: Quantized, dtype: torch.dtype) -> tuple[str, bool]:
    """How many rows of ``dtype`` the integer kernel takes of ``weight`` ("up to 16 rows
    (int8 activations)", "any number of rows (...)"; each part's where they differ), and
    whether more go to dequantised tiles."""
    ops = layer_ops()
    parts = weight.parts if isinstance(weight, QuantParts) else (weight,)
    limits = dict.fromkeys((p.activations, ops.quant_gemm_int_rows(dtype, p.code)) for p in parts)
    phrases = [
        f"{'at any number of rows' if rows < 0 else f'up to {rows} rows'} ({activations} activations)"
        for activations, rows in limits
    ]
    return "; ".join(phrases), any(rows >= 0 for _, rows in limits)


def linear_route(linears: Iterable[LinearTensors]) -> str:
    """How a model's linears run: how many on each ``linear_path``, the most first."""
    counts = Counter(linear_path(t) for t in linears).most_common()
    return "; ".join(f"{count} on {path}" for path, count in counts)


# Where a quantized head runs when the one-call decode loop takes a step (step_head.h).
HEAD_IN_STEP = "inside the one-call decode loop (its step team) when that takes the step"


def head_route(head: LinearTensors, *, in_step: bool = False) -> str:
    """Where the LM head runs (``linear_path``; ``in_step``: a quantized head inside the
    one-call decode loop too) and, off small_gemm, why: a vocabulary that is not a multiple
    of 16 leaves the head on another path than the layers."""
    path = linear_path(head)
    if head.quant is not None and in_step:
        return f"{path}; {HEAD_IN_STEP}"
    if head.small is not None or head.quant is not None:
        return path
    # oneDNN's copy stands for a weight it replaced (same shape and dtype).
    weight = head.weight if head.weight.numel() or head.packed is None else head.packed
    reason = small_gemm_refusal(weight, layer_ops())
    return path if reason is None else f"{path}; not small_gemm: {reason}"


def sampler_route(head: LinearTensors, *, in_head: bool = True, in_step: bool = False) -> str:
    """How tokens are picked: greedy ones (``in_head``: inside the LM head where the kernel
    allows; ``in_step``: a quantized head's argmax inside the one-call decode loop) and
    sampled ones (``sampled_route``)."""
    if layer_ops() is None:
        greedy = "greedy: torch argmax"
    elif in_head and head.small is not None and head.small.dtype == torch.bfloat16:
        isa = small_gemm_route(head.small.dtype)
        greedy = f"greedy: argmax inside the LM head (small_gemm_argmax, {isa})"
    elif head.quant is not None and in_step:
        greedy = (
            "greedy: C++ argmax_rows of the quantized head's logits; for plain greedy rows "
            f"(no grammar, no logprobs) {HEAD_IN_STEP}, where only the tokens come back"
        )
    else:
        greedy = "greedy: C++ argmax_rows over the logits"
    return f"{greedy}; {sampled_route()}"


def sampled_route() -> str:
    """How sampled tokens are drawn: temperature, softmax and the draw in ``sample_rows``
    (top_k / top_p / min_p filters on torch) wherever the kernels load (the sampler asks
    them itself, whatever the model's ops), else torch alone."""
    ops = layer_ops()
    if ops is None:
        return "sampled: torch softmax + blocked inverse CDF"
    return f"sampled: C++ sample_rows ({ops.sample_rows_isa()}), filters on torch"
