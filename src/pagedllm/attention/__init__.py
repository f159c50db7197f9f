"""Paged attention behind one Protocol: write this step's K/V into their slots, then attend."""

from pagedllm.attention.base import AttentionBackend, AttentionMetadata
from pagedllm.attention.reference import ReferenceAttention

__all__ = ["AttentionBackend", "AttentionMetadata", "ReferenceAttention"]
