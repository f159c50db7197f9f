"""A Hugging Face tokenizer loaded without the Python copies of its vocabulary.

transformers 5 builds a model-specific tokenizer (``Qwen2Tokenizer``, ``GemmaTokenizer``)
from Python lists of its vocabulary and merges, parsed from ``tokenizer.json``, and keeps
both on the instance (``_vocab``, ``_merges``) after the Rust tokenizer is made of them:
90 MiB for Qwen2.5's 152k tokens, 200 MiB for Gemma 3's 262k, beside the Rust tables that
do the work. Nothing reads them after ``__init__`` for the families pagedllm serves, so
they are dropped, and the parse's freed heap handed back to the system.

A directory whose ``tokenizer_config.json`` declares the generic ``TokenizersBackend`` (the
default model's, and every tokenizer pagedllm saves from a GGUF) is loaded through that
class directly: ``AutoTokenizer`` would first build the model's config class only to pick
the same class, and transformers' Llama config imports ``torch.distributed.tensor`` and
sympy on the way (~60 MiB resident for the rest of the process)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pagedllm.util.memory import release_freed_memory

# What a tokenizer class of transformers 5 keeps of what it was built from.
_BUILT_FROM = ("_vocab", "_merges")


def load_hf_tokenizer(path: str, **kwargs: Any) -> Any:
    """``AutoTokenizer.from_pretrained(path, **kwargs)`` (offline), without ``_BUILT_FROM``."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if not kwargs and _declares_generic_backend(Path(path)):
        from transformers import TokenizersBackend

        tokenizer = TokenizersBackend.from_pretrained(path)
    else:
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


def _declares_generic_backend(path: Path) -> bool:
    """Whether ``AutoTokenizer`` would pick ``TokenizersBackend`` for ``path`` without the
    model's config: the tokenizer config names it, with no remote code, and the config's
    model type is none that transformers overrides (a known wrong hub class, Mistral's
    own backend)."""
    try:
        declared = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
        config_file = path / "config.json"
        config = (
            json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
        )
    except (OSError, ValueError):
        return False
    if not isinstance(declared, dict) or not isinstance(config, dict):
        return False
    if declared.get("tokenizer_class") != "TokenizersBackend" or "auto_map" in declared:
        return False
    from transformers.models.auto import tokenization_auto as auto

    model_type = config.get("model_type")
    registered = (auto.TOKENIZER_MAPPING_NAMES.get(model_type) or "").removesuffix("Fast")
    wrong_hub_class = auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS
    return (
        model_type not in wrong_hub_class
        and config.get("model_name") not in wrong_hub_class
        and registered != "MistralCommonBackend"
        and "auto_map" not in config
    )
