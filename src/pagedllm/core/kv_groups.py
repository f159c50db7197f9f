"""KV cache groups: a model's layers grouped by attention kind, one block table each.

A model whose layers all attend alike (all full, or all sliding with one window) has one
group, and a block holds a token range of every layer. A model mixing kinds (Gemma 2/3:
local layers with a window beside global ones; Qwen2 with ``max_window_layers``) has
several: the full layers read every position while the sliding ones read only the last W,
so each group keeps its own block table per request, drawn from the one shared pool, and
a sliding group frees the blocks its window passed while the full group keeps its own.

For the groups to share one pool every block must have the same size, so the layers of
each kind are cut into groups of ``layers_per_block`` layers (vLLM's KV cache groups do
the same): a block holds a token range of one group's layers, and layer ``l`` reads and
writes slot ``slot_of(l)`` of the blocks in its group's table. Gemma-3-270m (15 local
layers, 3 global)::

    group 0  full         layers  5 11 17   (slots 0 1 2)
    group 1  window 512   layers  0  1  2
    ...
    group 5  window 512   layers 12 13 14

``layers_per_block`` is the greatest common divisor of the kinds' layer counts: no slot
is left unused (vLLM may pad to make fewer, larger groups; more groups only cost more
tables here, never memory).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    """Layers that share block tables: their window (None: full attention), in order."""

    sliding_window: int | None
    layers: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class KVCacheLayout:
    """The groups of one model, and where each layer's K/V sit within a block."""

    groups: tuple[KVCacheGroup, ...]
    layers_per_block: int
    num_layers: int

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Each group's window (None: full attention)."""
        return tuple(group.sliding_window for group in self.groups)

    @property
    def layer_groups(self) -> tuple[int, ...]:
        """The group of each model layer."""
        found = [0] * self.num_layers
        for index, group in enumerate(self.groups):
            for layer in group.layers:
                found[layer] = index
        return tuple(found)

    @property
    def layer_slots(self) -> tuple[int, ...]:
        """Each model layer's slot (its place among its group's layers) within a block."""
        found = [0] * self.num_layers
        for group in self.groups:
            for slot, layer in enumerate(group.layers):
                found[layer] = slot
        return tuple(found)


def kv_cache_layout(layer_windows: Sequence[int | None]) -> KVCacheLayout:
    """The groups for a model whose layer ``l`` has window ``layer_windows[l]`` (None: full).

    One kind: one group of every layer. Several: full layers first, then each window in
    increasing order, each kind cut into groups of ``layers_per_block`` layers."""
    if not layer_windows:
        raise ValueError("a model needs at least one layer")
    for window in layer_windows:
        if window is not None and window <= 0:
            raise ValueError(f"sliding windows must be positive, got {window}")
    kinds: dict[int | None, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        kinds.setdefault(window, []).append(layer)
    order = sorted(kinds, key=lambda w: (w is not None, w or 0))
    if len(order) == 1:
        only = order[0]
        group = KVCacheGroup(only, tuple(kinds[only]))
        return KVCacheLayout((group,), len(layer_windows), len(layer_windows))
    size = math.gcd(*(len(kinds[w]) for w in order))
    groups = tuple(
        KVCacheGroup(window, tuple(kinds[window][i : i + size]))
        for window in order
        for i in range(0, len(kinds[window]), size)
    )
    return KVCacheLayout(groups, size, len(layer_windows))
