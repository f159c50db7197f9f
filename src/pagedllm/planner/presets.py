"""Model and device presets, and the normalised `ModelSpec` the arithmetic reads.

Model presets are the published ``config.json`` fields that matter for memory (layer
count, attention shape, MLP/MoE sizes, vocabulary), so the planner needs no download.
Device presets are the memory totals that ``nvidia-smi`` reports for each card (MiB),
which is what a serving engine's memory fraction is applied to.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pagedllm.gguf_header import GGUFHeader, gguf_config, read_header
from pagedllm.kv_dtypes import QUANTIZED_KV_DTYPES, kv_element_bytes

GIB = 1024**3
MIB = 1024**2

DTYPE_BYTES: dict[str, float] = {
    "float32": 4,
    "fp32": 4,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "bfloat16": 2,
    "bf16": 2,
    "fp8": 1,
    "float8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "int4": 0.5,
    "fp4": 0.5,
}


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """The shape of a decoder-only model, as far as memory is concerned.

    ``attention`` is ``"mha"`` (num_kv_heads == num_heads), ``"gqa"`` (fewer KV heads)
    or ``"mla"`` (multi-head latent attention: one compressed latent of
    ``kv_lora_rank`` plus a shared RoPE key of ``qk_rope_head_dim`` per token and
    layer, no separate V).
    """

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    weight_dtype: str = "bfloat16"
    # Multi-head latent attention (DeepSeek-V2/V3, Kimi K2).
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    # Mixture of experts: layers >= first_k_dense_replace use experts.
    num_routed_experts: int = 0
    num_shared_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    first_k_dense_replace: int = 0
    # Each layer's sliding window (None: full attention); empty: every layer is full.
    layer_windows: tuple[int | None, ...] = ()
    # A GGUF file's header: its weights are counted as the engine holds them (kept
    # quantized ones at their stored size, ``gguf_header.held_weight_bytes``).
    gguf: GGUFHeader | None = field(default=None, compare=False, repr=False)

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Each layer's window (None: full attention)."""
        return self.layer_windows or (None,) * self.num_layers

    @property
    def attention(self) -> str:
        if self.kv_lora_rank > 0:
            return "mla"
        return "mha" if self.num_kv_heads == self.num_heads else "gqa"

    @property
    def is_moe(self) -> bool:
        return self.num_routed_experts > 0


def spec_from_config(config: Mapping[str, Any], name: str | None = None) -> ModelSpec:
    """Read a HF ``config.json`` dict (Llama, Mistral, Qwen2/3, DeepSeek-V3, Kimi K2)."""
    text = config.get("text_config")
    if isinstance(text, Mapping):  # multimodal wrappers keep the decoder here
        config = {**config, **text}
    for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size"):
        if key not in config:
            raise ValueError(f"model config lacks {key!r}")
    num_heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    head_dim = config.get("head_dim") or hidden // num_heads
    return ModelSpec(
        name=name or _config_name(config),
        num_layers=int(config["num_hidden_layers"]),
        hidden_size=hidden,
        num_heads=num_heads,
        num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        intermediate_size=int(config.get("intermediate_size") or 4 * hidden),
        vocab_size=int(config["vocab_size"]),
        max_position_embeddings=int(config.get("max_position_embeddings") or 4096),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        weight_dtype=_config_weight_dtype(config),
        kv_lora_rank=int(config.get("kv_lora_rank") or 0),
        q_lora_rank=int(config.get("q_lora_rank") or 0),
        qk_rope_head_dim=int(config.get("qk_rope_head_dim") or 0),
        qk_nope_head_dim=int(config.get("qk_nope_head_dim") or 0),
        v_head_dim=int(config.get("v_head_dim") or 0),
        num_routed_experts=int(config.get("n_routed_experts") or config.get("num_experts") or 0),
        num_shared_experts=int(config.get("n_shared_experts") or 0),
        num_experts_per_tok=int(config.get("num_experts_per_tok") or 0),
        moe_intermediate_size=int(config.get("moe_intermediate_size") or 0),
        first_k_dense_replace=int(config.get("first_k_dense_replace") or 0),
        layer_windows=layer_windows(config),
    )


# Gemma 2 alternates local and global layers; Gemma 3 has five local layers to a global one.
_LOCAL_PATTERN = {"gemma2": 2, "gemma3_text": 6, "gemma3": 6}


def layer_windows(config: Mapping[str, Any]) -> tuple[int | None, ...]:
    """Each layer's sliding window from a HF config (empty: every layer is full): an
    explicit ``layer_types`` first; else Mistral slides every layer, Qwen2/3 with
    ``use_sliding_window`` the layers from ``max_window_layers`` on, Gemma 2/3 by their
    local/global pattern. A window as wide as the context is full attention."""
    num_layers = int(config["num_hidden_layers"])
    window = config.get("sliding_window")
    model_type = str(config.get("model_type", ""))
    if model_type.startswith("qwen") and not config.get("use_sliding_window", False):
        window = None
    max_pos = int(config.get("max_position_embeddings") or 0)
    if not window or (max_pos and int(window) >= max_pos):
        return ()
    types = config.get("layer_types")
    if types:
        sliding = [t == "sliding_attention" for t in types]
    elif model_type in _LOCAL_PATTERN:
        every = int(config.get("sliding_window_pattern") or _LOCAL_PATTERN[model_type])
        sliding = [(i + 1) % every != 0 for i in range(num_layers)]
    else:
        first = int(config.get("max_window_layers") or 0) if model_type.startswith("qwen") else 0
        sliding = [i >= first for i in range(num_layers)]
    if len(sliding) != num_layers:
        raise ValueError(f"layer_types has {len(sliding)} entries for {num_layers} layers")
    if not any(sliding):
        return ()
    return tuple(int(window) if s else None for s in sliding)


def _config_name(config: Mapping[str, Any]) -> str:
    name = config.get("_name_or_path") or ""
    if name:
        return str(name).rstrip("/").split("/")[-1]
    archs = config.get("architectures") or ["model"]
    return str(archs[0])


def _config_weight_dtype(config: Mapping[str, Any]) -> str:
    quant = config.get("quantization_config")
    if isinstance(quant, Mapping):
        method = str(quant.get("quant_method", "")).lower()
        if "fp8" in method:
            return "fp8"
        bits = quant.get("bits") or quant.get("weight_bits")
        if bits == 4:
            return "int4"
        if bits == 8:
            return "int8"
    dtype = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
    return str(dtype).removeprefix("torch.")


def _llama_like(
    name: str,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    inter: int,
    vocab: int,
    max_pos: int,
    **extra: Any,
) -> ModelSpec:
    return ModelSpec(
        name=name,
        num_layers=layers,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=extra.pop("head_dim", hidden // heads),
        intermediate_size=inter,
        vocab_size=vocab,
        max_position_embeddings=max_pos,
        **extra,
    )


def _mla(
    name: str, heads: int, experts: int, first_dense: int, vocab: int, max_pos: int
) -> ModelSpec:
    # DeepSeek-V3 and Kimi K2 share the MLA geometry: latent 512 + RoPE key 64.
    return ModelSpec(
        name=name,
        num_layers=61,
        hidden_size=7168,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=192,
        intermediate_size=18432,
        vocab_size=vocab,
        max_position_embeddings=max_pos,
        weight_dtype="fp8",
        kv_lora_rank=512,
        q_lora_rank=1536,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        num_routed_experts=experts,
        num_shared_experts=1,
        num_experts_per_tok=8,
        moe_intermediate_size=2048,
        first_k_dense_replace=first_dense,
    )


def model_presets() -> dict[str, ModelSpec]:
    """Built-in model shapes, keyed by lower-case name (copied from each ``config.json``)."""
    specs = [
        _llama_like("SmolLM2-135M", 30, 576, 9, 3, 1536, 49152, 8192, tie_word_embeddings=True),
        _llama_like("Llama-3.1-8B", 32, 4096, 32, 8, 14336, 128256, 131072),
        _llama_like("Llama-3.1-70B", 80, 8192, 64, 8, 28672, 128256, 131072),
        # Qwen2.5 instruct configs say 32,768 (131,072 with YaRN rope scaling).
        _llama_like("Qwen2.5-7B", 28, 3584, 28, 4, 18944, 152064, 32768),
        _llama_like("Qwen2.5-72B", 80, 8192, 64, 8, 29568, 152064, 32768),
        _llama_like("Mistral-7B", 32, 4096, 32, 8, 14336, 32768, 32768),  # v0.3
        _mla("DeepSeek-V3", 128, 256, 3, 129280, 163840),
        _mla("Kimi-K2", 64, 384, 1, 163840, 131072),
    ]
    return {spec.name.lower(): spec for spec in specs}


DEFAULT_MODEL = "SmolLM2-135M"


def resolve_model(model: str) -> ModelSpec:
    """A preset name, ``"default"``, a HF model directory, a ``config.json`` path or a
    ``.gguf`` file (only its header is read)."""
    presets = model_presets()
    key = DEFAULT_MODEL.lower() if model == "default" else model.lower()
    if key in presets:
        return presets[key]
    path = Path(model).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return spec_from_gguf(path)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        config = json.loads(path.read_text())
        name = path.parent.name if path.name == "config.json" else path.stem
        return spec_from_config(config, name=name)
    known = ", ".join(spec.name for spec in presets.values())
    raise ValueError(f"--model {model!r}: not a preset ({known}), 'default', or a config path")


def spec_from_gguf(path: Path) -> ModelSpec:
    """The spec of a GGUF file from its header: shapes from its metadata, weights as the
    engine holds them (``ModelSpec.gguf``)."""
    header = read_header(path)
    config = gguf_config(header.fields, [t.name for t in header.tensors])
    return replace(spec_from_config(config, name=path.stem), gguf=header)


@dataclass(frozen=True, slots=True)
class DevicePreset:
    name: str
    memory_bytes: int
    note: str = ""


def device_presets() -> dict[str, DevicePreset]:
    """Accelerator memory as ``nvidia-smi`` reports it (MiB), keyed by lower-case name."""
    devices = [
        DevicePreset("H100-80GB", 81559 * MIB, "H100 SXM/PCIe 80 GB HBM"),
        DevicePreset("H200-141GB", 143771 * MIB, "H200 141 GB HBM3e"),
        DevicePreset("A100-40GB", 40960 * MIB, "A100 40 GB"),
        DevicePreset("A100-80GB", 81920 * MIB, "A100 80 GB"),
        DevicePreset("L4-24GB", 23034 * MIB, "L4 24 GB GDDR6"),
    ]
    return {d.name.lower(): d for d in devices}


def this_machine() -> DevicePreset:
    """This host's RAM: ``MemTotal`` from /proc/meminfo, else ``os.sysconf``."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    kib = int(line.split()[1])
                    return DevicePreset("this machine", kib * 1024, "MemTotal, /proc/meminfo")
    except OSError:
        pass
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return DevicePreset("this machine", int(pages), "os.sysconf physical pages")


def resolve_memory(memory: str) -> DevicePreset:
    """``"80"`` / ``"80GiB"`` (GiB), a device preset name, or ``"this machine"``."""
    text = memory.strip()
    key = text.lower().replace("_", " ")
    if key in ("this machine", "this-machine", "host", "local"):
        return this_machine()
    presets = device_presets()
    if key in presets:
        return presets[key]
    try:
        num_bytes = parse_size(text)
    except ValueError:
        known = ", ".join(d.name for d in presets.values())
        raise ValueError(
            f"--memory {memory!r}: give a size (80 = 80 GiB, 24GiB, 16000MiB) or a device "
            f"({known}, 'this machine')"
        ) from None
    return DevicePreset(f"{num_bytes / GIB:g} GiB", num_bytes)


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")
_UNITS = {
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "m": MIB,
    "mib": MIB,
    "g": GIB,
    "gib": GIB,
    "t": 1024 * GIB,
    "tib": 1024 * GIB,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}


def parse_size(text: str | int, bare_unit: int = GIB) -> int:
    """Bytes from ``24GiB``, ``512MiB``, ``1.5G`` (binary), ``2GB`` (decimal) or a bare number.

    A bare number is in units of ``bare_unit``: GiB for the planner (``80``), bytes for
    the engine's ``--kv-cache-memory`` (``bare_unit=1``). An int is taken as bytes.
    """
    if isinstance(text, int):
        return text
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or (unit and unit not in _UNITS):
        raise ValueError(f"not a size: {text!r} (examples: 24GiB, 512MiB, 2GB)")
    number = float(match.group(1)) * (_UNITS[unit] if unit else bare_unit)
    if not math.isfinite(number):  # so many digits that float() gave inf
        raise ValueError(f"not a size: {text!r} is too large")
    value = int(number)
    if value <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return value


def kv_dtype_bytes(kv_dtype: str, head_dim: int, block_size: int) -> float:
    """Bytes per cached K/V element: the engine's quantized formats (``int8``, ``int4``,
    ``fp8_e4m3``, ``fp8_e5m2``: ``pagedllm.kv_dtypes``) with their scales, else
    ``dtype_bytes``."""
    if kv_dtype in QUANTIZED_KV_DTYPES:
        return kv_element_bytes(kv_dtype, head_dim, block_size)
    return dtype_bytes(kv_dtype)


def dtype_bytes(dtype: str) -> float:
    """Bytes per element of a dtype name (``bf16``, ``fp8``, ``float32``, ``int4`` ...)."""
    key = dtype.lower().removeprefix("torch.")
    if key not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(sorted(DTYPE_BYTES))}")
    return DTYPE_BYTES[key]
