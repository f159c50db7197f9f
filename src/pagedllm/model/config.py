"""Parse and validate a Hugging Face ``config.json`` into a frozen ``ModelConfig``.

Only what the decoders in ``model/`` run exactly is accepted. Anything else (another
architecture, an unknown rope type or activation, a quantised checkpoint) is refused here
with a message naming it, never run wrong.

The Llama family (Llama, Mistral, Qwen2, Qwen3) is read from the dict directly. The
families added later (Gemma 2/3, Mixtral, Qwen3-MoE) go through transformers' own config
class first, so that defaults a ``config.json`` leaves out (Gemma 3's layer pattern and
local rope base, Qwen3-MoE's sparse step) are the ones transformers runs with.
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
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}
# Families whose config goes through transformers' config class (see the module docstring).
NORMALISED_FAMILIES = (
    "gemma2",
    "gemma3_text",
    "mixtral",
    "qwen3_moe",
    "deepseek_v2",
    "deepseek_v3",
)
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear", "yarn")
ROUTER_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"

# transformers' per-family defaults for keys a config.json may leave out.
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048},
    "mistral": {"rms_norm_eps": 1e-6, "max_position_embeddings": 4096 * 32, "sliding_window": 4096},
    "qwen2": {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768},
    "qwen3": {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "head_dim": 128},
}


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary embedding parameters (``rope_type`` is "default", "llama3" or "linear":
    positions divided by ``factor``)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # YaRN (DeepSeek): the ramp between interpolated and extrapolated frequencies, and
    # the magnitude scales (cos/sin times attention_factor; softmax scale times
    # mscale(factor, mscale_all_dim) squared).
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True, slots=True)
class MlaConfig:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): the cache holds, per token
    and layer, the ``kv_lora_rank`` latent and the ``qk_rope_head_dim`` rope key."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True  # rope on interleaved pairs (as DeepSeek's weights are)

    @property
    def latent_dim(self) -> int:
        """Elements a token takes per layer in the cache."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True, slots=True)
class MoeConfig:
    """A mixture-of-experts MLP: the router's scoring and top-k, the experts' size, and
    which layers are sparse (``sparse_layers[i]``; the others keep a dense MLP)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    sparse_layers: tuple[bool, ...]
    scoring: str = "softmax"  # "softmax" over all experts, or "sigmoid" (DeepSeek-V3)
    routed_scaling_factor: float = 1.0
    num_shared_experts: int = 0
    # "greedy": top-k of all experts; "group_limited_greedy" (DeepSeek-V2): only from the
    # topk_groups groups with the best expert; "noaux_tc" (V3): groups ranked by their two
    # best scores + correction bias, experts chosen on the biased scores, weighted unbiased.
    method: str = "greedy"
    num_groups: int = 1
    topk_groups: int = 1


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """What the Llama-family decoder needs, with Hugging Face's field names.

    ``qkv_bias``: q/k/v projections have a bias (Qwen2, or ``attention_bias``);
    ``o_bias``: the output projection has one (``attention_bias`` only);
    ``qk_norm``: per-head RMSNorm on q and k before rotary (Qwen3, Gemma 3).
    ``layer_types``: per layer "full_attention" or "sliding_attention" (a window of the last
    ``sliding_window`` positions, the query's own included); empty = all full.
    Gemma: ``norm_offset`` (norms scale by 1 + weight), ``embed_scale`` (embeddings times
    sqrt(hidden_size)), ``sandwich_norm`` (norms after attention and around the MLP too),
    ``attn_scale`` (query_pre_attn_scalar ** -0.5), ``attn_softcap`` / ``final_softcap``
    (tanh soft-capping of scores / logits), ``local_rope`` (sliding layers' rope).
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
    hidden_act: str = "silu"
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    norm_offset: bool = False
    embed_scale: bool = False
    sandwich_norm: bool = False
    attn_scale: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    local_rope: RopeConfig | None = None
    moe: MoeConfig | None = None
    mla: MlaConfig | None = None

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer ``layer``, or None for full attention."""
        if self.layer_types and self.layer_types[layer] == SLIDING_ATTENTION:
            return self.sliding_window
        return None

    @property
    def sliding_windows(self) -> tuple[int | None, ...]:
        """``layer_window`` of every layer."""
        return tuple(self.layer_window(i) for i in range(self.num_hidden_layers))

    @property
    def uniform_sliding_window(self) -> int | None:
        """The window when every layer slides (the KV manager can then release blocks
        that fell out of it), else None."""
        windows = set(self.sliding_windows)
        return windows.pop() if len(windows) == 1 else None

    @property
    def uses_llama_decoder(self) -> bool:
        """The plain Llama-family decoder (``model/llama.py``) runs this model."""
        return self.model_type in ("llama", "mistral", "qwen2", "qwen3")

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
    if family in NORMALISED_FAMILIES:
        return _parse_normalised(raw, architecture, family)
    values = {**_FAMILY_DEFAULTS[family], **{k: v for k, v in raw.items() if v is not None}}
    if raw.get("sliding_window", "absent") is None:
        values.pop("sliding_window", None)
    _refuse_unsupported(values, family)
    common = _common_fields(
        {"num_key_value_heads": values.get("num_attention_heads"), **values}, architecture, family
    )
    # Which projections carry biases is fixed per family in transformers' own code.
    attention_bias = family in ("llama", "qwen3") and bool(values.get("attention_bias", False))
    return ModelConfig(
        **common,
        rope=_rope(values, common["max_position_embeddings"]),
        qkv_bias=family == "qwen2" or attention_bias,
        o_bias=attention_bias,
        mlp_bias=family == "llama" and bool(values.get("mlp_bias", False)),
        qk_norm=family == "qwen3",
        torch_dtype=values.get("torch_dtype") or values.get("dtype"),
        **_window_fields(values, family),
    )


def _window_fields(values: dict[str, Any], family: str) -> dict[str, Any]:
    """``layer_types`` and ``sliding_window`` of a Llama-family config: Mistral slides every
    layer; Qwen2/3 with ``use_sliding_window`` slide layers from ``max_window_layers`` on
    (transformers' rule); an explicit ``layer_types`` wins."""
    num_layers = int(values["num_hidden_layers"])
    window = values.get("sliding_window")
    if family in ("qwen2", "qwen3") and not values.get("use_sliding_window", False):
        window = None
    types = values.get("layer_types")
    if not types:
        first = int(values.get("max_window_layers", 0)) if family in ("qwen2", "qwen3") else 0
        types = [
            SLIDING_ATTENTION if window is not None and i >= first else FULL_ATTENTION
            for i in range(num_layers)
        ]
    types = _checked_layer_types(types, num_layers)
    if window is None and SLIDING_ATTENTION in types:
        raise ValueError("layer_types has sliding_attention layers but sliding_window is unset")
    if window is not None and int(window) >= int(values["max_position_embeddings"]):
        window = None  # as wide as the context: full attention
        types = (FULL_ATTENTION,) * num_layers
    if window is None or SLIDING_ATTENTION not in types:
        return {}
    return {"layer_types": types, "sliding_window": _positive_int({"w": window}, "w")}


def _checked_layer_types(types: Any, num_layers: int) -> tuple[str, ...]:
    types = tuple(types)
    if len(types) != num_layers:
        raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers")
    unknown = sorted(set(types) - {FULL_ATTENTION, SLIDING_ATTENTION})
    if unknown:
        raise ValueError(f"unsupported layer_types {unknown}: only full and sliding attention")
    return types


def _parse_normalised(raw: dict[str, Any], architecture: str, family: str) -> ModelConfig:
    """Gemma 2/3, Mixtral and Qwen3-MoE, their defaults filled by transformers."""
    values = _transformers_values(raw, family)
    if values.get("quantization_config"):
        method = values["quantization_config"].get("quant_method", "?")
        raise ValueError(f"unsupported quantization_config (quant_method={method!r})")
    act = values.get("hidden_activation") or values.get("hidden_act") or "silu"
    if act not in SUPPORTED_ACTIVATIONS:
        raise ValueError(
            f"unsupported activation {act!r}; supported: {', '.join(SUPPORTED_ACTIVATIONS)}"
        )
    if values.get("use_bidirectional_attention"):
        raise ValueError("unsupported use_bidirectional_attention (an encoder, not a decoder)")
    gemma = family.startswith("gemma")
    common = _common_fields(values, architecture, family)
    rope, local_rope = _layer_type_ropes(values, common["max_position_embeddings"])
    attention_bias = bool(values.get("attention_bias", False))
    return ModelConfig(
        **common,
        rope=rope,
        qkv_bias=attention_bias,
        o_bias=attention_bias,
        qk_norm=family in ("gemma3_text", "qwen3_moe"),
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        hidden_act=act,
        norm_offset=gemma,
        embed_scale=gemma,
        sandwich_norm=gemma,
        attn_scale=float(values["query_pre_attn_scalar"]) ** -0.5 if gemma else None,
        attn_softcap=_optional_float(values.get("attn_logit_softcapping")),
        final_softcap=_optional_float(values.get("final_logit_softcapping")),
        local_rope=local_rope,
        moe=_moe(values, family),
        mla=_mla(values, family),
        **_window_fields(values, family),
    )


def _common_fields(values: dict[str, Any], architecture: str, family: str) -> dict[str, Any]:
    """The ``ModelConfig`` fields every family reads the same way."""
    hidden_size = _positive_int(values, "hidden_size")
    num_heads = _positive_int(values, "num_attention_heads")
    num_kv_heads = _positive_int(values, "num_key_value_heads")
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_attention_heads ({num_heads}) must be a multiple of "
            f"num_key_value_heads ({num_kv_heads})"
        )
    eos = values.get("eos_token_id")
    return {
        "architecture": architecture,
        "model_type": family,
        "vocab_size": _positive_int(values, "vocab_size"),
        "hidden_size": hidden_size,
        "intermediate_size": _positive_int(values, "intermediate_size"),
        "num_hidden_layers": _positive_int(values, "num_hidden_layers"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": int(values.get("head_dim") or hidden_size // num_heads),
        "max_position_embeddings": _positive_int(values, "max_position_embeddings"),
        "rms_norm_eps": float(values["rms_norm_eps"]),
        "tie_word_embeddings": bool(values.get("tie_word_embeddings", False)),
        "bos_token_id": values.get("bos_token_id"),
        "eos_token_ids": tuple(eos)
        if isinstance(eos, list)
        else (() if eos is None else (int(eos),)),
    }


def _transformers_values(raw: dict[str, Any], family: str) -> dict[str, Any]:
    """``raw`` through transformers' config class of ``family``: every default filled."""
    from transformers import AutoConfig

    fields = {k: v for k, v in raw.items() if k not in ("model_type", "transformers_version")}
    try:
        return AutoConfig.for_model(family, **fields).to_dict()
    except (TypeError, ValueError, KeyError) as error:
        raise ValueError(f"invalid {family} config: {error}") from error


def _layer_type_ropes(
    values: dict[str, Any], max_positions: int
) -> tuple[RopeConfig, RopeConfig | None]:
    """(full layers' rope, sliding layers' rope or None) from ``rope_parameters``, which is
    keyed by layer type where the two differ (Gemma 3)."""
    params = values.get("rope_parameters") or {}
    if params and all(isinstance(v, dict) for v in params.values()):
        full = _rope({"rope_parameters": params[FULL_ATTENTION]}, max_positions)
        local = params.get(SLIDING_ATTENTION)
        return full, None if local is None else _rope({"rope_parameters": local}, max_positions)
    return _rope(values, max_positions), None


def _moe(values: dict[str, Any], family: str) -> MoeConfig | None:
    if family == "mixtral":
        num_layers = int(values["num_hidden_layers"])
        return MoeConfig(
            num_experts=_positive_int(values, "num_local_experts"),
            top_k=_positive_int(values, "num_experts_per_tok"),
            intermediate_size=_positive_int(values, "intermediate_size"),
            norm_topk_prob=True,
            sparse_layers=(True,) * num_layers,
        )
    if family in ("deepseek_v2", "deepseek_v3"):
        return _deepseek_moe(values, family)
    if family == "qwen3_moe":
        num_layers = int(values["num_hidden_layers"])
        step = int(values.get("decoder_sparse_step") or 1)
        dense = set(values.get("mlp_only_layers") or ())
        # transformers 5 writes num_local_experts; older files num_experts.
        num_experts = int(values.get("num_local_experts") or values.get("num_experts") or 0)
        sparse = tuple(
            i not in dense and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers)
        )
        return MoeConfig(
            num_experts=num_experts,
            top_k=_positive_int(values, "num_experts_per_tok"),
            intermediate_size=_positive_int(values, "moe_intermediate_size"),
            norm_topk_prob=bool(values.get("norm_topk_prob", False)),
            sparse_layers=sparse,
        )
    return None


def _deepseek_moe(values: dict[str, Any], family: str) -> MoeConfig:
    num_layers = int(values["num_hidden_layers"])
    first_dense = int(values.get("first_k_dense_replace") or 0)
    v3 = family == "deepseek_v3"
    method = "noaux_tc" if v3 else (values.get("topk_method") or "greedy")
    if method not in ROUTER_METHODS:
        raise ValueError(f"unsupported topk_method {method!r}; supported: {ROUTER_METHODS}")
    num_experts = _positive_int(
        {"n_routed_experts": values.get("n_routed_experts") or values.get("num_local_experts")},
        "n_routed_experts",
    )
    groups = int(values.get("n_group") or 1)
    if num_experts % groups:
        raise ValueError(f"n_group ({groups}) must divide n_routed_experts ({num_experts})")
    return MoeConfig(
        num_experts=num_experts,
        top_k=_positive_int(values, "num_experts_per_tok"),
        intermediate_size=_positive_int(values, "moe_intermediate_size"),
        # transformers' DeepSeek-V2 never renormalises the top-k weights.
        norm_topk_prob=v3 and bool(values.get("norm_topk_prob", True)),
        sparse_layers=tuple(i >= first_dense for i in range(num_layers)),
        scoring="sigmoid" if v3 else "softmax",
        routed_scaling_factor=float(values.get("routed_scaling_factor") or 1.0),
        num_shared_experts=int(values.get("n_shared_experts") or 0),
        method=method,
        num_groups=groups,
        topk_groups=int(values.get("topk_group") or 1),
    )


def _mla(values: dict[str, Any], family: str) -> MlaConfig | None:
    if family not in ("deepseek_v2", "deepseek_v3"):
        return None
    q_lora = values.get("q_lora_rank")
    return MlaConfig(
        q_lora_rank=None if q_lora is None else int(q_lora),
        kv_lora_rank=_positive_int(values, "kv_lora_rank"),
        qk_nope_head_dim=_positive_int(values, "qk_nope_head_dim"),
        qk_rope_head_dim=_positive_int(values, "qk_rope_head_dim"),
        v_head_dim=_positive_int(values, "v_head_dim"),
        # DeepSeek-V2's rope always pairs interleaved dimensions; V3 says so in its config.
        rope_interleave=family == "deepseek_v2" or bool(values.get("rope_interleave", True)),
    )


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


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
    if rope_type == "linear":
        if "factor" not in params:
            raise ValueError("rope type 'linear' needs rope_scaling.factor")
        return RopeConfig(theta=theta, rope_type="linear", factor=float(params["factor"]))
    if rope_type == "yarn":
        return _yarn(params, theta, max_positions)
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


def _yarn(params: dict[str, Any], theta: float, max_positions: int) -> RopeConfig:
    original = params.get("original_max_position_embeddings")
    if original is None:
        raise ValueError("rope type 'yarn' needs rope_scaling.original_max_position_embeddings")
    factor = params.get("factor") or max_positions / int(original)
    attention_factor = params.get("attention_factor")
    return RopeConfig(
        theta=theta,
        rope_type="yarn",
        factor=float(factor),
        original_max_position_embeddings=int(original),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=float(params.get("mscale") or 0),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0),
        attention_factor=None if attention_factor is None else float(attention_factor),
        truncate=bool(params.get("truncate", True)),
    )


def _positive_int(values: dict[str, Any], key: str) -> int:
    if key not in values:
        raise ValueError(f"config.json lacks {key!r}")
    value = values[key]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"config.json {key!r} must be a positive integer, got {value!r}")
    return value
