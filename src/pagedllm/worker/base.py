"""The contract between the engine and whatever runs the model."""

from __future__ import annotations

from typing import Protocol

from pagedllm.core.outputs import ModelRunnerOutput, SchedulerOutput


class ModelRunner(Protocol):
    """Runs one scheduled step: swaps, copies, forward, sampling.

    Implementations: ``pagedllm.worker.model_runner.TorchModelRunner`` (real
    weights) and ``pagedllm.worker.fake_runner.FakeModelRunner`` (no weights,
    deterministic tokens computed from the context read back through the block
    tables, so that any paging bug changes the output).
    """

    vocab_size: int
    block_size: int
    num_blocks: int  # device-tier KV blocks
    num_host_blocks: int  # host-tier (swap) KV blocks

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...
