"""The block-quantized formats kept as stored and the size of their kernels' layout.

Plain Python (no numpy, no torch): ``kernels/quant.py`` repacks weights into this layout,
and ``pagedllm plan`` counts a GGUF's weights with it without loading them. The layout
itself is described in ``kernels/quant.py``.
"""

from __future__ import annotations

BLOCK = 32
SUPER_BLOCK = 256
# The formats kept as stored, by their GGML type numbers (the kernels' format argument).
CODES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
FORMATS = tuple(CODES)
# Added to Q8_0's code: its activations quantised to int8, as every other format's, not to
# int16 (``kernels/quant.py``'s ``int8_for_q8_0``).
INT8_ACTIVATIONS = 256
# Added to that code as well where some weight byte is -128 (valid, though GGUF's quantisers
# write -127..127): the AVX2 kernel then multiplies the weight the slower way.
HOLDS_MINUS_128 = 512
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")
# --quantization: the layout each scheme makes of a float checkpoint's linears at load
# (model/quantize.py); int8 is Q8_0's layout (int8 weights, one fp16 scale per 32).
QUANTIZE_AT_LOAD = {"int8": "Q8_0", "q8_0": "Q8_0", "q4_0": "Q4_0"}
# Section sizes of a row of ``blocks`` 32-blocks (``pairs``, ``groups``: of 2 and 8 blocks,
# rounded up) in the kernels' layout, in order.
_SECTIONS = {
    "Q8_0": lambda b, p, g: [32 * b, 2 * b],
    "Q4_0": lambda b, p, g: [32 * p, 2 * b],
    "Q4_1": lambda b, p, g: [32 * p, 2 * b, 2 * b],
    "Q5_0": lambda b, p, g: [32 * p, 32 * g, 2 * b],
    "Q4_K": lambda b, p, g: [16 * b, b, b, 2 * g, 2 * g],
    "Q5_K": lambda b, p, g: [16 * b, 4 * b, b, b, 2 * g, 2 * g],
    "Q6_K": lambda b, p, g: [16 * b, 8 * b, 2 * b, 2 * g],
}


def unit(format: str) -> int:
    """Weights per repeated unit of ``format``'s layout: 32, or 256 for a K-quant."""
    return SUPER_BLOCK if format in K_QUANTS else BLOCK


def section_sizes(format: str, width: int) -> list[int]:
    """Bytes of each section of one row of ``width`` weights in ``format``'s layout."""
    blocks = width // BLOCK
    return _SECTIONS[format](blocks, (blocks + 1) // 2, (blocks + 7) // 8)


def row_bytes(format: str, width: int) -> int:
    """Bytes of one row of ``width`` weights."""
    return sum(section_sizes(format, width))


def fused_format(formats: list[str]) -> str | None:
    """The format of one fused linear (q/k/v, gate/up) whose parts are stored in
    ``formats``: theirs where they match; None where they differ, and the parts then stay
    apart, each in its own format (llama.cpp's Q4_K_M stores v in Q6_K beside Q4_K q/k in
    some layers; widening them all to one format would hold more bytes than the file)."""
    return formats[0] if len(set(formats)) == 1 else None
