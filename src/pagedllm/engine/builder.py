"""What ``LLMEngine.from_config`` builds before the engine: the model, ONE plan of its KV
cache and the runner made from it; the engine's parts made from the plan (the block
manager, the disk tier, the scheduler's limits); and the start-up report once the engine
exists.

The plan (``engine/kv_plan.py``) is made of the model the runner runs: under tensor
parallelism that is rank 0's shard, whose config has the rank's KV heads, so it is made
inside ``start_tensor_parallel``'s runner callback, once the group has formed; the other
ranks receive its spec and sizes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from pagedllm.core.hybrid_kv import HybridKVCacheManager
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_groups import kv_cache_layout
from pagedllm.core.scheduler import SchedulerConfig
from pagedllm.core.tiers import DiskTier
from pagedllm.engine.config import EngineConfig
from pagedllm.engine.kv_plan import KVPlan, plan_kv_cache
from pagedllm.engine.prefill_slice import SMALLEST_CAP, PrefillSliceTuner
from pagedllm.routes import Routes
from pagedllm.util.memory import Resident, resident_memory
from pagedllm.worker.base import ModelRunner, SupportsDiskTier
from pagedllm.worker.disk_store import DiskKVStore

if TYPE_CHECKING:
    from pagedllm.engine.llm_engine import LLMEngine


def start_model(
    config: EngineConfig, backend: Any, load_tokenizer: bool = True
) -> tuple[Any, Any, KVPlan]:
    """Load the model on attention ``backend`` (and its tokenizer, unless not
    ``load_tokenizer`` or ``config.skip_tokenizer_init``), plan its cache, start the
    runner: (the loaded model, rank 0's shard under tensor parallelism; the runner; the
    plan)."""
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
        load_tokenizer=load_tokenizer and not config.skip_tokenizer_init,
        quantization=config.quantization,
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


def attention_backend(config: EngineConfig) -> Any:
    """The backend named by ``config.attention_backend`` ("auto" picks the fastest)."""
    from pagedllm.attention.select import get_backend

    name = config.attention_backend
    return get_backend("auto" if name is None else name)


def with_dtype(routes: Routes | None, dtype_reason: str) -> Routes | None:
    """The runner's routes with the model's dtype and why it runs in it."""
    if routes is None or not dtype_reason:
        return routes
    return replace(routes, dtype_reason=dtype_reason)


# ---------------------------------------------------------------- the engine's parts


def resolve_max_model_len(config: EngineConfig, plan: KVPlan, model_config: Any) -> int:
    """``config.max_model_len``, checked against the model and the whole cache; without
    one, the model's limit within the cache (a sliding-window model's alone: blocks out of
    the window are released, so the cache does not bound the length)."""
    cache_tokens = plan.max_num_blocks * plan.block_size
    model_limit = getattr(model_config, "max_position_embeddings", None)
    window = None if model_config is None else model_config.uniform_sliding_window
    requested = config.max_model_len
    if requested is None and window is not None:
        return model_limit
    if requested is None:
        return min(model_limit or cache_tokens, cache_tokens)
    if model_limit is not None and requested > model_limit:
        raise ValueError(f"max_model_len ({requested}) exceeds the model's limit ({model_limit})")
    if window is None and requested > cache_tokens:
        raise ValueError(
            f"max_model_len ({requested} tokens) exceeds the whole KV cache "
            f"({cache_tokens} tokens): raise --kv-cache-memory or lower --max-model-len"
        )
    return requested


def open_disk_tier(
    config: EngineConfig, runner: ModelRunner, plan: KVPlan
) -> tuple[DiskKVStore | None, DiskTier | None]:
    """The store in ``config.kv_offload_dir`` (attached to the runner) and the core's
    books of it, the plan's size; (None, None) without a directory."""
    if config.kv_offload_dir is None:
        return None, None
    if not isinstance(runner, SupportsDiskTier):
        raise ValueError(f"{type(runner).__name__} cannot run a disk tier (kv_offload_dir)")
    store = DiskKVStore(
        config.kv_offload_dir,
        runner.kv_fingerprint(),
        block_size=runner.block_size,
        payload_nbytes=runner.block_nbytes,
        first_payload_nbytes=runner.first_block_nbytes,
    )
    runner.attach_disk_store(store)
    return store, DiskTier(plan.num_disk_blocks, store.scan())


def release(disk_store: DiskKVStore | None, runner: ModelRunner) -> None:
    """What ``LLMEngine.close`` releases: the disk tier's writer, the runner's ranks."""
    if disk_store is not None:
        disk_store.close()
    runner.close()


def kv_manager(
    config: EngineConfig, plan: KVPlan, model_config: Any, disk: DiskTier | None
) -> KVCacheManager | HybridKVCacheManager:
    """The block manager for the model: one per KV cache group (``core/kv_groups.py``)
    when it mixes attention kinds (Gemma's local and global layers), else one."""
    windows = None if model_config is None else model_config.sliding_windows
    layout = None if windows is None else kv_cache_layout(windows)
    if layout is not None and len(layout.groups) > 1:
        if disk is not None:
            raise ValueError(
                "the disk tier does not take models mixing sliding-window and "
                "full-attention layers yet"
            )
        return HybridKVCacheManager(
            plan.num_blocks,
            plan.block_size,
            layout.windows,
            enable_prefix_caching=config.enable_prefix_caching,
            watermark=config.watermark,
        )
    return KVCacheManager(
        plan.num_blocks,
        plan.block_size,
        enable_prefix_caching=config.enable_prefix_caching,
        num_host_blocks=plan.num_host_blocks,
        watermark=config.watermark,
        disk=disk,
        sliding_window=None if layout is None else layout.windows[0],
        # Each cached-free first block keeps a staging slot: as many as running sequences.
        max_cached_first_blocks=config.max_num_seqs if config.unquantized_first_block else None,
    )


def scheduler_config(config: EngineConfig, max_model_len: int) -> SchedulerConfig:
    return SchedulerConfig(
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.resolved_max_num_batched_tokens(max_model_len),
        max_prefill_tokens_while_decoding=config.max_prefill_tokens_while_decoding,
        max_model_len=max_model_len,
        preemption_mode=config.preemption_mode,
        enable_chunked_prefill=config.enable_chunked_prefill,
        enable_inflight_sharing=config.enable_inflight_sharing,
        pin_waiting_prefixes=config.pin_waiting_prefixes,
        num_scheduler_steps=config.num_scheduler_steps,
    )


def slice_tuner(config: EngineConfig, max_model_len: int) -> PrefillSliceTuner | None:
    """The tuner of ``max_prefill_time_while_decoding_s`` (None without it)."""
    if config.max_prefill_time_while_decoding_s is None or not config.enable_chunked_prefill:
        return None
    # A token cap given too is the most the tuner picks (and the cap until it has timed a step).
    largest = config.resolved_max_num_batched_tokens(max_model_len)
    if config.max_prefill_tokens_while_decoding is not None:
        largest = min(largest, config.max_prefill_tokens_while_decoding)
    largest = max(largest, SMALLEST_CAP)
    return PrefillSliceTuner(config.max_prefill_time_while_decoding_s, largest)


def eos_ids(tokenizer: Any, model_config: Any) -> tuple[int | None, tuple[int, ...]]:
    """The EOS token id (the tokenizer's, else the config's first) and the config's other
    EOS ids."""
    eos = getattr(tokenizer, "eos_token_id", None)
    config_ids = tuple(getattr(model_config, "eos_token_ids", ()) or ())
    if eos is None and config_ids:
        eos = config_ids[0]
    return eos, tuple(i for i in config_ids if i != eos)


# ---------------------------------------------------------------- the start-up report


def startup_report(engine: LLMEngine, weight_bytes: int | None = None) -> str:
    """What the cache holds, in the planner's terms, the memory the process holds (the
    model's ``weight_bytes``, the KV cache, its resident set) and the routes each step
    takes."""
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
    lines = [report, memory_split(weight_bytes, plan).line()]
    if engine.routes is not None:
        lines += ["routes:", *(f"  {line}" for line in engine.routes.lines())]
    return "\n".join(line for line in lines if line)


@dataclass(frozen=True, slots=True)
class MemorySplit:
    """Where the process's resident set goes: the model's weights as held, the KV cache's
    device tier, and the rest (the Python runtime and torch, the tokenizer, the C++
    kernels, step buffers); ``resident`` None where /proc cannot be read."""

    weight_bytes: int | None
    kv_bytes: int
    resident: Resident | None

    @property
    def rest_bytes(self) -> int | None:
        if self.resident is None:
            return None
        return self.resident.total - (self.weight_bytes or 0) - self.kv_bytes

    def line(self) -> str:
        """ "memory: weights ..., KV cache ..., process RSS ... (anonymous ..., file ...),
        the rest ..." """
        mib = 1 << 20
        parts = (
            []
            if self.weight_bytes is None
            else [f"weights {self.weight_bytes / mib:,.0f} MiB as held"]
        )
        parts.append(f"KV cache {self.kv_bytes / mib:,.0f} MiB")
        resident, rest = self.resident, self.rest_bytes
        if resident is not None and rest is not None:
            parts.append(
                f"process RSS {resident.total / mib:,.0f} MiB (anonymous "
                f"{resident.anonymous / mib:,.0f}, mapped files {resident.file / mib:,.0f})"
            )
            parts.append(f"the rest {rest / mib:,.0f} MiB (runtime, tokenizer, kernels, buffers)")
        return "memory: " + ", ".join(parts)


def memory_split(weight_bytes: int | None, plan: KVPlan) -> MemorySplit:
    """The split now: ``weight_bytes`` and the plan's device tier beside the resident set
    read at this moment."""
    spec = plan.spec
    kv_bytes = 0 if spec is None else plan.num_blocks * plan.block_size * spec.bytes_per_token
    return MemorySplit(weight_bytes, int(kv_bytes), resident_memory())


def _window_fields(windows: tuple[int | None, ...]) -> dict[str, Any]:
    """A config's ``layer_types`` and ``sliding_window`` for the planner (nothing for a
    model without windows)."""
    window = next((w for w in windows if w is not None), None)
    if window is None:
        return {}
    kinds = ["full_attention" if w is None else "sliding_attention" for w in windows]
    return {"layer_types": kinds, "sliding_window": window}
