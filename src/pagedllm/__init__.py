"""pagedllm: an LLM inference engine built around a paged KV cache.

``from pagedllm import LLM, SamplingParams`` — the exports load lazily, so that
``import pagedllm.core`` stays free of torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "pagedllm.engine.llm",
    "LLMEngine": "pagedllm.engine.llm_engine",
    "EngineConfig": "pagedllm.engine.config",
    "RequestOutput": "pagedllm.engine.outputs",
    "CompletionOutput": "pagedllm.engine.outputs",
    "Logprob": "pagedllm.engine.outputs",
    "SamplingParams": "pagedllm.sampling_params",
    "BeamSearchParams": "pagedllm.sampling_params",
    "StructuredOutputsParams": "pagedllm.sampling_params",
}

__all__ = ["__version__", *sorted(_EXPORTS)]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
