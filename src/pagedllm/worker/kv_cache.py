"""The KV tensors, per layer ``[num_blocks, block_size, num_kv_heads, head_dim]``.

Two tiers: the device tier the model attends over, and a host tier (CPU, pinned when
a GPU exists) that holds the blocks of requests preempted by swapping. Block ids are
indices into the first dimension of every *per-block tensor* (K and V of each layer,
and whatever else a cache format keeps per block); the scheduler decides them, this
module only moves bytes, always through the whole list of per-block tensors.

The device tier can be resized at run time (``KVCache.resize``, after the core's
compaction emptied the blocks being dropped): on the CPU a ``BlockArena`` reserves
address space for the largest size and gives the tail back to the kernel; elsewhere
the tensors are re-allocated and the kept blocks copied.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.attention.base import AttentionMetadata
from pagedllm.core.kv_groups import kv_cache_layout
from pagedllm.kv_dtypes import QUANTIZED_KV_DTYPES, check_kv_cache_dtype, kv_bytes_per_block
from pagedllm.worker.allocator import BlockArena, total_memory_bytes

KVPairs = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """Shape and size of the KV cache of one model.

    ``dtype`` is the cache's element type, or with ``quantization`` (a quantized
    ``kv_cache_dtype``: ``int8``, ``int4``, ``fp8_e4m3``, ``fp8_e5m2``) the full-precision
    type of open blocks and dequantized reads (the model's). ``unquantized_first_block``
    (quantized only): logical block 0 of every table is never sealed; it keeps its staging
    slot, and attention reads it in full precision.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype = torch.float32
    # Multi-head latent attention: one tensor per layer holding each token's latent and
    # rope key (``head_dim`` = kv_lora_rank + qk_rope_head_dim, one "head"), read as both K
    # and V; no per-head K/V.
    latent: bool = False
    quantization: str | None = None
    # A model whose layers are grouped by attention kind (``core/kv_groups.py``): a block
    # holds ``num_layers`` layer slots of one group, and model layer l uses slot
    # ``layer_slots[l]`` (of the blocks in its group's tables). Empty: layer l is slot l.
    layer_slots: tuple[int, ...] = ()
    layer_groups: tuple[int, ...] = ()  # each model layer's group (empty: one group)
    unquantized_first_block: bool = False

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if any(not 0 <= slot < self.num_layers for slot in self.layer_slots):
            raise ValueError(f"layer_slots must lie in [0, {self.num_layers})")
        if self.layer_slots and self.quantization is not None:
            raise ValueError(
                "a quantized KV cache does not take models mixing sliding-window and "
                "full-attention layers yet (use kv_cache_dtype auto, float32 or bfloat16)"
            )
        if self.unquantized_first_block and self.quantization is None:
            raise ValueError("unquantized_first_block needs a quantized kv_cache_dtype")
        if self.quantization is not None:
            if self.latent:
                raise ValueError("a quantized KV cache does not take latent (MLA) layers")
            kv_bytes_per_block(self.quantization, **self._geometry())  # validates

    @classmethod
    def from_model_config(
        cls,
        config: object,
        block_size: int,
        dtype: torch.dtype = torch.float32,
        quantization: str | None = None,
        unquantized_first_block: bool = False,
    ) -> KVCacheSpec:
        """From a ``ModelConfig`` (HF field names)."""
        mla = config.mla  # type: ignore[attr-defined]
        if mla is not None and quantization is not None:
            raise ValueError("kv_cache_dtype: a quantized cache does not take latent (MLA) layers")
        if mla is not None:
            return cls(
                num_layers=config.num_hidden_layers,  # type: ignore[attr-defined]
                num_kv_heads=1,
                head_dim=mla.latent_dim,
                block_size=block_size,
                dtype=dtype,
                latent=True,
            )
        layout = kv_cache_layout(config.sliding_windows)  # type: ignore[attr-defined]
        grouped = len(layout.groups) > 1
        return cls(
            num_layers=layout.layers_per_block,
            num_kv_heads=config.num_key_value_heads,  # type: ignore[attr-defined]
            head_dim=config.head_dim,  # type: ignore[attr-defined]
            block_size=block_size,
            dtype=dtype,
            quantization=quantization,
            unquantized_first_block=unquantized_first_block,
            layer_slots=layout.layer_slots if grouped else (),
            layer_groups=layout.layer_groups if grouped else (),
        )

    def layer_caches(self, pairs: KVPairs) -> KVPairs:
        """(K, V) of each model layer from those of each layer slot."""
        return [pairs[slot] for slot in self.layer_slots] if self.layer_slots else pairs

    @property
    def block_shape(self) -> tuple[int, int, int]:
        return (self.block_size, self.num_kv_heads, self.head_dim)

    def block_layouts(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """Shape past the block dimension and dtype of every per-block tensor, in
        order: K and V of layer 0, K and V of layer 1, ... (a latent cache: one per layer)."""
        return [(self.block_shape, self.dtype)] * (self.tensors_per_layer * self.num_layers)

    @property
    def tensors_per_layer(self) -> int:
        return 1 if self.latent else 2

    @property
    def bytes_per_token(self) -> float:
        """K and V (or the latent) of one token across all layers, scales included (a
        block's share of per-block scales: a fraction when they do not divide evenly)."""
        if self.quantization is not None:
            per_block = self.bytes_per_block
            whole = per_block % self.block_size == 0
            return per_block // self.block_size if whole else per_block / self.block_size
        element = torch.empty((), dtype=self.dtype).element_size()
        per_layer = self.tensors_per_layer * self.num_kv_heads * self.head_dim
        return self.num_layers * per_layer * element

    @property
    def bytes_per_block(self) -> int:
        if self.quantization is not None:
            return kv_bytes_per_block(self.quantization, **self._geometry())
        return int(self.bytes_per_token) * self.block_size

    @property
    def element_bytes(self) -> float:
        """Average bytes per cached element, scales included."""
        elements = self.tensors_per_layer * self.num_layers * self.num_kv_heads * self.head_dim
        return self.bytes_per_block / (elements * self.block_size)

    @property
    def staging_bytes_per_slot(self) -> int:
        """One open block in full precision (a quantized cache's staging slot), all layers."""
        element = torch.empty((), dtype=self.dtype).element_size()
        per_layer = self.tensors_per_layer * self.num_kv_heads * self.head_dim
        return self.num_layers * per_layer * element * self.block_size

    def _geometry(self) -> dict[str, int]:
        return {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "block_size": self.block_size,
        }

    def num_blocks_for_bytes(self, num_bytes: int) -> int:
        return max(0, int(num_bytes) // self.bytes_per_block)


FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cache_dtypes(kv_cache_dtype: str, model_dtype: torch.dtype) -> tuple[torch.dtype, str | None]:
    """``KVCacheSpec``'s ``(dtype, quantization)`` for a ``kv_cache_dtype`` name: ``auto``
    is the model's dtype; a quantized name stages open blocks in the model's dtype."""
    check_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype == "auto":
        return model_dtype, None
    if kv_cache_dtype in FLOAT_DTYPES:
        return FLOAT_DTYPES[kv_cache_dtype], None
    assert kv_cache_dtype in QUANTIZED_KV_DTYPES
    if kv_cache_dtype.startswith("fp8") and not _fp8_supported(kv_cache_dtype):
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}: this torch cannot convert to it")
    return model_dtype, kv_cache_dtype


def _fp8_supported(name: str) -> bool:
    dtype = getattr(torch, "float8_e4m3fn" if name == "fp8_e4m3" else "float8_e5m2", None)
    if dtype is None:
        return False
    try:
        torch.ones(2).to(dtype).float()
    except (RuntimeError, TypeError):
        return False
    return True


def check_tier_sizes(num_blocks: int, num_host_blocks: int) -> None:
    if num_blocks <= 0:
        raise ValueError(f"num_blocks must be positive, got {num_blocks}")
    if num_host_blocks < 0:
        raise ValueError(f"num_host_blocks must be >= 0, got {num_host_blocks}")


def available_memory_bytes(device: torch.device | str = "cpu") -> int:
    """Free memory now: ``cudaMemGetInfo`` on a GPU, ``MemAvailable`` on the host."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def num_blocks_from_budget(
    spec: KVCacheSpec,
    *,
    kv_cache_memory: int | None = None,
    memory_fraction: float | None = None,
    device: torch.device | str = "cpu",
) -> int:
    """Blocks that fit in ``kv_cache_memory`` bytes, or in ``memory_fraction`` of free memory."""
    if kv_cache_memory is not None:
        if kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {kv_cache_memory}")
        return spec.num_blocks_for_bytes(kv_cache_memory)
    if memory_fraction is None or not 0.0 < memory_fraction <= 1.0:
        raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
    return spec.num_blocks_for_bytes(int(available_memory_bytes(device) * memory_fraction))


class KVCache:
    """The per-block tensors of both tiers; the device tier is resizable."""

    def __init__(
        self,
        spec: KVCacheSpec,
        num_blocks: int,
        num_host_blocks: int = 0,
        device: torch.device | str = "cpu",
        *,
        max_num_blocks: int | None = None,
    ) -> None:
        check_tier_sizes(num_blocks, num_host_blocks)
        self.spec = spec
        self.num_blocks = num_blocks
        self.num_host_blocks = num_host_blocks
        self.device = torch.device(device)
        self.arena: BlockArena | None = None
        if self.device.type == "cpu":
            # Address space for the largest size the cache may grow to (the machine's
            # memory unless told): reserving it commits nothing.
            capacity = max_num_blocks or max(1, total_memory_bytes() // spec.bytes_per_block)
            self.arena = BlockArena(spec.block_layouts(), num_blocks, max(capacity, num_blocks))
            self.device_tensors = self.arena.tensors
        else:
            self.device_tensors = allocate_block_tensors(spec, num_blocks, self.device)
        pin = self.device.type == "cuda"
        self.host_tensors = allocate_block_tensors(
            spec, num_host_blocks, torch.device("cpu"), pin=pin
        )
        self.device_caches = spec.layer_caches(_pairs(self.device_tensors, spec.latent))
        self.host_caches = spec.layer_caches(_pairs(self.host_tensors, spec.latent))

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy device blocks src -> dst (copy-on-write, compaction), every per-block tensor."""
        copy_blocks(self.device_tensors, pairs)

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        """(device block, host block) pairs."""
        swap_blocks(self.device_tensors, self.host_tensors, pairs)

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        """(host block, device block) pairs."""
        swap_blocks(self.host_tensors, self.device_tensors, pairs)

    # A full-precision cache writes every token straight into its slot: nothing to plan,
    # stage or release (``QuantizedKVCache`` does all three).

    def plan_step(self, meta: AttentionMetadata, drafts: Sequence[int] = ()) -> None:
        return None

    def finish_step(self) -> None:
        pass

    def settle_drafts(self, num_verified: Sequence[int]) -> None:
        """Nothing to settle: a rejected draft's rows are simply overwritten later."""

    def release_blocks(self, block_ids: Collection[int], keep: Collection[int] = ()) -> None:
        pass

    def read_blocks(self, block_ids: Sequence[int]) -> np.ndarray:
        """Device blocks as flat bytes, one row a block (every per-block tensor's block in
        turn: layer 0's K then V, ..., then any scales): a copy ``[n, bytes per block]``
        uint8, for the disk tier. On the CPU the gathers run in numpy (several times
        torch's byte copies here); ``read_blocks_reference`` is the ground truth."""
        if self.device.type != "cpu":
            return read_blocks_reference(self.device_tensors, block_ids)
        views = _byte_rows(self.device_tensors)
        rows = np.empty((len(block_ids), sum(v.shape[1] for v in views)), np.uint8)
        ids = np.asarray(block_ids, dtype=np.intp)
        start = 0
        for view in views:
            np.take(view, ids, axis=0, out=rows[:, start : start + view.shape[1]])
            start += view.shape[1]
        return rows

    def write_blocks(self, block_ids: Sequence[int], data: np.ndarray) -> None:
        """Overwrite device blocks with rows of ``read_blocks``' layout."""
        if self.device.type != "cpu":
            write_blocks_reference(self.device_tensors, block_ids, data)
            return
        ids = np.asarray(block_ids, dtype=np.intp)
        start = 0
        for view in _byte_rows(self.device_tensors):
            view[ids] = data[:, start : start + view.shape[1]]
            start += view.shape[1]

    def resize(self, num_blocks: int) -> None:
        """Keep device blocks ``0 .. num_blocks - 1`` (those past a smaller size must hold
        nothing anyone reads: the core compacted them away). In place within the arena's
        capacity; past it (or off the CPU) by re-allocating and copying the kept blocks."""
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if self.arena is not None and num_blocks <= self.arena.capacity:
            self.arena.resize(num_blocks)
            tensors = self.arena.tensors
        else:
            kept = min(num_blocks, self.num_blocks)
            if self.arena is not None:
                arena = BlockArena(self.spec.block_layouts(), num_blocks, num_blocks)
                tensors = arena.tensors
            else:
                tensors = allocate_block_tensors(self.spec, num_blocks, self.device)
            for new, old in zip(tensors, self.device_tensors, strict=True):
                new[:kept].copy_(old[:kept])
            if self.arena is not None:
                self.arena = arena
        self.device_tensors = tensors
        self.device_caches = self.spec.layer_caches(_pairs(tensors, self.spec.latent))
        self.num_blocks = num_blocks


def allocate_block_tensors(
    spec: KVCacheSpec, num_blocks: int, device: torch.device, *, pin: bool = False
) -> list[torch.Tensor]:
    """Zeroed per-block tensors (``spec.block_layouts()``); zeros keep padding harmless
    and runs reproducible."""
    return [
        torch.zeros((num_blocks, *shape), dtype=dtype, device=device, pin_memory=pin)
        for shape, dtype in spec.block_layouts()
    ]


def _byte_rows(tensors: Sequence[torch.Tensor]) -> list[np.ndarray]:
    """Each per-block tensor as a numpy ``[num_blocks, bytes per block]`` uint8 view
    (shared memory; made per call, so a resized cache is always seen as it is)."""
    return [t.view(t.shape[0], -1).view(torch.uint8).numpy() for t in tensors]


def read_blocks_reference(tensors: Sequence[torch.Tensor], block_ids: Sequence[int]) -> np.ndarray:
    """``KVCache.read_blocks`` in plain torch, on any device (the ground truth)."""
    ids = torch.tensor(block_ids, dtype=torch.int64, device=tensors[0].device)
    parts = [t.index_select(0, ids).reshape(len(block_ids), -1).view(torch.uint8) for t in tensors]
    return torch.cat(parts, dim=1).cpu().numpy()


def write_blocks_reference(
    tensors: Sequence[torch.Tensor], block_ids: Sequence[int], data: np.ndarray
) -> None:
    """``KVCache.write_blocks`` in plain torch, on any device (the ground truth)."""
    device = tensors[0].device
    rows = torch.from_numpy(np.ascontiguousarray(data)).to(device)
    ids = torch.tensor(block_ids, dtype=torch.int64, device=device)
    start = 0
    for t in tensors:
        size = t[0].numel() * t.element_size()
        part = rows[:, start : start + size].contiguous().view(t.dtype)
        t.index_copy_(0, ids, part.view(len(block_ids), *t.shape[1:]))
        start += size


def allocate_caches(
    spec: KVCacheSpec, num_blocks: int, device: torch.device, *, pin: bool = False
) -> KVPairs:
    """Zeroed K and V per layer: on the CPU in a ``BlockArena`` (transparent huge pages)."""
    if device.type == "cpu" and not pin:
        tensors = BlockArena(spec.block_layouts(), num_blocks, num_blocks).tensors
        return _pairs(tensors, spec.latent)
    return _pairs(allocate_block_tensors(spec, num_blocks, device, pin=pin), spec.latent)


def _pairs(tensors: list[torch.Tensor], latent: bool = False) -> KVPairs:
    """(K, V) per layer from the per-block tensors (K and V lead each layer's entries); a
    latent layer's one tensor stands as both."""
    if latent:
        return [(t, t) for t in tensors]
    return [(tensors[2 * i], tensors[2 * i + 1]) for i in range(len(tensors) // 2)]


def copy_blocks(tensors: Sequence[torch.Tensor], pairs: Sequence[tuple[int, int]]) -> None:
    """All sources are read before any destination is written."""
    if not pairs:
        return
    device = tensors[0].device
    src = torch.tensor([s for s, _ in pairs], dtype=torch.int64, device=device)
    dst = torch.tensor([d for _, d in pairs], dtype=torch.int64, device=device)
    for tensor in tensors:
        tensor.index_copy_(0, dst, tensor.index_select(0, src))


def swap_blocks(
    src_tensors: Sequence[torch.Tensor],
    dst_tensors: Sequence[torch.Tensor],
    pairs: Sequence[tuple[int, int]],
) -> None:
    """Move blocks between tiers (possibly different devices): (src block, dst block)."""
    if not pairs:
        return
    if not src_tensors or src_tensors[0].shape[0] == 0 or dst_tensors[0].shape[0] == 0:
        raise ValueError("swap requested but the host tier has no blocks (num_host_blocks=0)")
    src_device, dst_device = src_tensors[0].device, dst_tensors[0].device
    src = torch.tensor([s for s, _ in pairs], dtype=torch.int64, device=src_device)
    dst = torch.tensor([d for _, d in pairs], dtype=torch.int64, device=dst_device)
    for src_t, dst_t in zip(src_tensors, dst_tensors, strict=True):
        dst_t.index_copy_(0, dst, src_t.index_select(0, src).to(dst_device))
