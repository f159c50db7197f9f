"""One plan of the KV cache per engine (``engine/kv_plan.py``), read by every consumer."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from pagedllm.engine import builder, llm_engine
from pagedllm.engine.config import EngineConfig
from pagedllm.engine.kv_plan import KVPlan, plan_kv_cache, plan_of_runner
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.worker import model_runner
from pagedllm.worker.disk_store import disk_file_nbytes
from pagedllm.worker.fake_runner import FakeModelRunner


def _count_calls(monkeypatch: pytest.MonkeyPatch, module: object, name: str) -> list[object]:
    """Wrap ``module.name``; the list holds what each call returned."""
    real = getattr(module, name)
    results: list[object] = []

    def counted(*args: object, **kwargs: object) -> object:
        results.append(real(*args, **kwargs))
        return results[-1]

    monkeypatch.setattr(module, name, counted)
    return results


def test_from_config_plans_once_and_every_consumer_reads_that_plan(
    tiny_model_dir: Path, engines: list[LLMEngine], tmp_path: Path, monkeypatch
) -> None:
    plans = _count_calls(monkeypatch, builder, "plan_kv_cache")
    specs = _count_calls(monkeypatch, model_runner, "kv_cache_spec")
    by_runner = _count_calls(monkeypatch, llm_engine, "plan_of_runner")
    config = EngineConfig(
        model=str(tiny_model_dir),
        dtype="float32",
        block_size=4,
        kv_cache_memory=64 * 4096,
        kv_cache_memory_max=256 * 4096,
        swap_memory=8 * 4096,
        kv_offload_dir=str(tmp_path / "kv"),
        kv_offload_size=1 << 20,
    )
    engine = LLMEngine.from_config(config)
    engines.append(engine)
    assert len(plans) == len(specs) == 1 and not by_runner
    plan = engine.plan
    assert plan is plans[0] and isinstance(plan, KVPlan)
    spec = plan.spec
    assert engine.runner.spec is spec is specs[0]
    # The runner's tensors are what the plan counted.
    assert engine.runner.kv_block_bytes == spec.bytes_per_block
    assert (engine.runner.num_blocks, engine.runner.num_host_blocks) == (
        plan.num_blocks,
        plan.num_host_blocks,
    )
    assert plan.num_blocks == 64 * 4096 // spec.bytes_per_block
    assert plan.num_host_blocks == 8 * 4096 // spec.bytes_per_block
    assert (engine.kv.num_blocks, engine.kv.num_host_blocks) == (
        plan.num_blocks,
        plan.num_host_blocks,
    )
    # The elastic bounds: the policy, the scheduler and the longest request.
    assert plan.elastic and plan.max_num_blocks == 256 * 4096 // spec.bytes_per_block
    assert engine.elastic.policy.max_blocks == plan.max_num_blocks
    assert engine.elastic.policy.min_blocks == plan.num_blocks
    assert engine.scheduler.max_num_blocks == plan.max_num_blocks
    assert engine.max_model_len == min(
        engine.model_config.max_position_embeddings, plan.max_num_blocks * plan.block_size
    )
    # The disk tier holds the plan's blocks, each file one device block plus its header.
    file_bytes = disk_file_nbytes(plan.block_size, spec.bytes_per_block)
    assert engine.disk_store.file_nbytes == file_bytes
    assert plan.num_disk_blocks == (1 << 20) // file_bytes
    assert engine.kv.disk.capacity == plan.num_disk_blocks
    # The report and the stats say the plan's figures.
    assert f"{plan.num_blocks:,} blocks" in engine.startup_report
    kv_mib = plan.num_blocks * spec.bytes_per_block / (1 << 20)
    assert f"KV cache {kv_mib:,.0f} MiB, process RSS" in engine.startup_report
    stats = engine.get_stats()
    assert stats.kv_bytes_per_token == plan.bytes_per_token == spec.bytes_per_token
    assert stats.kv_cache_dtype == plan.kv_cache_dtype == "float32"


@pytest.mark.parametrize(
    ("kv_cache_dtype", "first_block"), [("int8", True), ("int4", None), ("int8", False)]
)
def test_a_quantized_plan_keeps_the_unquantized_first_block(
    tiny_model_dir: Path, engines: list[LLMEngine], kv_cache_dtype: str, first_block
) -> None:
    """The runner's spec is the plan's, flag included. ``TorchModelRunner.from_budget``
    used to size its pool from a spec without the flag: a quantized block's pool bytes do
    not depend on it (staging and first blocks live beside the pool), so the count was the
    same and nothing showed; the plan makes the question moot."""
    config = EngineConfig(
        model=str(tiny_model_dir),
        kv_cache_dtype=kv_cache_dtype,
        kv_cache_unquantized_first_block=first_block,
        kv_cache_memory=1 << 20,
    )
    engine = LLMEngine.from_config(config)
    engines.append(engine)
    spec = engine.plan.spec
    assert spec.unquantized_first_block is config.unquantized_first_block
    assert engine.runner.spec is spec
    assert engine.runner.first_block_nbytes == (
        spec.staging_bytes_per_slot if config.unquantized_first_block else None
    )
    without = plan_kv_cache(config, replace(spec, unquantized_first_block=False), None)
    assert without.num_blocks == engine.plan.num_blocks == (1 << 20) // spec.bytes_per_block
    assert engine.runner.kv_block_bytes == spec.bytes_per_block


def test_from_budget_builds_its_spec_with_the_first_block_flag(tiny_model_dir: Path) -> None:
    from pagedllm.model.loader import load_model
    from pagedllm.worker.model_runner import TorchModelRunner

    loaded = load_model(str(tiny_model_dir), "float32", load_tokenizer=False)
    runner = TorchModelRunner.from_budget(
        loaded.model,
        block_size=16,
        kv_cache_memory=1 << 20,
        kv_cache_dtype="int8",
        unquantized_first_block=True,
        optimize=False,
    )
    assert runner.spec.unquantized_first_block
    assert runner.num_blocks == (1 << 20) // runner.spec.bytes_per_block


def test_a_hand_built_runner_is_planned_as_it_is(tmp_path: Path) -> None:
    """A fake runner's tiers are taken as given; the disk tier and the elastic MAX follow
    the same rules as a model's."""
    runner = FakeModelRunner(32, 4, num_host_blocks=5, kv_block_bytes=1000)
    config = EngineConfig(
        block_size=4,
        kv_cache_memory=32_000,
        kv_cache_memory_max=100_000,
        kv_offload_dir=str(tmp_path / "kv"),
        kv_offload_size=10 * disk_file_nbytes(4, runner.block_nbytes) + 1,
    )
    plan = plan_of_runner(config, runner)
    assert plan == KVPlan(
        spec=None,
        block_size=4,
        num_blocks=32,
        num_host_blocks=5,
        num_disk_blocks=10,
        max_num_blocks=100,
        elastic=True,
    )
    engine = LLMEngine(config, runner)
    try:
        assert engine.plan == plan
        assert engine.kv.disk.capacity == 10 and engine.scheduler.max_num_blocks == 100
        assert engine.startup_report is None and engine.get_stats().kv_cache_dtype is None
    finally:
        engine.close()


def test_a_plan_refuses_a_budget_or_a_disk_size_that_holds_no_block(tmp_path: Path) -> None:
    from pagedllm.worker.kv_cache import KVCacheSpec

    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16)
    with pytest.raises(ValueError, match="holds no block"):
        plan_kv_cache(EngineConfig(kv_cache_memory=spec.bytes_per_block - 1), spec, None)
    disk = EngineConfig(kv_offload_dir=str(tmp_path), kv_offload_size=spec.bytes_per_block)
    with pytest.raises(ValueError, match="kv_offload_size .* holds no block"):
        plan_kv_cache(disk, spec, None)
    fraction = plan_kv_cache(EngineConfig(memory_fraction=0.5), spec, 100 * spec.bytes_per_block)
    assert fraction.num_blocks == 50 and fraction.device_memory_bytes == 100 * spec.bytes_per_block
