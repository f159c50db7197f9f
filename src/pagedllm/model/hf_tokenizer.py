"""A Hugging Face tokenizer loaded without the Python copies of its vocabulary.

transformers 5 builds a model-specific tokenizer (``Qwen2Tokenizer``, ``GemmaTokenizer``)
from Python lists of its vocabulary and merges, parsed from ``tokenizer.json``, and keeps
both on the instance (``_vocab``, ``_merges``) after the Rust tokenizer is made of them:
90 MiB for Qwen2.5's 152k tokens, 200 MiB for Gemma 3's 262k, beside the Rust tables that
do the work. Nothing reads them after ``__init__`` for the families pagedllm serves, so
they are dropped, and the parse's freed heap handed back to the system.

A directory whose ``tokenizer_config.json`` declares the generic ``TokenizersBackend`` (the
default model's) is loaded through that class directly: ``AutoTokenizer`` would first build
the model's config class only to pick the same class, and transformers' Llama config imports
``torch.distributed.tensor`` and sympy on the way (~60 MiB resident for the rest of the
process).

A tokenizer pagedllm converted from a GGUF is saved (``save_converted``) in the form that
loads fastest: as ``TokenizersBackend`` (its ``tokenizer.json`` is the whole pipeline the
model's class built, so the class need not rebuild it from Python lists of the vocabulary and
merges) and with its added tokens in ``tokenizer_config.json`` (transformers 5 leaves them
out, then parses all of ``tokenizer.json`` in Python to find them again). Gemma 3's 262k-token
tokenizer: 3.3 -> 1.4 s, and the start-up's peak resident set ~250 MiB lower."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pagedllm.util.memory import release_freed_memory

# What a tokenizer class of transformers 5 keeps of what it was built from.
_BUILT_FROM = ("_vocab", "_merges")
# Names, in tokenizer_config.json or config.json, the GGUF a directory was converted from.
CONVERTED_FROM = "pagedllm_converted_from"


def load_hf_tokenizer(path: str, **kwargs: Any) -> Any:
    """``AutoTokenizer.from_pretrained(path, **kwargs)`` (offline), without ``_BUILT_FROM``;
    a tokenizer pagedllm converted is loaded as it was saved (``save_converted``), one saved
    before that form is rewritten in it."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    directory = Path(path)
    declared, config = _configs(directory)
    source = _converted_from(declared, config)
    converted = not kwargs and source is not None and (directory / "tokenizer.json").is_file()
    if converted or (not kwargs and _declares_generic_backend(declared, config)):
        from transformers import TokenizersBackend

        tokenizer = TokenizersBackend.from_pretrained(path)
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    drop_build_lists(tokenizer)
    if converted and not _in_saved_form(declared):
        _write_saved_form(directory, tokenizer, source)  # an older save: fast from the next load
    return tokenizer


def save_converted(tokenizer: Any, directory: Path, source: str) -> None:
    """Save ``tokenizer``, converted from the GGUF named ``source``, into ``directory`` in
    the form ``load_hf_tokenizer`` loads fastest (the module's docstring)."""
    tokenizer.save_pretrained(str(directory))
    _write_saved_form(directory, tokenizer, source)


def _write_saved_form(directory: Path, tokenizer: Any, source: str) -> None:
    """Rewrite ``directory``'s tokenizer_config.json in the saved form: whole (a temporary
    file renamed over it); a failure leaves the old one, which loads the slower way."""
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        return  # a slow tokenizer's class is what encodes
    file = directory / "tokenizer_config.json"
    work = file.with_name(f".{file.name}.{os.getpid()}")
    try:
        declared = json.loads(file.read_text(encoding="utf-8"))
        declared["tokenizer_class"] = "TokenizersBackend"
        declared["added_tokens_decoder"] = {
            str(index): token.__getstate__()
            for index, token in tokenizer.added_tokens_decoder.items()
        }
        declared[CONVERTED_FROM] = source
        work.write_text(json.dumps(declared, indent=2, ensure_ascii=False) + "\n", "utf-8")
        work.chmod(file.stat().st_mode)  # a shared cache stays readable by every user
        os.replace(work, file)
    except (OSError, ValueError, TypeError):
        work.unlink(missing_ok=True)


def _in_saved_form(declared: dict[str, Any]) -> bool:
    return (
        declared.get("tokenizer_class") == "TokenizersBackend"
        and "added_tokens_decoder" in declared
    )


def _converted_from(declared: dict[str, Any], config: dict[str, Any]) -> str | None:
    """The GGUF pagedllm converted a directory's tokenizer from (its tokenizer config
    ``declared`` names it; a model directory converted before it did names it in its
    ``config``), or None for any other directory."""
    for values in (declared, config):
        source = values.get(CONVERTED_FROM)
        if isinstance(source, str):
            return source
    return None


def _configs(directory: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """``directory``'s tokenizer_config.json and config.json, each read once ({} where
    missing or unreadable): a converted Gemma 3's tokenizer config holds 6k added tokens."""
    return _read_json(directory / "tokenizer_config.json"), _read_json(directory / "config.json")


def _read_json(file: Path) -> dict[str, Any]:
    """``file``'s JSON object, or {} where it is missing, unreadable or not an object."""
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def drop_build_lists(tokenizer: Any) -> None:
    """Drop the Python vocabulary and merges a fast tokenizer was built from (its Rust
    backend holds its own), then return the freed heap to the system."""
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        return  # a slow tokenizer encodes with them
    for name in _BUILT_FROM:
        vars(tokenizer).pop(name, None)
    release_freed_memory()


def _declares_generic_backend(declared: dict[str, Any], config: dict[str, Any]) -> bool:
    """Whether ``AutoTokenizer`` would pick ``TokenizersBackend`` for a directory of the
    tokenizer config ``declared`` and model ``config`` (``_configs``) without building the
    model's config: the tokenizer config names it, with no remote code, and the config's
    model type is none that transformers overrides (a known wrong hub class, Mistral's
    own backend)."""
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
