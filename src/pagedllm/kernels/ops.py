"""The non-attention C++ ops as Python calls, each with its torch fallback."""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.kernels.build import load_library


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` for 2-D CPU logits, through the vectorised C++ kernel
    (same result: the first index of the maximum)."""
    if _kernel_rows(logits):
        return torch.ops.pagedllm.argmax_rows(logits)
    return logits.argmax(-1)


def sample_rows(
    logits: torch.Tensor, inv_temperature: torch.Tensor, uniform: torch.Tensor
) -> torch.Tensor | None:
    """One draw per row from softmax(logits * inv_temperature) for the uniform numbers
    ``uniform`` (float32 [rows], in [0, 1)) through the C++ kernel, reading float32 or bf16
    logits as they are (the draw ``softmax`` + ``inverse_cdf_blocked`` make, up to
    rounding); ``None`` where the kernel does not apply or a row's largest logit is not
    finite (then use the torch pipeline)."""
    if not _kernel_rows(logits):
        return None
    tokens = torch.ops.pagedllm.sample_rows(logits, inv_temperature, uniform)
    return None if bool((tokens < 0).any()) else tokens


def _kernel_rows(logits: torch.Tensor) -> bool:
    """True when the row kernels take ``logits``: 2-D CPU float32 / bf16 rows of unit
    stride, and the C++ library loads."""
    return (
        logits.device.type == "cpu"
        and logits.dim() == 2
        and logits.dtype in (torch.float32, torch.bfloat16)
        and logits.shape[1] > 0
        and logits.stride(1) == 1
        and load_library()
    )


def layer_ops() -> Any | None:
    """``torch.ops.pagedllm`` when the C++ kernels load, else ``None``: fused layer ops
    ``rms_norm(x, w, eps)``, ``add_rms_norm(x, residual, w, eps)`` (residual += x in place),
    ``rope_(q, k, cos, sin)`` (in place), ``silu_mul(gate_up)``, ``gelu_tanh_mul(gate_up)``
    (Gemma's gating, closer to the function than ATen's float32 form), ``argmax_rows(logits)``.
    Each rounds where the unfused torch expression rounds."""
    return torch.ops.pagedllm if load_library() else None
