"""Quantize a float checkpoint's weights at load (``--quantization``), without calibration data.

The layer linears (q/k/v/o, gate/up/down), the token embedding and the LM head of a
Llama-family model are quantized one tensor at a time as the checkpoint streams in, into
GGUF's block formats that the integer kernels run as stored (``kernels/quant.py``):
``int8`` and ``q8_0`` are Q8_0 (int8 weights, one fp16 scale per 32: round-to-nearest of
w / (max|w| / 127)), ``q4_0`` is Q4_0 (4-bit, one fp16 scale per 32). The ``gguf``
package's quantizers make the blocks, so the weights are those llama.cpp's converter would
write. The formats follow llama.cpp's choice (``tensor_format``): the head, the most
sensitive to rounding, is Q8_0 under every scheme (llama.cpp gives it Q6_K under Q4_0, and
Q8_0 where its width is not in 256s, as SmolLM2's 576 and Qwen2.5-0.5B's 896 are; the
``gguf`` package has no Q6_K quantizer), an untied embedding the scheme's format, a tied
one the head's (one copy: looked up by rows, multiplied as the head). Measured on
SmolLM2-135M's float32 weights (3 held-out texts, 1,024 tokens each, ``quant_quality.py``),
top-1 agreement with the float model, layer linears alone -> with the embedding and head:
int8 96.8% -> 95.9% (perplexity 23.64 float, 23.72 -> 23.75), q4_0 70.8% -> 70.9% (the
Q8_0 head adds next to nothing to Q4_0's own loss); held weights 324 -> 136 MiB (int8). A
float tensor is freed as soon as its blocks exist, so loading never holds the float model
beside the quantized one.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np
import torch

from pagedllm.kernels.quant import QuantWeight, from_gguf_blocks
from pagedllm.quant_layout import QUANTIZE_AT_LOAD as SCHEMES

# The families whose linears run quantized (model/llama.py's ``Linear``).
FAMILIES = ("llama", "qwen2", "qwen3")
LINEAR_SUFFIXES = tuple(
    f"{name}.weight"
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
)
EMBEDDING = "model.embed_tokens.weight"
HEAD = "lm_head.weight"
# The LM head's format under every scheme (see the module's docstring).
HEAD_FORMAT = "Q8_0"
# Weights quantized at a time (``quantize_weight``).
CHUNK_ELEMENTS = 1 << 22


def scheme_format(quantization: str) -> str:
    """The layout of ``--quantization`` (``SCHEMES``); ``ValueError`` naming the field."""
    if quantization not in SCHEMES:
        raise ValueError(f"quantization must be one of {tuple(SCHEMES)}, got {quantization!r}")
    return SCHEMES[quantization]


def check_family(quantization: str, model_type: str) -> None:
    if model_type not in FAMILIES:
        raise ValueError(
            f"quantization={quantization!r} runs on the Llama-family decoder "
            f"({', '.join(FAMILIES)}); this model is {model_type!r}"
        )


def quantize_weight(weight: torch.Tensor, format: str, stored: str = "") -> QuantWeight:
    """A float weight [N, K] in ``format``'s layout (K a multiple of 32), through the
    ``gguf`` package's quantizer (computed in float32), ``CHUNK_ELEMENTS`` at a time: its
    temporaries are several float32 copies of what it is given (a 151,936-row embedding
    would take GiBs at once)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    rows, width = weight.shape
    if width % 32:
        raise ValueError(f"a {format} weight needs a width in 32s, got {width}")
    step = max(1, CHUNK_ELEMENTS // width)
    blocks = []
    for start in range(0, rows, step):
        array = weight[start : start + step].detach().to(torch.float32).numpy()
        blocks.append(quantize(np.ascontiguousarray(array), GGMLQuantizationType[format]))
    joined = blocks[0] if len(blocks) == 1 else np.concatenate(blocks)
    quantized = from_gguf_blocks(joined, format, (rows, width))
    return QuantWeight(quantized.format, quantized.data, stored)


def tensor_format(name: str, quantization: str, tied: bool) -> str | None:
    """The format ``quantization`` gives the tensor ``name``: the scheme's for a layer
    linear and an untied embedding, ``HEAD_FORMAT`` for the head and a tied embedding (the
    head's only copy); None for a tensor that stays float (norms, biases) or is not loaded
    (a tied head's copy)."""
    if name.endswith(LINEAR_SUFFIXES):
        return scheme_format(quantization)
    if name == HEAD:
        return None if tied else HEAD_FORMAT
    if name == EMBEDDING and tied:
        return HEAD_FORMAT
    return scheme_format(quantization) if name == EMBEDDING else None


def quantized_weights(
    weights: Iterable[tuple[str, torch.Tensor | QuantWeight]], quantization: str, tied: bool
) -> Iterator[tuple[str, torch.Tensor | QuantWeight]]:
    """``weights`` with each float linear, embedding and head quantized to its
    ``tensor_format`` as it passes (``tied``: the head is the embedding; a tensor whose width
    is not in 32s stays float); a layer linear already quantized must be in the scheme's
    layout (a GGUF quantized otherwise is refused: serve it as stored, without
    ``quantization``), an embedding or head already quantized stays as stored."""
    scheme_format(quantization)
    stored = f"{quantization} at load"
    for name, tensor in weights:
        format = tensor_format(name, quantization, tied)
        if format is None or (
            not isinstance(tensor, QuantWeight) and (tensor.dim() != 2 or tensor.shape[1] % 32)
        ):
            yield name, tensor  # whole blocks only: such a tensor stays float (its route says)
        elif isinstance(tensor, QuantWeight):
            if name.endswith(LINEAR_SUFFIXES) and tensor.format != format:
                raise ValueError(
                    f"quantization={quantization!r} ({format}), but {name} is stored as "
                    f"{tensor.format}: leave quantization unset to serve the file as stored"
                )
            yield name, tensor
        else:
            yield name, quantize_weight(tensor, format, stored)
