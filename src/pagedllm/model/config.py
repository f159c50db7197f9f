"""Parse and validate a Hugging Face ``config.json`` into a frozen ``ModelConfig``.

Only what the decoder in ``model/llama.py`` runs exactly is accepted. Anything else
(another architecture, a sliding window, an unknown rope type, a non-SiLU activation,
a quantised checkpoint) is refused here with a message naming it, never run wrong.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
SUPPORTED_ROPE_TYPES = ("default", "llama3")

# transformers' per-family defaults for keys a config.json may leave out.
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048},
    "mistral": {"rms_norm_eps": 1e-6, "max_position_embeddings": 4096 * 32, "sliding_window": 4096},
    "qwen2": {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768},
    "qwen3": {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "head_dim": 128},
}


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary embedding parameters (``rope_type`` is "default" or "llama3")."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """What the Llama-family decoder needs, with Hugging Face's field names.

    ``qkv_bias``: q/k/v projections have a bias (Qwen2, or ``attention_bias``);
    ``o_bias``: the output projection has one (``attention_bias`` only);
    ``qk_norm``: per-head RMSNorm on q and k before rotary (Qwen3).
    """

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None

    @property
    def num_layers(self) -> int:
        return self.num_hidden_layers

    @property
    def num_heads(self) -> int:
        return self.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        return self.num_key_value_heads

    @property
    def kv_bytes_per_token_per_element(self) -> int:
        """K and V elements per token across all layers (multiply by the dtype size)."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Validate a ``config.json`` dict; ``ValueError`` names anything unsupported."""
        return parse_config(raw)

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        """Read ``config.json`` (or the directory holding it)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ValueError(f"no config.json at {path}")
        return parse_config(json.loads(path.read_text()))


def parse_config(raw: dict[str, Any]) -> ModelConfig:
    """Validate a ``config.json`` dict into a ``ModelConfig``."""
    architecture = _architecture(raw)
    family = SUPPORTED_ARCHITECTURES[architecture]
    values = {**_FAMILY_DEFAULTS[family], **{k: v for k, v in raw.items() if v is not None}}
    if raw.get("sliding_window", "absent") is None:
        values.pop("sliding_window", None)
    _refuse_unsupported(values, family)
    hidden_size = _positive_int(values, "hidden_size")
    num_heads = _positive_int(values, "num_attention_heads")
    num_kv_heads = _positive_int(
        {"num_key_value_heads": num_heads, **values}, "num_key_value_heads"
    )
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_attention_heads ({num_heads}) must be a multiple of "
            f"num_key_value_heads ({num_kv_heads})"
        )
    head_dim = values.get("head_dim") or hidden_size // num_heads
    # Which projections carry biases is fixed per family in transformers' own code.
    attention_bias = family in ("llama", "qwen3") and bool(values.get("attention_bias", False))
    eos = values.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    max_positions = _positive_int(values, "max_position_embeddings")
    return ModelConfig(
        architecture=architecture,
        model_type=family,
        vocab_size=_positive_int(values, "vocab_size"),
        hidden_size=hidden_size,
        intermediate_size=_positive_int(values, "intermediate_size"),
        num_hidden_layers=_positive_int(values, "num_hidden_layers"),
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=int(head_dim),
        max_position_embeddings=max_positions,
        rms_norm_eps=float(values["rms_norm_eps"]),
        rope=_rope(values, max_positions),
        tie_word_embeddings=bool(values.get("tie_word_embeddings", False)),
        qkv_bias=family == "qwen2" or attention_bias,
        o_bias=attention_bias,
        mlp_bias=family == "llama" and bool(values.get("mlp_bias", False)),
        qk_norm=family == "qwen3",
        bos_token_id=values.get("bos_token_id"),
        eos_token_ids=eos_ids,
        torch_dtype=values.get("torch_dtype") or values.get("dtype"),
    )


def _architecture(raw: dict[str, Any]) -> str:
    architectures = raw.get("architectures") or []
    if len(architectures) != 1:
        raise ValueError(f"config.json must name exactly one architecture, got {architectures!r}")
    architecture = architectures[0]
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: "
            f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )
    return architecture


def _refuse_unsupported(values: dict[str, Any], family: str) -> None:
    act = values.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported hidden_act {act!r}; only 'silu' (SwiGLU) is supported")
    if values.get("quantization_config"):
        method = values["quantization_config"].get("quant_method", "?")
        raise ValueError(f"unsupported quantization_config (quant_method={method!r})")
    if int(values.get("pretraining_tp", 1)) != 1:
        raise ValueError(f"unsupported pretraining_tp={values['pretraining_tp']}; only 1")
    if float(values.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("unsupported partial_rotary_factor; only 1.0 (full rotary)")
    _refuse_sliding_window(values, family)


def _refuse_sliding_window(values: dict[str, Any], family: str) -> None:
    """A window narrower than the context changes attention: refuse it by name."""
    layer_types = values.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise ValueError(
            f"unsupported layer_types {sorted(set(layer_types))}: only full attention is supported"
        )
    window = values.get("sliding_window")
    if window is None:
        return
    if family in ("qwen2", "qwen3"):
        uses_window = bool(values.get("use_sliding_window", False)) and int(
            values.get("max_window_layers", 28)
        ) < int(values["num_hidden_layers"])
    else:
        uses_window = True
    if uses_window and int(window) < int(values["max_position_embeddings"]):
        raise ValueError(
            f"unsupported sliding_window={window} (smaller than max_position_embeddings="
            f"{values['max_position_embeddings']}); only full attention is supported"
        )


def _rope(values: dict[str, Any], max_positions: int) -> RopeConfig:
    """Read rope parameters from ``rope_parameters`` (transformers 5) or ``rope_scaling``."""
    params = dict(values.get("rope_parameters") or {})
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ValueError("unsupported per-layer-type rope_parameters")
    scaling = values.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", values.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("unsupported partial_rotary_factor; only 1.0 (full rotary)")
    if rope_type == "default":
        return RopeConfig(theta=theta)
    for key in ("factor", "low_freq_factor", "high_freq_factor"):
        if key not in params:
            raise ValueError(f"rope type 'llama3' needs rope_scaling.{key}")
    return RopeConfig(
        theta=theta,
        rope_type="llama3",
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", max_positions)
        ),
    )


def _positive_int(values: dict[str, Any], key: str) -> int:
    if key not in values:
        raise ValueError(f"config.json lacks {key!r}")
    value = values[key]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"config.json {key!r} must be a positive integer, got {value!r}")
    return value
