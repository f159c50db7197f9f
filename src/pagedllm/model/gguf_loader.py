"""Read a ``.gguf`` file as a Hugging Face checkpoint: config dict, tensors, tokenizer.

Tensors are dequantised with the ``gguf`` package (``gguf.quants.dequantize``) to
float32, except, when asked (``keep_quantized``: the loader asks), the linears and the
token embedding of the Llama family and Gemma 3 stored as Q8_0, Q4_0, Q4_1, Q5_0, Q4_K,
Q5_K or Q6_K (``gguf_header.kept``): those come as ``QuantWeight`` (their blocks repacked once for ``kernels/quant.py``,
the only copy). llama.cpp stores Llama q/k projection rows permuted for its own rotary
layout; they are permuted back here so that the HF rotary (``rotate_half``) applies.
The tokenizer is rebuilt from the file's metadata by ``transformers`` (``gguf_file=``).
Gemma 3: llama.cpp stores the norms' weights with Gemma's ``1 +`` folded in (taken off
here, as transformers' GGUF loader does) and no chat template (Gemma's turn template is
supplied); its tensors in other types the ``gguf`` package knows dequantise.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagedllm.gguf_header import gguf_config, kept
from pagedllm.kernels.quant import QuantWeight, from_gguf_blocks
from pagedllm.model.gguf_index import GGUFIndex, read_index
from pagedllm.model.layout_cache import layout_cache_file, load_layouts, save_layouts

# Gemma's chat turns (the GGUF of gemma-3-270m carries no template).
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else 'user' %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
# Gemma's layer tensors: its norms sit around attention and the MLP.
_GEMMA_LAYER_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_PATTERN = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
Tensor = torch.Tensor | QuantWeight


def read_gguf(
    path: str | Path,
    keep_quantized: bool = False,
    tokenizer_cache: Path | None = None,
    layout_cache: Path | None = None,
) -> tuple[dict[str, Any], Iterator[tuple[str, Tensor]], Callable[[], Any]]:
    """(HF config dict, iterator of (HF name, float32 tensor or ``QuantWeight``), tokenizer
    loader). ``keep_quantized``: linears in a format of ``kernels/quant.py`` come as stored.
    ``tokenizer_cache``: where the tokenizer, once rebuilt from the file, is kept for the
    next load (``gguf_tokenizer``); ``layout_cache``: where the kept weights, once
    repacked, are kept for the next load (``model/layout_cache.py``)."""
    path = Path(path)
    index = read_index(path)
    config = gguf_config(index.fields, [t.name for t in index.tensors])
    if keep_quantized and layout_cache is not None:
        tensors = cached_gguf_tensors(index, config, layout_cache_file(path, layout_cache))
    else:
        tensors = gguf_tensors(index, config, keep_quantized)
    return config, tensors, lambda: gguf_tokenizer(path, tokenizer_cache)


def cached_gguf_tensors(
    reader: GGUFIndex, config: dict[str, Any], file: Path
) -> Iterator[tuple[str, Tensor]]:
    """``gguf_tensors`` keeping the quantized ones, read from ``file`` where an earlier
    load saved them, else repacked and saved there once every tensor has been taken."""
    cached = load_layouts(file)
    fresh: dict[str, QuantWeight] = {}
    for name, tensor in gguf_tensors(reader, config, True, cached or {}):
        if cached is None and isinstance(tensor, QuantWeight):
            fresh[name] = tensor
        yield name, tensor
    if cached is None and fresh:
        save_layouts(file, fresh)


def gguf_tensors(
    reader: GGUFIndex,
    config: dict[str, Any],
    keep_quantized: bool = False,
    repacked: dict[str, QuantWeight] | None = None,
) -> Iterator[tuple[str, Tensor]]:
    """Tensors under their Hugging Face names: dequantised to float32, or as stored
    (``QuantWeight``) for a linear in a kept format when ``keep_quantized`` (taken from
    ``repacked`` by name where it holds them, else repacked, with a progress bar on a
    terminal: seconds for a large file)."""
    from gguf.quants import dequantize
    from tqdm import tqdm

    unpermute = config["model_type"] == "llama"
    gemma = config["model_type"] == "gemma3_text"
    arch = reader.fields.get("general.architecture", "")
    repacked = repacked or {}
    progress = tqdm(
        reader.tensors,
        desc="repacking GGUF blocks",
        unit="tensor",
        disable=None if keep_quantized and not repacked else True,
        leave=False,
    )
    for tensor in progress:
        name = hf_tensor_name(tensor.name, gemma)
        shape = tuple(reversed(tensor.shape))
        kind = tensor.tensor_type.name
        if keep_quantized and name in repacked:
            yield name, repacked[name]
            continue
        if keep_quantized and kept(arch, tensor.name, kind):
            yield name, quantized_tensor(tensor.data, kind, shape, name, config, unpermute)
            continue
        # A copy: F32 tensors come back as read-only views of the memory-mapped file.
        array = np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        weight = torch.from_numpy(array.reshape(shape))
        if unpermute and name.endswith("self_attn.q_proj.weight"):
            weight = unpermute_rotary(weight, config["num_attention_heads"])
        elif unpermute and name.endswith("self_attn.k_proj.weight"):
            weight = unpermute_rotary(weight, config["num_key_value_heads"])
        elif gemma and name.endswith("norm.weight"):
            weight = weight - 1.0  # llama.cpp folded Gemma's 1 + weight in
        yield name, weight


def quantized_tensor(
    blocks: np.ndarray,
    kind: str,
    shape: tuple[int, ...],
    name: str,
    config: dict[str, Any],
    unpermute: bool,
) -> QuantWeight:
    """A linear's blocks repacked (``from_gguf_blocks``), q/k rows put back in Hugging
    Face's rotary order where llama.cpp permuted them (rows are whole blocks apart)."""
    weight = from_gguf_blocks(blocks, kind, (shape[0], shape[1]))
    heads = None
    if unpermute and name.endswith("self_attn.q_proj.weight"):
        heads = config["num_attention_heads"]
    elif unpermute and name.endswith("self_attn.k_proj.weight"):
        heads = config["num_key_value_heads"]
    if heads is None:
        return weight
    return weight.rows(unpermute_rotary(torch.arange(shape[0]), heads))


def hf_tensor_name(gguf_name: str, gemma: bool = False) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = {**_LAYER_NAMES, **_GEMMA_LAYER_NAMES} if gemma else _LAYER_NAMES
    match = _LAYER_PATTERN.fullmatch(gguf_name)
    if match is None or match.group(2) not in names:
        raise ValueError(f"unsupported GGUF tensor {gguf_name!r}")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{names[part]}.{kind}"


def unpermute_rotary(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's ``permute`` of q/k rows (interleaved pairs -> two halves per head)."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return (
        weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def gguf_tokenizer(path: Path, cache: Path | None = None) -> Any:
    """The tokenizer (with chat template) that ``transformers`` rebuilds from GGUF metadata;
    with ``cache``, rebuilt once (tens of seconds for a large vocabulary) and saved under it
    (``tokenizer_cache_dir``) for the next load."""
    from pagedllm.model.hf_tokenizer import load_hf_tokenizer, save_converted

    saved = None if cache is None else tokenizer_cache_dir(path, cache)
    if saved is not None and (saved / "tokenizer_config.json").is_file():
        return load_hf_tokenizer(str(saved))
    tokenizer = load_hf_tokenizer(str(path.parent), gguf_file=path.name)
    if not getattr(tokenizer, "chat_template", None) and "<start_of_turn>" in tokenizer.vocab:
        tokenizer.chat_template = GEMMA_CHAT_TEMPLATE
    if saved is not None:
        saved.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=".tokenizer-", dir=saved.parent))
        save_converted(tokenizer, work, path.name)
        try:
            os.rename(work, saved)  # whole or not at all; a concurrent writer may win
        except OSError:
            shutil.rmtree(work, ignore_errors=True)
    return tokenizer


def tokenizer_cache_dir(path: Path, cache: Path) -> Path:
    """Where ``gguf_tokenizer`` keeps the tokenizer of the file at ``path``: named by the
    file's name, size and modification time, so that a changed file is rebuilt."""
    stat = path.stat()
    key = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()
    return cache / f"{path.stem}-{hashlib.sha256(key).hexdigest()[:16]}"


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Write a normal HF directory (config.json, model.safetensors, tokenizer) from a GGUF file."""
    from safetensors.torch import save_file

    from pagedllm.model.hf_tokenizer import CONVERTED_FROM, save_converted

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config, tensors, load_tokenizer = read_gguf(gguf_path)
    weights = dict(tensors)
    if config["tie_word_embeddings"]:
        weights.pop("lm_head.weight", None)
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    source = Path(gguf_path).name
    config[CONVERTED_FROM] = source
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_converted(load_tokenizer(), out_dir, source)
    return out_dir
