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

    assert hf_tokenizer._declares_generic_backend(path)
    direct = hf_tokenizer.load_hf_tokenizer(str(path))
    auto = AutoTokenizer.from_pretrained(str(path))
    hf_tokenizer.drop_build_lists(auto)
    assert type(direct) is type(auto)
    assert direct.init_kwargs == auto.init_kwargs
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
    assert hf_tokenizer._declares_generic_backend(tmp_path) is direct


def test_unreadable_tokenizer_config_takes_autotokenizer(tmp_path) -> None:
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    assert not hf_tokenizer._declares_generic_backend(tmp_path)


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
