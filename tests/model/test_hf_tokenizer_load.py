"""A tokenizer whose config declares ``TokenizersBackend`` loads through that class directly,
equal to what ``AutoTokenizer`` loads, without the model config class's imports (sympy,
``torch.distributed.tensor``: ~60 MiB resident on the default model)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm.model import hf_tokenizer
from pagedllm.model.default_model import default_model_dir

TEXTS = (
    "Hello, world! 123 ünïcödé — émojis 🚀 and\ttabs\n\nnewlines",
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
    "def f(x):\n    return x ** 2  # code",
)
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Say hi."},
]


def _tokenizer_dir(tmp_path: Path) -> Path:
    from pagedllm.testing import make_tiny_tokenizer

    directory = tmp_path / "tok"
    make_tiny_tokenizer(directory)
    (directory / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return directory


def _real_dirs() -> list[Path]:
    directory = default_model_dir()
    return [directory] if (directory / "tokenizer_config.json").is_file() else []


def _assert_same(path: Path) -> None:
    from transformers import AutoTokenizer

    assert hf_tokenizer._declares_generic_backend(*hf_tokenizer._configs(path))
    direct = hf_tokenizer.load_hf_tokenizer(str(path))
    auto = AutoTokenizer.from_pretrained(str(path))
    hf_tokenizer.drop_build_lists(auto)
    assert type(direct) is type(auto)
    assert direct.init_kwargs == auto.init_kwargs
    assert_tokenize_alike(direct, auto)


def assert_tokenize_alike(direct, auto) -> None:
    """The two tokenizers' special tokens, encodings, decodings and chat template agree."""
    assert direct.all_special_ids == auto.all_special_ids
    assert direct.added_tokens_decoder == auto.added_tokens_decoder
    assert direct.chat_template == auto.chat_template
    for text in TEXTS:
        for special in (True, False):
            ids = direct.encode(text, add_special_tokens=special)
            assert ids == auto.encode(text, add_special_tokens=special)
            assert direct.decode(ids) == auto.decode(ids)
            assert direct.decode(ids, skip_special_tokens=True) == auto.decode(
                ids, skip_special_tokens=True
            )
    if auto.chat_template is None:  # a GGUF may carry none
        return
    chat = {"tokenize": False, "add_generation_prompt": True}
    assert direct.apply_chat_template(MESSAGES, **chat) == auto.apply_chat_template(
        MESSAGES, **chat
    )


def test_a_declared_tokenizers_backend_loads_as_autotokenizer_does(tmp_path) -> None:
    _assert_same(_tokenizer_dir(tmp_path))


@pytest.mark.parametrize("path", _real_dirs(), ids=lambda p: p.name)
def test_the_default_models_tokenizer_loads_as_autotokenizer_does(path) -> None:
    _assert_same(path)


@pytest.mark.parametrize(
    ("declared", "config", "direct"),
    [
        ({"tokenizer_class": "TokenizersBackend"}, {"model_type": "llama"}, True),
        ({"tokenizer_class": "TokenizersBackend"}, None, True),
        ({"tokenizer_class": "GemmaTokenizer"}, {"model_type": "gemma3"}, False),
        ({"tokenizer_class": "TokenizersBackend", "auto_map": {}}, {}, False),
        ({"tokenizer_class": "TokenizersBackend"}, {"model_type": "qwen2"}, False),
        ({"tokenizer_class": "TokenizersBackend"}, {"model_name": "qwen2"}, False),
        ({"tokenizer_class": "TokenizersBackend"}, {"model_type": "llama", "auto_map": {}}, False),
    ],
)
def test_only_a_plain_declared_backend_skips_autotokenizer(tmp_path, declared, config, direct):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(declared))
    if config is not None:
        (tmp_path / "config.json").write_text(json.dumps(config))
    assert hf_tokenizer._declares_generic_backend(*hf_tokenizer._configs(tmp_path)) is direct


def test_unreadable_tokenizer_config_takes_autotokenizer(tmp_path) -> None:
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    assert not hf_tokenizer._declares_generic_backend(*hf_tokenizer._configs(tmp_path))


CHILD = """
import sys
import torch
import pagedllm.engine.llm
from pagedllm.model.hf_tokenizer import load_hf_tokenizer
load_hf_tokenizer(sys.argv[1])
print([m for m in ("sympy", "torch.distributed.tensor") if m in sys.modules])
"""


def test_loading_it_imports_no_model_config_machinery(tmp_path) -> None:
    directory = _tokenizer_dir(tmp_path)
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(directory)], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip().splitlines()[-1] == "[]"


# ---------------------------------------------------------------- tokenizers pagedllm converted


def _rebuilt(tmp_path: Path, tokenizer_class: str, model_type: str):
    """The tiny tokenizer as transformers' class for ``model_type`` rebuilds it from its
    vocabulary and merges (its own pipeline), as a GGUF's tokenizer is rebuilt."""
    from transformers import AutoTokenizer

    directory = _tokenizer_dir(tmp_path)
    declared = json.loads((directory / "tokenizer_config.json").read_text())
    declared["tokenizer_class"] = tokenizer_class
    (directory / "tokenizer_config.json").write_text(json.dumps(declared))
    (directory / "config.json").write_text(json.dumps({"model_type": model_type}))
    rebuilt = AutoTokenizer.from_pretrained(str(directory))
    assert type(rebuilt).__name__ == tokenizer_class
    return rebuilt


def _python_reads(monkeypatch) -> list[str]:
    """The names of the files transformers parses with Python's json, from now on."""
    reads: list[str] = []
    load = json.load

    def spy(handle, *args, **kwargs):
        reads.append(Path(getattr(handle, "name", "?")).name)
        return load(handle, *args, **kwargs)

    monkeypatch.setattr(json, "load", spy)
    return reads


@pytest.mark.parametrize(
    ("tokenizer_class", "model_type"),
    [("Qwen2Tokenizer", "qwen2"), ("TokenizersBackend", "llama")],
)
def test_a_converted_tokenizer_loads_back_as_the_class_that_built_it(
    tmp_path, monkeypatch, tokenizer_class, model_type
) -> None:
    """Saved by save_converted, it loads as TokenizersBackend straight from tokenizer.json
    (the whole pipeline the model's class built) and tokenizes as that class did, without
    transformers parsing tokenizer.json in Python for its added tokens."""
    rebuilt = _rebuilt(tmp_path, tokenizer_class, model_type)
    saved = tmp_path / "saved"
    hf_tokenizer.save_converted(rebuilt, saved, "tiny.gguf")
    declared = json.loads((saved / "tokenizer_config.json").read_text())
    assert declared["tokenizer_class"] == "TokenizersBackend"
    assert declared[hf_tokenizer.CONVERTED_FROM] == "tiny.gguf"
    reads = _python_reads(monkeypatch)
    loaded = hf_tokenizer.load_hf_tokenizer(str(saved))
    assert type(loaded).__name__ == "TokenizersBackend"
    assert "tokenizer.json" not in reads
    assert_tokenize_alike(loaded, rebuilt)


def test_an_older_converted_save_is_rewritten_in_the_saved_form(tmp_path, monkeypatch) -> None:
    """A model directory converted before (save_pretrained's form; config.json names the
    GGUF) loads alike and is rewritten so that the next load parses nothing in Python."""
    rebuilt = _rebuilt(tmp_path, "Qwen2Tokenizer", "qwen2")
    older = tmp_path / "older"
    rebuilt.save_pretrained(str(older))
    (older / "config.json").write_text(
        json.dumps({"model_type": "qwen2", hf_tokenizer.CONVERTED_FROM: "tiny.gguf"})
    )
    (older / "tokenizer_config.json").chmod(0o640)
    reads = _python_reads(monkeypatch)
    first = hf_tokenizer.load_hf_tokenizer(str(older))
    assert "tokenizer.json" in reads  # transformers' own way, once
    assert_tokenize_alike(first, rebuilt)
    declared = json.loads((older / "tokenizer_config.json").read_text())
    assert declared["tokenizer_class"] == "TokenizersBackend"
    assert declared[hf_tokenizer.CONVERTED_FROM] == "tiny.gguf"
    assert (older / "tokenizer_config.json").stat().st_mode & 0o777 == 0o640
    reads.clear()
    again = hf_tokenizer.load_hf_tokenizer(str(older))
    assert "tokenizer.json" not in reads
    assert_tokenize_alike(again, rebuilt)
    assert sorted(p.name for p in older.iterdir() if p.name.startswith(".")) == []


def test_a_converted_save_that_cannot_be_rewritten_still_loads(tmp_path, monkeypatch) -> None:
    """A cache another user owns: the rewrite fails, the load does not, nothing is left."""
    rebuilt = _rebuilt(tmp_path, "Qwen2Tokenizer", "qwen2")
    older = tmp_path / "older"
    rebuilt.save_pretrained(str(older))
    (older / "config.json").write_text(json.dumps({hf_tokenizer.CONVERTED_FROM: "tiny.gguf"}))
    before = (older / "tokenizer_config.json").read_text()

    def refuse(*args, **kwargs):
        raise PermissionError("not yours")

    monkeypatch.setattr(hf_tokenizer.os, "replace", refuse)
    assert_tokenize_alike(hf_tokenizer.load_hf_tokenizer(str(older)), rebuilt)
    assert (older / "tokenizer_config.json").read_text() == before
    assert sorted(p.name for p in older.iterdir() if p.name.startswith(".")) == []


def _real_ggufs() -> list[Path]:
    from pagedllm.model import default_model, gemma_model, qwen_coder_model

    files = [
        default_model.default_model_dir() / default_model.GGUF_NAME,
        gemma_model.gemma_model_dir() / gemma_model.GGUF_NAME,
        qwen_coder_model.qwen_coder_model_dir() / qwen_coder_model.GGUF_NAME,
    ]
    return [file for file in files if file.is_file()]


@pytest.mark.parametrize("gguf", _real_ggufs(), ids=lambda p: p.stem)
def test_a_real_ggufs_saved_tokenizer_tokenizes_as_the_rebuilt_one(tmp_path, gguf) -> None:
    """The tokenizer transformers rebuilds from a real GGUF, and the same loaded back from
    where gguf_tokenizer saved it (the fast form), agree."""
    from pagedllm.model.gguf_loader import gguf_tokenizer

    rebuilt = gguf_tokenizer(gguf, tmp_path)
    saved = gguf_tokenizer(gguf, tmp_path)
    assert type(saved).__name__ == "TokenizersBackend"
    assert_tokenize_alike(saved, rebuilt)
