"""How tensor-parallel ranks join a process group and exchange tensors.

The activations' all-gathers go through shared memory on one CPU machine
(``shm_collective.ShmCollective``, ``tp_collective`` "auto" or "shm"), else through gloo on
CPU and NCCL on CUDA (``TorchCollective``); step records always travel over a gloo group
(``broadcast_object``). Each is a ``model.tensor_parallel.Collective``.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pagedllm.engine.config import EngineConfig


class TorchCollective:
    """The ``model.tensor_parallel.Collective`` of a ``torch.distributed`` group."""

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.kind = dist.get_backend(group)  # "gloo" or "nccl", for the routes
        # What the gathers cost this rank (waiting for the slowest rank included):
        # benchmarks/tensor_parallel.py reads and resets them.
        self.num_calls = 0
        self.num_bytes = 0
        self.seconds = 0.0

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        start = time.perf_counter()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x, group=self.group)
        self.seconds += time.perf_counter() - start
        self.num_calls += 1
        self.num_bytes += x.numel() * x.element_size()
        return parts

    def close(self) -> None:
        """Nothing of its own: the process group goes with ``destroy_process_group``."""


class LocalCollective:
    """One rank alone (TP=1 through the tensor-parallel code, for tests)."""

    rank = 0
    world_size = 1
    kind = "none"

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [x]


def uses_shared_memory(config: EngineConfig) -> bool:
    """Whether the ranks gather through shared memory: all on one CPU machine, and told
    "shm", or "auto" where /dev/shm is writable. (Ranks on other machines decide the same:
    nnodes and device are shared; config validation refuses "shm" across machines.)"""
    from pagedllm.engine.executor.shm_collective import shm_available

    if config.nnodes != 1 or not config.device.startswith("cpu"):
        return False
    return config.tp_collective == "shm" or (config.tp_collective == "auto" and shm_available())


def init_rank(config: EngineConfig, rank: int, master_port: int) -> tuple[Any, Any]:
    """Join the process group; (the activations' collective, the gloo group for step
    records: None when the process group itself is gloo)."""
    backend = "nccl" if config.device.startswith("cuda") else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://{config.master_addr}:{master_port}",
        rank=rank,
        world_size=config.tensor_parallel_size,
        timeout=timedelta(seconds=config.distributed_timeout_s),
    )
    control = None if backend == "gloo" else dist.new_group(backend="gloo")
    if uses_shared_memory(config):
        from pagedllm.engine.executor.shm_collective import ShmCollective

        return ShmCollective.setup(control, config.distributed_timeout_s), control
    return TorchCollective(), control


def broadcast_object(obj: Any, group: Any) -> Any:
    """Rank 0's ``obj`` on every rank (pickled over the gloo group)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]
