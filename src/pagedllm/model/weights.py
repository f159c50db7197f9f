"""Hugging Face tensor names -> the fused parameters of ``model/decoder.py``.

A checkpoint tensor lands in a slice of one parameter: a part (q/k/v rows of
``qkv_proj``, gate/up rows of ``gate_up_proj``), an expert (the first index of the stacked
``experts_gate_up`` / ``experts_down``), or both. A ``QuantWeight`` (a GGUF linear kept as
stored) is not copied: once all parts of its linear have come, in one layout, the linear
keeps them fused as its only weight (``Linear.keep_quantized``). Experts come per expert (Mixtral's
``block_sparse_moe.experts.E.w1/w2/w3``, Qwen3-MoE's and DeepSeek's
``mlp.experts.E.gate_proj/up_proj/down_proj``) or already stacked (transformers 5's
``mlp.experts.gate_up_proj`` / ``down_proj``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple, Protocol, runtime_checkable

import torch
from torch import nn

from pagedllm.kernels.quant import QuantParts, QuantWeight, concat_rows, dequantize

_FUSED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}
# One expert's projection -> (stacked parameter, part).
_EXPERT = {
    "w1": ("experts_gate_up", "gate"),
    "w3": ("experts_gate_up", "up"),
    "w2": ("experts_down", ""),
    "gate_proj": ("experts_gate_up", "gate"),
    "up_proj": ("experts_gate_up", "up"),
    "down_proj": ("experts_down", ""),
}
_PARTS = {"qkv_proj": ("q", "k", "v"), "gate_up_proj": ("gate", "up")}


class Target(NamedTuple):
    """Where one checkpoint tensor goes: ``param[expert]`` (when not None), rows ``part``."""

    param: str
    expert: int | None = None
    part: str = ""


def map_name(hf_name: str, tied: bool, num_layers: int | None = None) -> Target | None:
    """A checkpoint name -> its ``Target``; None for tensors to skip (rotary buffers, a
    tied head's copy, layers past ``num_layers``: DeepSeek-V3's multi-token-prediction
    layer, which generation does not run)."""
    if "rotary_emb" in hf_name:
        return None
    name = hf_name.removeprefix("model.")
    if name == "lm_head.weight" and tied:
        return None
    layer = name.split(".")[1] if name.startswith("layers.") else ""
    if num_layers is not None and layer.isdigit() and int(layer) >= num_layers:
        return None
    parts = name.replace("block_sparse_moe.", "mlp.").split(".")
    if "experts" in parts:
        at = parts.index("experts")
        prefix = ".".join(parts[:at])
        if parts[at + 1].isdigit():  # experts.E.proj.weight
            param, part = _EXPERT[parts[at + 2]]
            return Target(f"{prefix}.{param}", int(parts[at + 1]), part)
        stacked = {"gate_up_proj": "experts_gate_up", "down_proj": "experts_down"}
        return Target(f"{prefix}.{stacked[parts[at + 1]]}")
    if len(parts) >= 2 and parts[-2] in _FUSED:
        fused, part = _FUSED[parts[-2]]
        return Target(".".join([*parts[:-2], fused, parts[-1]]), None, part)
    return Target(".".join(parts))


def part_rows(model: nn.Module, param: str, part: str, rows: int) -> tuple[int, int]:
    """Row range of ``part`` inside a fused parameter of ``rows`` rows."""
    if part in ("gate", "up"):
        half = rows // 2
        return (0, half) if part == "gate" else (half, rows)
    config = model.config  # type: ignore[attr-defined]
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    return {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv)}[part]


def load_into(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor | QuantWeight]]) -> None:
    """Copy every checkpoint tensor into its slice (quantized ones: ``place_quantized``);
    ``ValueError`` for an unknown name, a shape mismatch, or a parameter slice left unset."""
    params = dict(model.named_parameters())
    config = model.config  # type: ignore[attr-defined]
    loaded: set[Target] = set()
    quantized: dict[str, dict[str, QuantWeight]] = {}
    for hf_name, tensor in weights:
        target = map_name(hf_name, bool(config.tie_word_embeddings), config.num_hidden_layers)
        if target is None:
            continue
        plain = hf_name.removeprefix("model.")
        if target.part and target.param not in params and plain in params:
            target = Target(plain)  # a model that keeps this projection unfused (MLA's q_proj)
        if target.param not in params:
            raise ValueError(f"unexpected weight {hf_name!r} for {type(model).__name__}")
        param = params[target.param].data
        dest = param if target.expert is None else param[target.expert]
        if target.part:
            start, stop = part_rows(model, target.param, target.part, dest.shape[0])
            dest = dest[start:stop]
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ValueError(
                f"weight {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
            )
        if isinstance(tensor, QuantWeight):
            if target.expert is not None:
                raise ValueError(f"quantized expert weight {hf_name!r} is not supported")
            quantized.setdefault(target.param, {})[target.part] = tensor
        else:
            with torch.no_grad():
                dest.copy_(tensor)
        loaded.update(_covered(target, param))
    for name, parts in quantized.items():
        place_quantized(model, name, parts, params[name])
    missing = [t for t in expected_targets(params) if t not in loaded]
    if missing:
        shown = ", ".join(_describe(t) for t in missing[:8])
        raise ValueError(f"checkpoint lacks weights: {shown}")


@runtime_checkable
class KeepsQuantized(Protocol):
    """A module that can hold a weight as stored (``llama.Linear``, ``llama.Embedding``);
    named here so loading does not import the model it fills."""

    def keep_quantized(self, weight: QuantWeight | QuantParts) -> None: ...


def place_quantized(
    model: nn.Module, name: str, parts: dict[str, QuantWeight], param: torch.Tensor
) -> None:
    """A linear all of whose parts (q/k/v, gate/up, or the one) came quantized keeps them
    (``concat_rows``: fused where they share a format, else apart), as does a token
    embedding (one format); otherwise the quantized parts are dequantised into the float
    weight."""
    module_name, leaf = name.rsplit(".", 1)
    module = model.get_submodule(module_name)
    order = _PARTS.get(module_name.split(".")[-1], ("",))
    kept = [parts[part] for part in order if part in parts]
    if isinstance(module, KeepsQuantized) and leaf == "weight" and len(kept) == len(order):
        module.keep_quantized(kept[0] if len(kept) == 1 else concat_rows(kept))
        return
    with torch.no_grad():
        for part, weight in parts.items():
            dest = param.data
            if part:
                start, stop = part_rows(model, name, part, dest.shape[0])
                dest = dest[start:stop]
            dest.copy_(dequantize(weight, dest.dtype))


def expected_targets(params: dict[str, nn.Parameter]) -> list[Target]:
    """Every slice a complete checkpoint fills, at the finest grain."""
    targets = []
    for name, param in params.items():
        leaf = name.split(".")[-1]
        owner = name.split(".")[-2] if "." in name else ""
        experts = range(param.shape[0]) if leaf.startswith("experts_") else [None]
        parts = _PARTS.get(owner, ("",))
        if leaf == "experts_gate_up":
            parts = ("gate", "up")
        targets += [Target(name, e, p) for e in experts for p in parts]
    return targets


def _covered(target: Target, param: torch.Tensor) -> list[Target]:
    """The finest-grain slices a loaded tensor fills (a stacked tensor: all experts)."""
    if target.expert is not None or not target.param.split(".")[-1].startswith("experts_"):
        return [target]
    parts = ("gate", "up") if target.param.endswith("experts_gate_up") else ("",)
    return [Target(target.param, e, p) for e in range(param.shape[0]) for p in parts]


def _describe(target: Target) -> str:
    expert = "" if target.expert is None else f"[expert {target.expert}]"
    return f"{target.param}{expert}@{target.part}"


def held_weight_bytes(model: nn.Module) -> int:
    """Bytes of every weight ``model`` holds, each tensor once: its parameters, the weights
    kept quantized (at their stored size) and the packed copies its kernels run on."""
    sizes: dict[int, int] = {}

    def add(tensor: torch.Tensor | None) -> None:
        if tensor is None or tensor.numel() == 0:
            return
        if tensor.is_mkldnn:  # oneDNN's opaque layout has no plain storage to share
            sizes[id(tensor)] = tensor.numel() * tensor.element_size()
            return
        storage = tensor.untyped_storage()
        sizes[storage.data_ptr()] = storage.nbytes()

    for module in model.modules():
        for param in module.parameters(recurse=False):
            add(param)
        for copy in ("packed", "small"):
            add(getattr(module, copy, None))
        quant = getattr(module, "quant", None)
        if isinstance(quant, QuantWeight):
            add(quant.data)
        elif isinstance(quant, QuantParts):
            for part in quant.parts:
                add(part.data)
    for copy in getattr(model, "tied_packs", ()):
        add(copy)
    return sum(sizes.values())
