"""Quantize a float checkpoint's linears at load (``--quantization``), without calibration data.

The layer linears (q/k/v/o, gate/up/down) of a Llama-family model are quantized one tensor
at a time as the checkpoint streams in, into GGUF's block formats that the integer kernels
run as stored (``kernels/quant.py``): ``int8`` and ``q8_0`` are Q8_0 (int8 weights, one
fp16 scale per 32: round-to-nearest of w / (max|w| / 127)), ``q4_0`` is Q4_0 (4-bit, one
fp16 scale per 32). The ``gguf`` package's quantizers make the blocks, so the weights are
those llama.cpp's converter would write. The token embedding and the LM head stay in the
model's dtype: they are the most sensitive to rounding, and a tied head is the
embedding. A float tensor is freed as soon as its blocks exist, so loading never holds
the float model beside the quantized one.
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
    ``gguf`` package's quantizer (computed in float32)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    rows, width = weight.shape
    if width % 32:
        raise ValueError(f"a {format} weight needs a width in 32s, got {width}")
    array = weight.detach().to(torch.float32).numpy()
    blocks = quantize(np.ascontiguousarray(array), GGMLQuantizationType[format])
    quantized = from_gguf_blocks(blocks, format, (rows, width))
    return QuantWeight(quantized.format, quantized.data, stored)


def quantized_weights(
    weights: Iterable[tuple[str, torch.Tensor | QuantWeight]], quantization: str
) -> Iterator[tuple[str, torch.Tensor | QuantWeight]]:
    """``weights`` with each float layer linear quantized to ``quantization``'s layout as it
    passes (one whose width is not in 32s stays float); a linear already quantized must be in that layout (a GGUF quantized otherwise
    is refused: serve it as stored, without ``quantization``)."""
    format = scheme_format(quantization)
    stored = f"{quantization} at load"
    for name, tensor in weights:
        if not name.endswith(LINEAR_SUFFIXES) or (
            not isinstance(tensor, QuantWeight) and (tensor.dim() != 2 or tensor.shape[1] % 32)
        ):
            yield name, tensor  # whole blocks only: such a linear stays float (its route says)
        elif isinstance(tensor, QuantWeight):
            if tensor.format != format:
                raise ValueError(
                    f"quantization={quantization!r} ({format}), but {name} is stored as "
                    f"{tensor.format}: leave quantization unset to serve the file as stored"
                )
            yield name, tensor
        else:
            yield name, quantize_weight(tensor, format, stored)
