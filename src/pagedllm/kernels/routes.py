"""How a model's linears and sampler run on pagedllm's kernels, in words for ``Routes``."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

import torch

from pagedllm.kernels.linear import LinearTensors, small_gemm_max_rows
from pagedllm.kernels.ops import layer_ops
from pagedllm.kernels.quant import QUANT_GEMM_MAX_ROWS


def small_gemm_route(dtype: torch.dtype, ops: Any) -> str:
    """The ISA ``small_gemm`` runs ``dtype`` on: bf16 "amx" or "avx512_bf16", float32
    "avx512" or "avx2" ("none" where it has none)."""
    return ops.small_gemm_isa() if dtype == torch.bfloat16 else ops.small_gemm_f32_isa()


def linear_route(linears: Iterable[LinearTensors], ops: Any) -> str:
    """How a model's linears run: how many on pagedllm's own kernel (and up to how many
    rows), on oneDNN's packed layout, or on plain torch."""
    small = onednn = plain = 0
    example = None
    formats: Counter[str] = Counter()
    for t in linears:
        if t.quant is not None:
            formats[t.quant.format] += 1
        elif t.small is not None:
            small, example = small + 1, t.small
        elif t.packed is not None:
            onednn += 1
        else:
            plain += 1
    parts = [quant_route(formats, ops)] if formats else []
    if example is not None:
        beyond = "oneDNN" if example.dtype == torch.bfloat16 else "torch"
        isa = small_gemm_route(example.dtype, ops)
        rows = small_gemm_max_rows(example)
        parts.append(f"{small} on own kernel small_gemm ({isa}) up to {rows} rows, {beyond} beyond")
    if onednn:
        parts.append(f"{onednn} on oneDNN (packed bf16)")
    if plain:
        parts.append(f"{plain} on torch F.linear")
    return "; ".join(parts)


def quant_route(formats: Counter[str], ops: Any) -> str:
    """How the linears kept quantized run: "7 kept quantized (Q4_1 x7) on own kernel
    quant_gemm (avx512_vnni) up to 16 rows, dequantised tiles on torch beyond"."""
    counts = ", ".join(f"{name} x{n}" for name, n in sorted(formats.items()))
    kept = f"{formats.total()} kept quantized ({counts})"
    if ops is None:
        return f"{kept}, dequantised per call on torch (no C++ kernels)"
    return (
        f"{kept} on own kernel quant_gemm ({ops.quant_gemm_isa()}) up to "
        f"{QUANT_GEMM_MAX_ROWS} rows, dequantised tiles on torch beyond"
    )


def sampler_route(head: LinearTensors, ops: Any, *, in_head: bool = True) -> str:
    """How tokens are picked: greedy ones (``in_head``: inside the LM head where the kernel
    allows) and sampled ones (``sampled_route``)."""
    if ops is None:
        greedy = "greedy: torch argmax"
    elif in_head and head.small is not None and head.small.dtype == torch.bfloat16:
        isa = small_gemm_route(head.small.dtype, ops)
        greedy = f"greedy: argmax inside the LM head (small_gemm_argmax, {isa})"
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
