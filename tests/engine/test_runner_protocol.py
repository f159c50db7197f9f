"""Every runner has every member of ``ModelRunner``: the engine reads them as plain
attributes, with no fallback for a runner that lacks one."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from pagedllm.engine.executor.tensor_parallel import TensorParallelRunner
from pagedllm.worker.base import ModelRunner
from pagedllm.worker.fake_runner import FakeModelRunner


def protocol_members(protocol: type) -> set[str]:
    """The attributes a Protocol declares and the methods it defines."""
    methods = {name for name, value in vars(protocol).items() if inspect.isfunction(value)}
    return set(protocol.__annotations__) | {m for m in methods if not m.startswith("_")}


def missing_members(runner: Any) -> list[str]:
    return sorted(name for name in protocol_members(ModelRunner) if not hasattr(runner, name))


def test_the_protocol_names_what_the_engine_reads():
    assert {"supports_multi_step", "spec", "close", "execute", "routes"} <= protocol_members(
        ModelRunner
    )


@pytest.mark.parametrize("use_sampler", [False, True])
def test_the_fake_runner_has_every_member(use_sampler: bool):
    runner = FakeModelRunner(8, 4, use_sampler=use_sampler)
    assert missing_members(runner) == []
    assert runner.spec is None
    assert runner.supports_multi_step is not use_sampler


def test_the_tensor_parallel_runner_has_every_member():
    # No group is formed: the runner only wraps rank 0's runner until a step is sent.
    runner = TensorParallelRunner(FakeModelRunner(8, 4), [], None)
    assert missing_members(runner) == []
    assert runner.supports_multi_step is True


def test_the_torch_runner_has_every_member(model_engine):
    runner = model_engine(num_blocks=16).runner
    assert missing_members(runner) == []
    assert runner.spec is not None and runner.supports_multi_step is True
