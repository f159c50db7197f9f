"""Config validation (refusals name the option) and HF directory loading."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from pagedllm.kernels.probe import cpu_info
from pagedllm.model import ModelConfig, load_model
from pagedllm.model.config import parse_config
from pagedllm.testing import tiny_config
from pagedllm.worker.model_runner import TorchModelRunner

from .parity_helpers import PROMPTS, HandDriver, HFReference, relative_error


def config_dict(arch: str = "llama", **overrides) -> dict:
    return tiny_config(arch, **overrides).to_dict()


@pytest.mark.parametrize(
    ("arch", "overrides", "message"),
    [
        (
            "llama",
            {"architectures": ["GPT2LMHeadModel"]},
            "unsupported architecture 'GPT2LMHeadModel'",
        ),
        ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
        ("llama", {"rope_scaling": {"rope_type": "linear"}}, "needs rope_scaling.factor"),
        ("llama", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ("llama", {"layer_types": ["full_attention", "chunked"]}, "unsupported layer_types"),
        ("llama", {"layer_types": ["full_attention"]}, "1 entries for 2 layers"),
        ("gemma3_text", {"use_bidirectional_attention": True}, "bidirectional"),
        ("gemma2", {"hidden_activation": "relu"}, "activation 'relu'"),
        ("llama", {"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
    ],
)
def test_unsupported_options_are_refused_by_name(arch, overrides, message) -> None:
    raw = config_dict(arch)
    raw.update(overrides)
    if "rope_scaling" in overrides:  # transformers 5 writes rope_parameters; old files rope_scaling
        raw.pop("rope_parameters", None)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        parse_config(raw)


def test_quantization_config_is_refused() -> None:
    raw = config_dict()
    raw["quantization_config"] = {"quant_method": "awq"}
    with pytest.raises(ValueError, match="awq"):
        parse_config(raw)


def test_mistral_default_window_applies_when_key_missing() -> None:
    raw = config_dict("mistral")
    del raw["sliding_window"]  # transformers' default is 4096 < max positions
    raw["max_position_embeddings"] = 32768
    config = parse_config(raw)
    assert config.sliding_windows == (4096, 4096)


def test_mistral_window_as_wide_as_context_is_full_attention() -> None:
    raw = config_dict("mistral", sliding_window=1024, max_position_embeddings=1024)
    config = parse_config(raw)
    assert config.sliding_windows == (None, None) and config.sliding_window is None


@pytest.mark.parametrize(
    ("arch", "overrides", "windows"),
    [
        ("mistral", {"sliding_window": 128}, (128, 128)),
        # Qwen2 slides the layers from max_window_layers on, only with use_sliding_window.
        (
            "qwen2",
            {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1},
            (None, 64),
        ),
        ("qwen2", {"use_sliding_window": False, "sliding_window": 64}, (None, None)),
        # Gemma 3's default pattern: five local layers, then a global one.
        ("gemma3_text", {"num_hidden_layers": 7, "layer_types": None}, (4,) * 5 + (None, 4)),
        ("gemma2", {}, (4, None)),
    ],
)
def test_layer_windows_from_the_config(arch, overrides, windows) -> None:
    raw = config_dict(arch, **overrides)
    assert parse_config(raw).sliding_windows == windows


def test_gemma_specifics() -> None:
    gemma2 = parse_config(config_dict("gemma2"))
    assert gemma2.norm_offset and gemma2.embed_scale and gemma2.sandwich_norm
    assert (gemma2.attn_softcap, gemma2.final_softcap) == (50.0, 30.0)
    assert gemma2.attn_scale == 16**-0.5 and gemma2.hidden_act == "gelu_pytorch_tanh"
    raw = config_dict("gemma3_text")
    raw["rope_parameters"]["full_attention"]["rope_theta"] = 1e6
    gemma3 = parse_config(raw)
    assert gemma3.qk_norm and gemma3.attn_softcap is None
    assert gemma3.rope.theta == 1e6 and gemma3.local_rope.theta == 10_000.0


def test_moe_specifics() -> None:
    mixtral = parse_config(config_dict("mixtral")).moe
    assert (mixtral.num_experts, mixtral.top_k, mixtral.norm_topk_prob) == (4, 2, True)
    raw = config_dict("qwen3_moe", num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3])
    qwen = parse_config(raw).moe
    assert qwen.sparse_layers == (False, True, False, False)
    assert (qwen.num_experts, qwen.intermediate_size, qwen.norm_topk_prob) == (8, 32, False)


def test_rope_scaling_old_and_new_spellings_agree() -> None:
    llama3 = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    new = config_dict(rope_scaling=llama3, rope_theta=500000.0)
    assert "rope_parameters" in new
    old = dict(new)
    del old["rope_parameters"]
    old["rope_theta"] = 500000.0
    old["rope_scaling"] = {**llama3, "type": "llama3"}
    del old["rope_scaling"]["rope_type"]
    assert parse_config(new).rope == parse_config(old).rope
    rope = parse_config(new).rope
    assert (rope.rope_type, rope.theta, rope.factor) == ("llama3", 500000.0, 8.0)


def test_family_specifics() -> None:
    qwen2 = parse_config(config_dict("qwen2"))
    assert qwen2.qkv_bias and not qwen2.o_bias and not qwen2.qk_norm
    qwen3 = parse_config(config_dict("qwen3"))
    assert qwen3.qk_norm and qwen3.head_dim == 32 and not qwen3.qkv_bias
    raw = config_dict("qwen3")
    del raw["head_dim"]  # Qwen3's default head_dim is 128, not hidden/heads
    assert parse_config(raw).head_dim == 128
    llama = parse_config(config_dict(attention_bias=True, mlp_bias=True))
    assert llama.qkv_bias and llama.o_bias and llama.mlp_bias
    # transformers hard-codes these families' biases, whatever the config says.
    qwen2_flagged = parse_config({**config_dict("qwen2"), "attention_bias": True})
    assert qwen2_flagged.qkv_bias and not qwen2_flagged.o_bias
    mistral = parse_config({**config_dict("mistral"), "attention_bias": True, "mlp_bias": True})
    assert not (mistral.qkv_bias or mistral.o_bias or mistral.mlp_bias)
    assert llama.num_kv_heads == 2 and llama.eos_token_ids == (256,)


def test_config_is_frozen() -> None:
    config = parse_config(config_dict())
    with pytest.raises((AttributeError, TypeError)):
        config.hidden_size = 3  # type: ignore[misc]


def test_load_hf_directory_with_tokenizer(tiny_llama) -> None:
    loaded = load_model(tiny_llama)
    assert loaded.name == tiny_llama.name
    assert isinstance(loaded.config, ModelConfig)
    # "auto": the float32 checkpoint runs in bf16 where the CPU has bf16 dot products.
    expected = torch.bfloat16 if cpu_info().bf16_dot else torch.float32
    assert loaded.dtype == expected and loaded.dtype_reason.startswith("auto: float32 checkpoint")
    assert loaded.tokenizer.encode("hi", add_special_tokens=False) == [ord("h"), ord("i")]
    assert loaded.tokenizer.chat_template


def test_dtype_auto_follows_config(tmp_path, tiny_llama) -> None:
    path = tmp_path / "bf16"
    shutil.copytree(tiny_llama, path)
    raw = json.loads((path / "config.json").read_text())
    raw["dtype"] = "bfloat16"
    (path / "config.json").write_text(json.dumps(raw))
    assert load_model(path, load_tokenizer=False).dtype == torch.bfloat16
    assert load_model(path, dtype="float32", load_tokenizer=False).dtype == torch.float32
    with pytest.raises(ValueError, match="dtype"):
        load_model(path, dtype="int8", load_tokenizer=False)


def test_dtype_auto_is_bf16_for_float32_checkpoints_where_the_cpu_has_bf16_dots() -> None:
    from pagedllm.kernels.probe import CpuInfo
    from pagedllm.model.loader import choose_dtype

    cpu = torch.device("cpu")
    epyc = CpuInfo("AMD EPYC", frozenset({"avx512f", "avx512_bf16"}), 2)
    xeon = CpuInfo("Xeon", frozenset({"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}), 2)
    old = CpuInfo("old", frozenset({"avx2", "fma"}), 2)
    f32, bf16 = (
        parse_config({**config_dict(), "torch_dtype": name, "dtype": name})
        for name in ("float32", "bfloat16")
    )
    dtype, why = choose_dtype("auto", f32, cpu, epyc)
    assert dtype == torch.bfloat16 and "avx512_bf16" in why and "--dtype float32" in why
    assert choose_dtype("auto", f32, cpu, xeon)[1].count("amx_bf16") == 1
    assert choose_dtype("auto", f32, cpu, old) == (
        torch.float32,
        "auto: float32 checkpoint, and this CPU has no bf16 dot products",
    )
    assert choose_dtype("float32", f32, cpu, epyc) == (torch.float32, "asked for (--dtype float32)")
    assert choose_dtype("auto", f32, torch.device("meta"), epyc)[0] == torch.float32
    assert choose_dtype("auto", bf16, cpu, old)[0] == torch.bfloat16


def test_sharded_checkpoint_matches_single(tmp_path, tiny_llama) -> None:
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32)
    hf.save_pretrained(sharded, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 2
    single = load_model(tiny_llama, load_tokenizer=False).model.state_dict()
    other = load_model(sharded, load_tokenizer=False).model.state_dict()
    assert single.keys() == other.keys()
    for name, tensor in single.items():
        assert torch.equal(tensor, other[name]), name


def test_missing_and_unexpected_weights_are_refused(tmp_path, tiny_llama) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tiny_llama / "model.safetensors"))
    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama, broken)
    without = {k: v for k, v in tensors.items() if "layers.1.mlp.up_proj" not in k}
    save_file(without, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks weights: layers\.1\.mlp\.gate_up_proj\.weight@up"):
        load_model(broken, load_tokenizer=False)
    save_file({**tensors, "model.extra.weight": torch.zeros(2)}, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match="unexpected weight 'model.extra.weight'"):
        load_model(broken, load_tokenizer=False)


def test_not_a_model_path(tmp_path) -> None:
    with pytest.raises(ValueError, match="neither a directory nor a .gguf"):
        load_model(tmp_path / "nothing")
    with pytest.raises(ValueError, match="no config.json"):
        load_model(tmp_path)


def test_runner_from_memory_budget(tiny_llama) -> None:
    loaded = load_model(tiny_llama, "float32", load_tokenizer=False)
    runner = TorchModelRunner.from_budget(loaded.model, block_size=4, kv_cache_memory=100_000)
    assert runner.num_blocks == 100_000 // runner.spec.bytes_per_block
    assert runner.vocab_size == loaded.config.vocab_size
    driver = HandDriver(runner)
    seq = driver.add("r", PROMPTS[1])
    rows = driver.step([driver.schedule(seq, len(PROMPTS[1]))])
    expected = HFReference(tiny_llama).logits(PROMPTS[1])[-1]
    assert relative_error(rows["r"], expected) <= 1e-4
