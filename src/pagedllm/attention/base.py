"""The attention contract shared by every backend.

A step's batch is flattened: sequence i owns query rows
``query_start_loc[i] : query_start_loc[i+1]``. Its context after this step has
``seq_lens[i]`` tokens; the query rows are the last ``query_lens[i]`` of them::

    positions   0 ........................ seq_len-1
                |<- already cached ->|<-- query -->|
                                      ^ seq_len - query_len

Query row j of sequence i sits at position ``seq_lens[i] - query_lens[i] + j`` and
attends causally to positions ``0 .. that position`` — or, in a layer whose
``AttentionKind`` has a ``sliding_window`` W, to the last W of them (its own included:
key position k is seen from query position p when ``p - W < k <= p``, as transformers'
sliding-window mask has it). Block-table entries wholly before every query's window are
never read, so a manager may have freed them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from pagedllm.attention.quant import QuantizedCache, QuantStep


@dataclass(frozen=True, slots=True)
class AttentionKind:
    """What a layer's attention does beyond causal softmax(q k^T * scale) v:
    ``sliding_window`` (see the module docstring) and ``softcap`` (Gemma 2: scores pass
    through ``softcap * tanh(scores / softcap)`` before the mask and softmax)."""

    sliding_window: int | None = None
    softcap: float | None = None

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, got {self.sliding_window}")
        if self.softcap is not None and self.softcap <= 0:
            raise ValueError(f"softcap must be positive, got {self.softcap}")

    @property
    def is_full(self) -> bool:
        return self.sliding_window is None and self.softcap is None

    def describe(self) -> str:
        """In words, for the routes: "sliding window 512", "soft-cap 50.0", both, or
        "full"."""
        parts = [] if self.sliding_window is None else [f"sliding window {self.sliding_window}"]
        parts += [] if self.softcap is None else [f"soft-cap {self.softcap:g}"]
        return ", ".join(parts) or "full"


FULL_ATTENTION = AttentionKind()


@dataclass(slots=True)
class AttentionMetadata:
    """Built once per step by the worker; shared by all layers."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [num_seqs] int32: context length including this step
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int32, padded with 0
    query_lens_list: list[int]  # the same figures as Python ints (no device sync)
    seq_lens_list: list[int]
    max_query_len: int
    max_seq_len: int
    # A quantized cache's write plan for this step (``attention/quant.py``); None for a
    # full-precision cache. With it, the layers' caches are ``QuantizedCache`` pairs.
    quant: QuantStep | None = None
    # A model whose layers are grouped by attention kind (``core/kv_groups.py``): the
    # metadata of groups 1.. (their own block tables and slots; this one is group 0's) and
    # each layer's group. Empty for one group.
    groups: tuple[AttentionMetadata, ...] = ()
    layer_groups: tuple[int, ...] = ()

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    def for_layer(self, layer: int) -> AttentionMetadata:
        """The metadata layer ``layer`` attends with: its group's block tables and slots."""
        if not self.layer_groups:
            return self
        group = self.layer_groups[layer]
        return self.groups[group - 1] if group else self


class AttentionBackend(Protocol):
    """Writes K/V of this step's tokens into the paged cache, then attends.

    Shapes: ``query`` [num_tokens, num_heads, head_dim]; ``key``/``value``
    [num_tokens, num_kv_heads, head_dim]; ``k_cache``/``v_cache``
    [num_blocks, block_size, num_kv_heads, head_dim]. Returns
    [num_tokens, num_heads, head_dim] in the dtype of ``query``. ``kind``: the layer's
    window and soft-capping (every backend honours both).
    With ``meta.quant`` set, ``k_cache``/``v_cache`` are ``QuantizedCache`` objects (sealed
    blocks dequantized, each query's own block in full precision: ``attention/quant.py``;
    full attention only).
    """

    name: str

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor | QuantizedCache,
        v_cache: torch.Tensor | QuantizedCache,
        meta: AttentionMetadata,
        scale: float,
        kind: AttentionKind = FULL_ATTENTION,
    ) -> torch.Tensor: ...

    def route(self, dtype: torch.dtype) -> str:
        """Which implementation attends for a model in ``dtype`` on this machine (for the
        start-up log, ``pagedllm env`` and ``/v1/cache``)."""
        ...

    def quant_route(self, dtype: torch.dtype, quantization: str) -> str:
        """``route`` over a cache quantized as ``quantization`` (``"int8"``, ``"int4"``,
        ...): its sealed blocks are read through a dequantizing path, not the plain one."""
        ...

    def kind_route(self, dtype: torch.dtype, kind: AttentionKind) -> str:
        """``route`` for the layers of ``kind`` (a window or soft-capping may take
        another implementation than full attention)."""
        ...

    def kernel_step(
        self,
        dtype: torch.dtype,
        num_heads: int,
        head_dim: int,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        kind: AttentionKind = FULL_ATTENTION,
    ) -> KernelStep | None:
        """The arguments with which pagedllm's C++ attention kernel (``paged_attention``)
        takes this whole step, K/V write included, exactly as ``forward`` would route it
        for layers of ``kind``;
        None when it does not (or the backend has no such kernel). The model's fast path
        then runs every layer of the step in one C++ call (``decoder_layers``)."""
        ...

    def quant_kernel_step(
        self,
        dtype: torch.dtype,
        head_dim: int,
        k_cache: QuantizedCache,
        v_cache: QuantizedCache,
        meta: AttentionMetadata,
        kind: AttentionKind = FULL_ATTENTION,
    ) -> QuantKernelStep | None:
        """``kernel_step`` over a quantized cache (``meta.quant`` set): the arguments with
        which the C++ ``quant_write`` and ``quant_attention`` take this whole step, as
        ``forward`` would run it; None when they do not. The model's fast path then runs
        every layer of the step in one C++ call (``quant_decoder_layers``)."""
        ...


@dataclass(frozen=True, slots=True)
class KernelStep:
    """A step that ``paged_attention`` takes whole: the step's tables as the kernel takes
    them (int32, unit last stride) and the kernel's settings."""

    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    handled: torch.Tensor  # bool [num_seqs]: the sequences the kernel computes (all)
    rows_per_task: int
    fast_bf16: bool
    use_amx: bool


@dataclass(frozen=True, slots=True)
class QuantKernelStep:
    """A step over a quantized cache that ``quant_write`` and ``quant_attention`` take
    whole: the step's tables as the kernel takes them (int32, unit last stride); the write
    plan is the step's ``QuantStep``."""

    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter this step's K/V rows into their cache slots."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(v_cache.dtype))
