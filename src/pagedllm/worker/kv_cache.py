"""The KV tensors: allocated once, per layer ``[num_blocks, block_size, num_kv_heads, head_dim]``.

Two tiers: the device tier the model attends over, and a host tier (CPU, pinned when
a GPU exists) that holds the blocks of requests preempted by swapping. Block ids are
indices into the first dimension; the scheduler decides them, this module only moves
bytes.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.worker.allocator import zeros_on_huge_pages

KVPairs = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """Shape and size of the KV cache of one model."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @classmethod
    def from_model_config(
        cls, config: object, block_size: int, dtype: torch.dtype = torch.float32
    ) -> KVCacheSpec:
        """From a ``ModelConfig`` (HF field names)."""
        return cls(
            num_layers=config.num_hidden_layers,  # type: ignore[attr-defined]
            num_kv_heads=config.num_key_value_heads,  # type: ignore[attr-defined]
            head_dim=config.head_dim,  # type: ignore[attr-defined]
            block_size=block_size,
            dtype=dtype,
        )

    @property
    def block_shape(self) -> tuple[int, int, int]:
        return (self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token across all layers."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def num_blocks_for_bytes(self, num_bytes: int) -> int:
        return max(0, int(num_bytes) // self.bytes_per_block)


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
    """Per-layer K and V tensors of both tiers, allocated once."""

    def __init__(
        self,
        spec: KVCacheSpec,
        num_blocks: int,
        num_host_blocks: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {num_host_blocks}")
        self.spec = spec
        self.num_blocks = num_blocks
        self.num_host_blocks = num_host_blocks
        self.device = torch.device(device)
        self.device_caches = allocate_caches(spec, num_blocks, self.device)
        pin = self.device.type == "cuda"
        self.host_caches = allocate_caches(spec, num_host_blocks, torch.device("cpu"), pin=pin)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy device blocks src -> dst (copy-on-write), every layer, K and V."""
        copy_blocks(self.device_caches, pairs)

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        """(device block, host block) pairs."""
        swap_blocks(self.device_caches, self.host_caches, pairs)

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        """(host block, device block) pairs."""
        swap_blocks(self.host_caches, self.device_caches, pairs)

    def read_blocks(self, block_ids: Sequence[int]) -> np.ndarray:
        """Device blocks as flat bytes, one row a block (every layer's K then V): a copy
        ``[n, spec.bytes_per_block]`` uint8, for the disk tier."""
        spec = self.spec
        ids = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        shape = (len(block_ids), spec.num_layers, 2, *spec.block_shape)
        rows = torch.empty(shape, dtype=spec.dtype, device=self.device)
        for layer, (k_cache, v_cache) in enumerate(self.device_caches):
            rows[:, layer, 0] = k_cache.index_select(0, ids)
            rows[:, layer, 1] = v_cache.index_select(0, ids)
        return rows.reshape(len(block_ids), -1).view(torch.uint8).cpu().numpy()

    def write_blocks(self, block_ids: Sequence[int], data: np.ndarray) -> None:
        """Overwrite device blocks with rows of ``read_blocks``' layout."""
        spec = self.spec
        rows = torch.from_numpy(np.ascontiguousarray(data)).view(spec.dtype)
        rows = rows.view(len(block_ids), spec.num_layers, 2, *spec.block_shape).to(self.device)
        ids = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        for layer, (k_cache, v_cache) in enumerate(self.device_caches):
            k_cache.index_copy_(0, ids, rows[:, layer, 0])
            v_cache.index_copy_(0, ids, rows[:, layer, 1])


def allocate_caches(
    spec: KVCacheSpec, num_blocks: int, device: torch.device, *, pin: bool = False
) -> KVPairs:
    """Zeroed K and V per layer; zeros keep padding harmless and runs reproducible. On the
    CPU, views of one allocation on transparent huge pages (``zeros_on_huge_pages``)."""
    shape = (num_blocks, *spec.block_shape)
    if device.type == "cpu" and not pin:
        whole = zeros_on_huge_pages((spec.num_layers, 2, *shape), spec.dtype)
        return [(layer[0], layer[1]) for layer in whole]
    return [
        (
            torch.zeros(shape, dtype=spec.dtype, device=device, pin_memory=pin),
            torch.zeros(shape, dtype=spec.dtype, device=device, pin_memory=pin),
        )
        for _ in range(spec.num_layers)
    ]


def copy_blocks(caches: KVPairs, pairs: Sequence[tuple[int, int]]) -> None:
    """All sources are read before any destination is written."""
    if not pairs:
        return
    device = caches[0][0].device
    src = torch.tensor([s for s, _ in pairs], dtype=torch.int64, device=device)
    dst = torch.tensor([d for _, d in pairs], dtype=torch.int64, device=device)
    for k_cache, v_cache in caches:
        k_cache.index_copy_(0, dst, k_cache.index_select(0, src))
        v_cache.index_copy_(0, dst, v_cache.index_select(0, src))


def swap_blocks(src_caches: KVPairs, dst_caches: KVPairs, pairs: Sequence[tuple[int, int]]) -> None:
    """Move blocks between tiers (possibly different devices): (src block, dst block)."""
    if not pairs:
        return
    if not src_caches or src_caches[0][0].shape[0] == 0 or dst_caches[0][0].shape[0] == 0:
        raise ValueError("swap requested but the host tier has no blocks (num_host_blocks=0)")
    src_device, dst_device = src_caches[0][0].device, dst_caches[0][0].device
    src = torch.tensor([s for s, _ in pairs], dtype=torch.int64, device=src_device)
    dst = torch.tensor([d for _, d in pairs], dtype=torch.int64, device=dst_device)
    for (src_k, src_v), (dst_k, dst_v) in zip(src_caches, dst_caches, strict=True):
        dst_k.index_copy_(0, dst, src_k.index_select(0, src).to(dst_device))
        dst_v.index_copy_(0, dst, src_v.index_select(0, src).to(dst_device))
