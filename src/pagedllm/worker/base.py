"""The contract between the engine and whatever runs the model."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from pagedllm.core.outputs import ModelRunnerOutput, SchedulerOutput
from pagedllm.routes import Routes

if TYPE_CHECKING:
    from pagedllm.worker.disk_store import DiskKVStore
    from pagedllm.worker.kv_cache import KVCacheSpec


class ModelRunner(Protocol):
    """Runs one scheduled step: swaps, copies, forward, sampling.

    Implementations: ``pagedllm.worker.model_runner.TorchModelRunner`` (real
    weights), ``pagedllm.worker.fake_runner.FakeModelRunner`` (no weights,
    deterministic tokens computed from the context read back through the block
    tables, so that any paging bug changes the output) and
    ``pagedllm.engine.executor.tensor_parallel.TensorParallelRunner`` (N ranks).

    Every member here is one the engine reads; optional capabilities are the named
    Protocols below (``SupportsDiskTier``, ``ResizableRunner``).
    """

    vocab_size: int
    block_size: int
    num_blocks: int  # device-tier KV blocks
    num_host_blocks: int  # host-tier (swap) KV blocks
    # Whether ``SchedulerOutput.num_steps > 1`` (multi-step greedy decoding) runs.
    supports_multi_step: bool
    # Whether drafts (``ScheduledSequence.num_draft_tokens``) are verified: every position
    # scored, the agreeing drafts and one token more returned (speculative decoding).
    supports_speculation: bool
    # The layout of the KV tensors (the start-up report and the stats read it); None for a
    # runner that keeps no tensors.
    spec: KVCacheSpec | None

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def routes(self) -> Routes | None:
        """Which implementation runs each capability of a step (None: no real model)."""
        ...

    def close(self) -> None:
        """Release what the runner holds outside this process (tensor-parallel ranks);
        idempotent. ``LLMEngine.close`` calls it."""
        ...


@runtime_checkable
class SupportsDiskTier(Protocol):
    """A runner that does the disk tier's I/O (``SchedulerOutput.disk``): it reads and
    writes its blocks as bytes (``disk_store.BlockBytes``) through an attached store."""

    block_nbytes: int  # bytes of one block on disk
    # Bytes of a block kept in another layout (a quantized cache's unquantized first
    # block: its full-precision rows), or None when every block is ``block_nbytes``.
    first_block_nbytes: int | None

    def kv_fingerprint(self) -> dict[str, Any]:
        """What the blocks' bytes depend on (model, weights, dtype, KV layout)."""
        ...

    def attach_disk_store(self, store: DiskKVStore) -> None: ...


@runtime_checkable
class ResizableRunner(Protocol):
    """A runner whose device tier can change size at run time (the elastic pool).

    The engine first compacts (the core plans, the runner copies the blocks through
    ``execute`` as ``block_copies``), so a shrink drops only blocks nobody reads.
    """

    kv_block_bytes: int  # one device block, every per-block tensor together

    def resize_kv_cache(self, num_blocks: int) -> None:
        """Keep device blocks ``0 .. num_blocks - 1``; new ones may hold anything."""
        ...
