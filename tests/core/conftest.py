"""Helpers shared by the core tests."""

from __future__ import annotations

from collections.abc import Iterable


def copy_blocks(pairs: Iterable[tuple[int, int]], src_tier: dict, dst_tier: dict, bs: int) -> None:
    """Copy (src, dst) blocks of a fake KV store keyed by (block, offset), all reads before
    the writes, as a batched copy on the worker would; a slot empty in src ends empty in dst."""
    pairs = list(pairs)
    contents = [
        {off: src_tier[src, off] for off in range(bs) if (src, off) in src_tier} for src, _ in pairs
    ]
    for (_, dst), content in zip(pairs, contents, strict=True):
        for off in range(bs):
            dst_tier.pop((dst, off), None)
        for off, value in content.items():
            dst_tier[dst, off] = value
