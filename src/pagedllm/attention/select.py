"""Choosing an attention backend by name."""

from __future__ import annotations

from pagedllm.attention.base import AttentionBackend
from pagedllm.attention.reference import ReferenceAttention

BACKENDS = ("auto", "cpu", "reference")


def get_backend(name: str = "auto") -> AttentionBackend:
    """``"reference"`` (gather + SDPA, the ground truth), ``"cpu"`` (fast CPU path: C++ kernel
    when it builds, torch otherwise) or ``"auto"`` (the fastest available: ``"cpu"`` today).
    """
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {name!r}")
    if name == "reference":
        return ReferenceAttention()
    from pagedllm.attention.cpu import CpuAttention

    return CpuAttention()
