"""A Hugging Face tokenizer loaded without the Python copies of its vocabulary.

transformers 5 builds a model-specific tokenizer (``Qwen2Tokenizer``, ``GemmaTokenizer``)
from Python lists of its vocabulary and merges, parsed from ``tokenizer.json``, and keeps
both on the instance (``_vocab``, ``_merges``) after the Rust tokenizer is made of them:
90 MiB for Qwen2.5's 152k tokens, 200 MiB for Gemma 3's 262k, beside the Rust tables that
do the work. Nothing reads them after ``__init__`` for the families pagedllm serves, so
they are dropped, and the parse's freed heap handed back to the system."""

from __future__ import annotations

import os
from typing import Any

from pagedllm.util.memory import release_freed_memory

# What a tokenizer class of transformers 5 keeps of what it was built from.
_BUILT_FROM = ("_vocab", "_merges")


def load_hf_tokenizer(path: str, **kwargs: Any) -> Any:
    """``AutoTokenizer.from_pretrained(path, **kwargs)`` (offline), without ``_BUILT_FROM``."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    drop_build_lists(tokenizer)
    return tokenizer


def drop_build_lists(tokenizer: Any) -> None:
    """Drop the Python vocabulary and merges a fast tokenizer was built from (its Rust
    backend holds its own), then return the freed heap to the system."""
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        return  # a slow tokenizer encodes with them
    for name in _BUILT_FROM:
        vars(tokenizer).pop(name, None)
    release_freed_memory()
