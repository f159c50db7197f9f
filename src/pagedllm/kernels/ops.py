"""The non-attention C++ ops as Python calls, each with its torch fallback."""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.kernels.build import load_library


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` for 2-D CPU logits, ~10x faster through the C++ kernel
    (same result: the first index of the maximum)."""
    if (
        logits.device.type == "cpu"
        and logits.dim() == 2
        and logits.dtype in (torch.float32, torch.bfloat16)
        and logits.shape[1] > 0
        and logits.stride(1) == 1
        and load_library()
    ):
        return torch.ops.pagedllm.argmax_rows(logits)
    return logits.argmax(-1)


def layer_ops() -> Any | None:
    """``torch.ops.pagedllm`` when the C++ kernels load, else ``None``: fused layer ops
    ``rms_norm(x, w, eps)``, ``add_rms_norm(x, residual, w, eps)`` (residual += x in place),
    ``rope_(q, k, cos, sin)`` (in place), ``silu_mul(gate_up)``, ``argmax_rows(logits)``.
    Each rounds where the unfused torch expression rounds."""
    return torch.ops.pagedllm if load_library() else None
