"""Capacity planner: how many concurrent sessions fit, and the engine's start-up report.

Imports ``pagedllm.core`` only (no torch): ``pagedllm plan`` runs anywhere.
"""

from pagedllm.planner.capacity import (
    Budget,
    CacheGeometry,
    Concurrency,
    Workload,
    cache_geometry,
    fixed_workload,
    kv_budget,
    kv_bytes_per_token,
    kv_formula,
    length_below_target,
    max_concurrency,
    param_count,
    recommend_block_size,
    recommend_memory_fraction,
    weight_bytes,
)
from pagedllm.planner.presets import ModelSpec, resolve_memory, resolve_model, spec_from_config
from pagedllm.planner.report import StartupFigures, startup_figures, startup_report

__all__ = [
    "Budget",
    "CacheGeometry",
    "Concurrency",
    "ModelSpec",
    "StartupFigures",
    "Workload",
    "cache_geometry",
    "fixed_workload",
    "kv_budget",
    "kv_bytes_per_token",
    "kv_formula",
    "length_below_target",
    "max_concurrency",
    "param_count",
    "recommend_block_size",
    "recommend_memory_fraction",
    "resolve_memory",
    "resolve_model",
    "spec_from_config",
    "startup_figures",
    "startup_report",
    "weight_bytes",
]
