"""The engine: ``LLMEngine.step()``, the offline ``LLM``, detokenization, config.

Exports are lazy so that importing one submodule (the server's ``async_engine``)
does not pull in the whole engine.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "EngineConfig": "pagedllm.engine.config",
    "EngineStats": "pagedllm.engine.llm_engine",
    "LLMEngine": "pagedllm.engine.llm_engine",
    "LLM": "pagedllm.engine.llm",
    "RequestOutput": "pagedllm.engine.outputs",
    "CompletionOutput": "pagedllm.engine.outputs",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedllm.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
