"""``KVPlan``: every size of the KV cache, decided once per engine.

``plan_kv_cache`` makes it from the config, the model's cache layout (``KVCacheSpec``) and
the free device memory; ``engine/builder.py`` calls it once and hands the same object to
the runner, the block managers, the elastic pool and the start-up report. An engine built
around a runner made by hand (tests, ``FakeModelRunner``) takes that runner's sizes as
given (``plan_of_runner``); the rules for the tiers beside the pool are the same ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedllm.engine.config import DEFAULT_KV_CACHE_MEMORY, EngineConfig
from pagedllm.worker.base import ModelRunner, ResizableRunner, SupportsDiskTier
from pagedllm.worker.disk_store import disk_file_nbytes

if TYPE_CHECKING:
    from pagedllm.worker.kv_cache import KVCacheSpec


@dataclass(frozen=True, slots=True)
class KVPlan:
    """The cache's layout and the size of each tier, in blocks.

    ``num_blocks`` is the device tier at start-up; with ``--kv-cache-memory MIN:MAX`` it is
    the elastic pool's MIN and ``max_num_blocks`` its MAX (else both are the same).
    ``spec`` is None for a runner without KV tensors (the fake runner);
    ``device_memory_bytes`` the free memory the cache was carved from (None: not read).
    """

    spec: KVCacheSpec | None
    block_size: int
    num_blocks: int
    num_host_blocks: int
    num_disk_blocks: int  # 0 without a disk tier (kv_offload_dir)
    max_num_blocks: int
    elastic: bool
    device_memory_bytes: int | None = None

    @property
    def kv_cache_dtype(self) -> str | None:
        """The cache's format: its dtype name, or the quantization (None: no tensors)."""
        if self.spec is None:
            return None
        return self.spec.quantization or str(self.spec.dtype).removeprefix("torch.")

    @property
    def bytes_per_token(self) -> float | None:
        """What a token takes in the cache's tensors, scales included (None: no tensors)."""
        return None if self.spec is None else self.spec.bytes_per_token


def plan_kv_cache(
    config: EngineConfig, spec: KVCacheSpec, device_memory_bytes: int | None
) -> KVPlan:
    """The plan of a model's cache: the device tier from ``num_blocks``, else the byte
    budget, else a fraction of ``device_memory_bytes``; the host tier from
    ``num_host_blocks`` or ``swap_memory``. A quantized cache's staging slots (and
    unquantized first blocks) live beside the pool and are not counted in it."""
    block_bytes = spec.bytes_per_block
    num_blocks = config.num_blocks
    if num_blocks is None:
        num_blocks = _blocks_in_budget(config, spec, device_memory_bytes)
    num_host_blocks = config.num_host_blocks
    if num_host_blocks is None:
        num_host_blocks = config.swap_memory // block_bytes
    # A block on disk holds what a device block does.
    return _plan(
        config, spec, num_blocks, num_host_blocks, block_bytes, block_bytes, device_memory_bytes
    )


def plan_of_runner(config: EngineConfig, runner: ModelRunner) -> KVPlan:
    """The plan of a runner built by hand: its tiers as it made them, the disk tier and
    the elastic MAX by the same rules as ``plan_kv_cache``."""
    block_bytes = runner.kv_block_bytes if isinstance(runner, ResizableRunner) else None
    payload = runner.block_nbytes if isinstance(runner, SupportsDiskTier) else None
    return _plan(
        config,
        runner.spec,
        runner.num_blocks,
        runner.num_host_blocks,
        block_bytes,
        payload,
        None,
    )


def _plan(
    config: EngineConfig,
    spec: KVCacheSpec | None,
    num_blocks: int,
    num_host_blocks: int,
    block_bytes: int | None,
    disk_payload_bytes: int | None,
    device_memory_bytes: int | None,
) -> KVPlan:
    """The plan around given device and host tiers (``block_bytes``: one device block, every
    per-block tensor; ``disk_payload_bytes``: one block on disk; None: not supported)."""
    num_disk_blocks = 0
    if config.kv_offload_dir is not None and disk_payload_bytes is not None:
        num_disk_blocks = _disk_blocks(config, disk_payload_bytes)
    max_num_blocks = num_blocks
    elastic = config.kv_cache_memory_max is not None and block_bytes is not None
    if elastic:
        max_num_blocks = max(num_blocks, config.kv_cache_memory_max // block_bytes)
    return KVPlan(
        spec=spec,
        block_size=config.block_size,
        num_blocks=num_blocks,
        num_host_blocks=num_host_blocks,
        num_disk_blocks=num_disk_blocks,
        max_num_blocks=max_num_blocks,
        elastic=elastic,
        device_memory_bytes=device_memory_bytes,
    )


def _blocks_in_budget(
    config: EngineConfig, spec: KVCacheSpec, device_memory_bytes: int | None
) -> int:
    budget = config.kv_cache_memory
    if budget is None and config.memory_fraction is not None:
        if device_memory_bytes is None:
            raise ValueError("memory_fraction needs the device's free memory")
        budget = int(device_memory_bytes * config.memory_fraction)
    if budget is None:
        budget = DEFAULT_KV_CACHE_MEMORY
    num_blocks = spec.num_blocks_for_bytes(budget)
    if num_blocks == 0:
        raise ValueError(
            f"the KV cache budget holds no block ({spec.bytes_per_block} bytes per block)"
        )
    return num_blocks


def _disk_blocks(config: EngineConfig, payload_bytes: int) -> int:
    file_bytes = disk_file_nbytes(config.block_size, payload_bytes)
    num_blocks = config.kv_offload_size // file_bytes
    if num_blocks == 0:
        raise ValueError(
            f"kv_offload_size ({config.kv_offload_size} bytes) holds no block "
            f"({file_bytes} bytes each)"
        )
    return num_blocks
