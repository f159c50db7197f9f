"""Tensor-parallel ranks over ``torch.distributed``: one scheduler, N model shards.

Rank 0 is the engine: it schedules, and before each step broadcasts the step's
``SchedulerOutput`` (batch, block tables, copies, swaps: plain records) to every rank; all
ranks then run the same ``TorchModelRunner.execute`` on their shard
(``model/tensor_parallel.py``), gathering activations between layers, and rank 0's
sampled tokens go back to the scheduler. Every rank holds its KV heads' share of every
block under the same block ids, so the scheduler's block tables mean the same everywhere.

Collectives (``collectives.py``): on one CPU machine the activations' all-gathers go through
shared memory (``shm_collective.ShmCollective``, ``tp_collective`` "auto" or "shm"), else
gloo on CPU and NCCL on CUDA; the step records always travel over a gloo group.
Processes: ``torch.multiprocessing`` (spawn) for this machine's ranks; across machines the
torchrun-style rendezvous (``nnodes``, ``node_rank``, ``master_addr``, ``master_port``):
machine 0 runs the engine and its local ranks, every other machine runs
``pagedllm serve --node-rank K ...`` which only starts its ranks and waits. Once the group
has formed, rank 0 sends every rank its ``EngineConfig`` (model, dtype, block size, ...),
so a worker machine's own flags only say where to meet and how many threads to use.

A worker rank exits when rank 0 sends ``None`` (``TensorParallelRunner.close``), when its
parent process is gone, or when a collective times out (``distributed_timeout_s``).
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pagedllm.core.outputs import ModelRunnerOutput, SchedulerOutput
from pagedllm.engine.config import EngineConfig
from pagedllm.engine.executor.collectives import broadcast_object, init_rank
from pagedllm.routes import Routes
from pagedllm.util.net import free_port

logger = logging.getLogger(__name__)


def rank_device(config: EngineConfig, rank: int) -> str:
    if config.device.startswith("cuda"):
        local = rank % (config.tensor_parallel_size // config.nnodes)
        return f"cuda:{local}"
    return config.device


def load_shard(config: EngineConfig, comm: Any) -> Any:
    """A worker rank's ``LoadedModel``, its model cut to the rank's share."""
    from pagedllm.attention.select import get_backend
    from pagedllm.model.loader import load_model

    loaded = load_model(
        config.model,
        config.dtype,
        get_backend(config.attention_backend),
        device=rank_device(config, comm.rank),
        load_tokenizer=False,
        quantization=config.quantization,
    )
    return shard_loaded(loaded, comm)


def shard_loaded(loaded: Any, comm: Any) -> Any:
    import dataclasses

    from pagedllm.model.tensor_parallel import TensorParallelModel

    return dataclasses.replace(loaded, model=TensorParallelModel(loaded.model, comm))


def start_tensor_parallel(
    config: EngineConfig, loaded: Any, build_runner: Callable[[EngineConfig, Any], Any]
) -> tuple[Any, TensorParallelRunner]:
    """Rank 0 of ``config.tensor_parallel_size``: refuse a model that does not split,
    start this machine's other ranks, join the group, shard ``loaded`` (rank 0's full
    model), size the cache and tell the ranks. Returns (the sharded model, the runner)."""
    from pagedllm.model.tensor_parallel import check_supported

    if config.node_rank != 0:
        raise ValueError("only machine 0 (--node-rank 0) runs the engine")
    check_supported(loaded.model, config.tensor_parallel_size)
    _require_no_group()
    port = config.master_port or free_port()
    processes = start_rank_processes(config, port, skip_rank0=True)
    comm = None
    try:
        comm, control = init_rank(config, 0, port)
        broadcast_object(config, control)
        loaded = shard_loaded(loaded, comm)
        runner = TensorParallelRunner(
            build_runner(config, loaded.model), processes, control, comm=comm
        )
        runner.send_sizes()
    except BaseException:
        _abandon(processes, comm)
        raise
    # The engine's finalizer stops the ranks at exit too, but its hook may run after
    # multiprocessing's, which kills daemon ranks mid-collective; this one, registered
    # after the ranks started, runs first. A weak reference: it must not keep the runner.
    atexit.register(_close_if_alive, weakref.ref(runner))
    return loaded, runner


def _close_if_alive(runner_ref: weakref.ref[TensorParallelRunner]) -> None:
    runner = runner_ref()
    if runner is not None:
        runner.close()


def _require_no_group() -> None:
    """A process has one default group. An engine that was dropped but sits in a reference
    cycle still holds it until the cycle is collected (the first import of torch.fx, made
    while a model is built, leaves such a cycle through the callers' frames), so collect
    before giving up."""
    if dist.is_initialized():
        gc.collect()
    if dist.is_initialized():
        raise RuntimeError(
            "this process already has a torch.distributed process group: close() the "
            "other tensor-parallel LLM (or engine) first"
        )


def _abandon(processes: list[Any], comm: Any) -> None:
    """Undo a start that failed part way: the ranks may never have joined, so there is
    nobody to tell; kill them and leave the group, so that a later start can form one."""
    for process in processes:
        process.kill()
        process.join(5)
    if comm is not None:
        comm.close()
    if dist.is_initialized():
        dist.destroy_process_group()


@dataclass(frozen=True, slots=True)
class ResizeKVCache:
    """Rank 0 to the others, between steps: resize the device tier (the elastic pool)."""

    num_blocks: int


class TensorParallelRunner:
    """The ``ModelRunner`` of rank 0: broadcasts each step, then runs its own shard."""

    supports_multi_step = True
    supports_speculation = True

    def __init__(
        self, runner: Any, processes: list[Any], control: Any, *, comm: Any = None
    ) -> None:
        self.runner = runner
        self.processes = processes
        self.control = control
        self.comm = comm  # the activations' collective, closed with the group
        self.vocab_size = runner.vocab_size
        self.block_size = runner.block_size
        self.num_blocks = runner.num_blocks
        self.num_host_blocks = runner.num_host_blocks
        self.step_broadcast_s = 0.0  # time spent sending step records (for benchmarks)
        self._closed = False

    @property
    def model(self) -> Any:
        """Rank 0's shard (``TensorParallelModel``)."""
        return self.runner.model

    @property
    def spec(self) -> Any:
        """Rank 0's KV layout (every rank's is the same)."""
        return self.runner.spec

    def send_sizes(self) -> None:
        broadcast_object((self.spec, self.num_blocks, self.num_host_blocks), self.control)

    @property
    def kv_block_bytes(self) -> int:
        """One block of this rank's shard (every rank's is the same size)."""
        return self.runner.kv_block_bytes

    def resize_kv_cache(self, num_blocks: int) -> None:
        """Every rank keeps device blocks ``0 .. num_blocks - 1`` (``ResizableRunner``)."""
        broadcast_object(ResizeKVCache(num_blocks), self.control)
        self.runner.resize_kv_cache(num_blocks)
        self.num_blocks = num_blocks

    def routes(self) -> Routes:
        return self.runner.routes()

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        start = time.perf_counter()
        broadcast_object(scheduler_output, self.control)
        self.step_broadcast_s += time.perf_counter() - start
        return self.runner.execute(scheduler_output)

    def close(self) -> None:
        """Stop the worker ranks and leave the process group (idempotent), so that
        another group can form in this process. ``LLMEngine.close`` calls it, also when
        the engine is garbage-collected or the interpreter exits."""
        if self._closed:
            return
        self._closed = True
        try:
            broadcast_object(None, self.control)
        except RuntimeError as exc:  # a rank already gone
            logger.warning("tensor-parallel shutdown: %s", exc)
        for process in self.processes:
            process.join(30)
            if process.is_alive():
                process.kill()
        if self.comm is not None:
            self.comm.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def start_rank_processes(config: EngineConfig, master_port: int, *, skip_rank0: bool) -> list:
    """This machine's ranks as spawned processes (rank 0 stays in the caller)."""
    local = config.tensor_parallel_size // config.nnodes
    first = config.node_rank * local
    ctx = mp.get_context("spawn")
    processes = []
    for rank in range(first, first + local):
        if rank == 0 and skip_rank0:
            continue
        process = ctx.Process(
            target=worker_main, args=(config, rank, master_port, os.getpid()), daemon=True
        )
        process.start()
        processes.append(process)
    return processes


def worker_main(config: EngineConfig, rank: int, master_port: int, parent_pid: int) -> None:
    """A worker rank: load the shard, size the cache as rank 0 says, run steps."""
    from pagedllm.worker.model_runner import TorchModelRunner

    _exit_with_parent(parent_pid)
    torch.manual_seed(config.seed)
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    comm, control = init_rank(config, rank, master_port)
    config = broadcast_object(None, control)  # rank 0's: the same model everywhere
    loaded = load_shard(config, comm)
    # Rank 0's planned layout (dtype, quantization, first block) and sizes: every rank's.
    spec, num_blocks, num_host_blocks = broadcast_object(None, control)
    runner = TorchModelRunner(
        loaded.model,
        block_size=config.block_size,
        num_blocks=num_blocks,
        num_host_blocks=num_host_blocks,
        spec=spec,
    )
    while True:
        step = broadcast_object(None, control)
        if step is None:
            break
        try:
            if isinstance(step, ResizeKVCache):
                runner.resize_kv_cache(step.num_blocks)
                continue
            runner.execute(step)
        except Exception:  # noqa: BLE001 - rank 0 meets the same error and reports it
            logger.exception("rank %d: step failed", rank)
    # Leave without tearing the group down: rank 0 may have closed its side already, and
    # gloo's teardown then aborts the process (std::terminate), an exit status a worker
    # machine's launcher reports as a failure. The system frees it all.
    comm.close()
    logging.shutdown()
    os._exit(0)


def run_worker_node(config: EngineConfig) -> int:
    """``--node-rank K`` (K > 0): run this machine's ranks until rank 0 stops them."""
    if config.node_rank == 0 or config.master_port is None:
        raise ValueError("a worker machine needs --node-rank > 0 and --master-port")
    processes = start_rank_processes(config, config.master_port, skip_rank0=False)
    for process in processes:
        process.join()
    return max((p.exitcode or 0) for p in processes) if processes else 0


def _exit_with_parent(parent_pid: int) -> None:
    """A worker whose parent died must not wait forever in a collective."""

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(1.0)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()
