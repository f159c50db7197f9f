"""Test doubles shipped with the package: a tiny byte-level tokenizer and tiny random checkpoints.

Nothing here downloads anything: the tokenizer is built from bytes, the weights are random.
Used by pagedllm's own tests and usable by anyone who wants to exercise the engine or the
server without a real model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TINY_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
# Multi-head latent attention small enough for tests (latent 32 + rope 8 per token).
_TINY_MLA = {
    "kv_lora_rank": 32,
    "num_key_value_heads": 4,  # transformers expands K/V to every head
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "moe_intermediate_size": 32,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
}
# Family settings of the tiny checkpoints (before the caller's overrides): head sizes
# transformers has no default for, and experts small enough for tests.
_FAMILY_VALUES: dict[str, dict[str, Any]] = {
    "mistral": {"sliding_window": None},
    "qwen3": {"head_dim": 32},
    "gemma2": {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 4},
    "gemma3_text": {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 4},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {
        "head_dim": 16,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
    },
    "deepseek_v2": {**_TINY_MLA, "q_lora_rank": None, "n_routed_experts": 4},
    "deepseek_v3": {
        **_TINY_MLA,
        "q_lora_rank": 24,
        "n_routed_experts": 8,
        "n_group": 4,
        "topk_group": 2,
    },
}


def make_tiny_tokenizer(path: str | Path) -> Any:
    """A byte-level BPE tokenizer with no merges: one token per byte, plus ChatML specials.

    Token ids 0..255 are bytes (in the GPT-2 byte-to-unicode order), 256 is
    ``<|endoftext|>`` (bos, eos and pad), 257/258 are ``<|im_start|>``/``<|im_end|>``.
    Saved to ``path`` and returned as a ``PreTrainedTokenizerFast``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=_byte_order_key())
    vocab = {ch: i for i, ch in enumerate(byte_chars)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = CHATML_TEMPLATE
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(path)
    return fast


def _byte_order_key():
    """Order the ByteLevel alphabet so that token id == byte value."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += list(range(ord("®"), ord("ÿ") + 1))
    byte_to_char: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in byte_to_char:
            byte_to_char[b] = chr(256 + extra)
            extra += 1
    char_to_byte = {c: b for b, c in byte_to_char.items()}
    return lambda ch: char_to_byte[ch]


def tiny_config(arch: str = "llama", **overrides: Any) -> Any:
    """A small ``transformers`` config of the given family (defaults: 2 layers, GQA 4/2)."""
    from transformers import AutoConfig

    if arch not in ARCHITECTURES:
        raise ValueError(f"arch must be one of {sorted(ARCHITECTURES)}, got {arch!r}")
    values: dict[str, Any] = {
        "vocab_size": 320,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 256,
        "eos_token_id": 256,
        "pad_token_id": 256,
        "architectures": [ARCHITECTURES[arch]],
    }
    values.update(_FAMILY_VALUES.get(arch, {}))
    values.update(overrides)
    return AutoConfig.for_model(arch, **values)


def make_tiny_checkpoint(
    path: str | Path,
    arch: str = "llama",
    *,
    seed: int = 0,
    dtype: str = "float32",
    **config_overrides: Any,
) -> Path:
    """Write a random-weight HF checkpoint (config, safetensors, tokenizer) to ``path``.

    ``config_overrides`` go to the config (e.g. ``tie_word_embeddings=True``,
    ``rope_scaling={...}``, ``attention_bias=True``). Returns ``path``.
    """
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(path)
    config = tiny_config(arch, **config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    _randomise_norms(model, seed)
    model.save_pretrained(path, safe_serialization=True)
    make_tiny_tokenizer(path)
    return path


def _randomise_norms(model: Any, seed: int) -> None:
    """Norm weights start at 1.0 and biases at 0.0; perturb both so a dropped one cannot hide."""
    import torch

    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's router bias
                buffer.copy_(torch.rand(buffer.shape, generator=generator) * 0.2)
        for name, param in model.named_parameters():
            if "norm" in name:
                noise = torch.rand(param.shape, generator=generator) * 0.5 + 0.75
                param.copy_(noise.to(param.dtype))
            elif name.endswith("bias"):
                noise = torch.randn(param.shape, generator=generator) * 0.1
                param.copy_(noise.to(param.dtype))


def write_json(path: str | Path, data: dict) -> None:
    Path(path).write_text(json.dumps(data, indent=2))


@dataclass(frozen=True)
class FakeEngineFactory:
    """An ``EngineFactory`` (``pagedllm.engine.core``) of an ``LLMEngine`` over the
    ``FakeModelRunner`` and the tokenizer saved at ``tokenizer_path`` (``make_tiny_tokenizer``):
    the engine core in its own process with no model. Generated tokens are lowercase letters
    unless ``runner_kw`` says otherwise."""

    tokenizer_path: str
    num_blocks: int = 64
    block_size: int = 4
    max_model_len: int = 128
    runner_kw: dict[str, Any] = field(default_factory=dict)
    engine_kw: dict[str, Any] = field(default_factory=dict)
    startup_s: float = 0.0  # a slow start (a model load, a kernel build) before the engine
    # A file made as the engine's build begins: a test waits for it to act mid-start.
    building_marker: str | None = None

    def build_engine(self) -> Any:
        import time
        from pathlib import Path

        from pagedllm.engine.config import EngineConfig
        from pagedllm.engine.llm_engine import LLMEngine
        from pagedllm.worker.fake_runner import FakeModelRunner

        if self.building_marker is not None:
            Path(self.building_marker).touch()
        time.sleep(self.startup_s)
        tokenizer = self.load_tokenizer()
        runner_kw = {"allowed_token_ids": range(ord("a"), ord("z") + 1), **self.runner_kw}
        runner = FakeModelRunner(
            self.num_blocks, self.block_size, vocab_size=len(tokenizer), **runner_kw
        )
        config = EngineConfig(
            block_size=self.block_size, max_model_len=self.max_model_len, **self.engine_kw
        )
        return LLMEngine(config, runner, tokenizer)

    def load_tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.tokenizer_path)

    def beside(self, tokenizer: Any) -> FakeEngineFactory:
        return self  # a tiny tokenizer: the core loads its own
