"""What ``LLMEngine.from_config`` builds before the engine: the model, ONE plan of its KV
cache and the runner made from it; and the start-up report once the engine exists.

The plan (``engine/kv_plan.py``) is made of the model the runner runs: under tensor
parallelism that is rank 0's shard, whose config has the rank's KV heads, so it is made
inside ``start_tensor_parallel``'s runner callback, once the group has formed; the other
ranks receive its spec and sizes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedllm.engine.config import EngineConfig
from pagedllm.engine.kv_plan import KVPlan, plan_kv_cache

if TYPE_CHECKING:
    from pagedllm.engine.llm_engine import LLMEngine


def start_model(config: EngineConfig, backend: Any) -> tuple[Any, Any, KVPlan]:
    """Load the model on attention ``backend``, plan its cache, start the runner: (the
    loaded model, rank 0's shard under tensor parallelism; the runner; the plan)."""
    import torch

    from pagedllm.model.loader import load_model

    torch.manual_seed(config.seed)
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    loaded = load_model(
        config.model,
        config.dtype,
        backend,
        device=config.device,
        load_tokenizer=not config.skip_tokenizer_init,
    )
    plans: list[KVPlan] = []

    def planned_runner(config: EngineConfig, model: Any) -> Any:
        plans.append(plan_model_cache(config, model))
        return runner_of_plan(model, plans[-1])

    if config.tensor_parallel_size > 1:
        from pagedllm.engine.executor.tensor_parallel import start_tensor_parallel

        loaded, runner = start_tensor_parallel(config, loaded, planned_runner)
    else:
        runner = planned_runner(config, loaded.model)
    (plan,) = plans
    return loaded, runner, plan


def plan_model_cache(config: EngineConfig, model: Any) -> KVPlan:
    """The plan of ``model``'s cache: its layout under ``config``, the free device memory
    read once, before the cache takes any."""
    from pagedllm.worker.kv_cache import available_memory_bytes
    from pagedllm.worker.model_runner import kv_cache_spec

    spec = kv_cache_spec(
        model, config.block_size, config.kv_cache_dtype, config.unquantized_first_block
    )
    return plan_kv_cache(config, spec, available_memory_bytes(config.device))


def runner_of_plan(model: Any, plan: KVPlan) -> Any:
    """A ``TorchModelRunner`` of ``model`` whose cache is the plan's."""
    from pagedllm.worker.model_runner import TorchModelRunner

    return TorchModelRunner(
        model,
        block_size=plan.block_size,
        num_blocks=plan.num_blocks,
        num_host_blocks=plan.num_host_blocks,
        spec=plan.spec,
    )


# ---------------------------------------------------------------- the start-up report


def startup_report(engine: LLMEngine) -> str:
    """What the cache holds, in the planner's terms, and the routes each step takes."""
    from pagedllm.planner.report import startup_report as planner_report

    plan, cfg = engine.plan, engine.model_config
    spec = plan.spec
    mla = cfg.mla
    latent = {} if mla is None else {
        "kv_lora_rank": mla.kv_lora_rank,
        "qk_rope_head_dim": mla.qk_rope_head_dim,
        "qk_nope_head_dim": mla.qk_nope_head_dim,
        "v_head_dim": mla.v_head_dim,
    }  # fmt: skip
    report = planner_report(
        {
            "num_hidden_layers": cfg.num_hidden_layers,
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads,
            "head_dim": cfg.head_dim,
            "hidden_size": cfg.hidden_size,
            "vocab_size": cfg.vocab_size,
            "intermediate_size": cfg.intermediate_size,
            "max_position_embeddings": cfg.max_position_embeddings,
            **latent,
            **_window_fields(cfg.sliding_windows),
        },
        spec.element_bytes,
        plan.block_size,
        plan.num_blocks,
        engine.max_model_len,
        memory_bytes=plan.device_memory_bytes,
        max_num_seqs=engine.config.max_num_seqs,
        tp=engine.config.tensor_parallel_size,
        engine_bytes_per_token=spec.bytes_per_token,
        kv_cache_dtype=plan.kv_cache_dtype,
        staging_block_bytes=None if spec.quantization is None else spec.staging_bytes_per_slot,
        unquantized_first_block=spec.unquantized_first_block,
        step_tokens=engine.scheduler.config.max_num_batched_tokens,
    )
    if engine.routes is None:
        return report
    return "\n".join([report, "routes:", *(f"  {line}" for line in engine.routes.lines())])


def _window_fields(windows: tuple[int | None, ...]) -> dict[str, Any]:
    """A config's ``layer_types`` and ``sliding_window`` for the planner (nothing for a
    model without windows)."""
    window = next((w for w in windows if w is not None), None)
    if window is None:
        return {}
    kinds = ["full_attention" if w is None else "sliding_attention" for w in windows]
    return {"layer_types": kinds, "sliding_window": window}
