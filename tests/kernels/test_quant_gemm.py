"""Linears on GGUF block-quantized weights (kernels/quant.py, csrc/quant_gemm.cpp,
csrc/quant_tiles.cpp) against the float reference: the weight dequantised by the ``gguf``
package, then ``F.linear``.

Every format (Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q5_K, Q6_K) on every route this CPU has:
- the integer kernel (decode rows) on AVX-512-VNNI, AVX-VNNI and AVX2 (capped): activations
  quantised to int8 per 32-block (a rounding of at most 1/254 of the block's largest value
  per element), so outputs are held to a relative error of 1e-2 against the float reference
  (measured: 3e-3 to 8e-3) and to 1e-5 against the same arithmetic emulated in float64; the
  routes give the same bits; Q8_0 weights take int16 activations (at most 1/65534 of the
  block's largest value), held to 1e-4 of the float reference (measured: ~3e-5), and int8
  ones where their code carries INT8_ACTIVATIONS (``QuantWeight.int8_activations``);
- dequantised tiles (prompt rows) on each small_gemm route: float32 within 1e-5 of the
  reference (only the order of the sums differs); bf16 within 1e-2 (the tile's weights and
  the output rounded to bf16; measured: 3e-3 to 5e-3).
A route the CPU lacks skips with the reason.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagedllm.kernels import ops as kernel_ops
from pagedllm.kernels import quant
from pagedllm.kernels.quant import (
    QuantParts,
    QuantWeight,
    concat_rows,
    dequantize,
    from_gguf_blocks,
    quant_linear,
)
from pagedllm.kernels.routes import small_gemm_route
from pagedllm.quant_layout import CODES, FORMATS, INT8_ACTIVATIONS, K_QUANTS, section_sizes

from .gguf_blocks import quantize
from .isa_caps import QUANT_ROUTES, ROUTES, quant_gemm_capped, small_gemm_capped

gguf = pytest.importorskip("gguf")

ops = kernel_ops.layer_ops()
MAX_INTEGER_ERROR = 1e-2
MAX_WIDE_ERROR = 1e-4  # Q8_0 weights on int16 activations
MAX_EMULATION_ERROR = 1e-5
# The largest integer of an activation block: int8, or int16 for Q8_0 weights.
INT8_LEVELS, INT16_LEVELS = 127.0, 32767.0


def needs_kernels() -> None:
    if ops is None:
        pytest.skip("the C++ kernels did not build")


def gguf_weight(format: str, rows: int, width: int | None = None, seed: int = 0):
    """(QuantWeight, the gguf package's float32 dequantisation) of a random weight; width
    defaults to one that is no whole number of groups of 256 where the format allows."""
    width = width or (512 if format in K_QUANTS else 576)
    array = np.random.default_rng(seed).standard_normal((rows, width)).astype(np.float32)
    blocks = quantize(array * 0.05, format)
    qtype = gguf.GGMLQuantizationType[format]
    reference = gguf.quants.dequantize(blocks, qtype).reshape(rows, width)
    return from_gguf_blocks(blocks, format, (rows, width)), torch.from_numpy(reference.copy())


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    return float((actual - expected).norm() / expected.norm())


def levels_of(format: str) -> float:
    """The activations' largest integer for a weight format (the kernel's default)."""
    return INT16_LEVELS if format == "Q8_0" else INT8_LEVELS


def max_integer_error(format: str) -> float:
    return MAX_WIDE_ERROR if format == "Q8_0" else MAX_INTEGER_ERROR


def emulated(x: torch.Tensor, reference: torch.Tensor, levels: float) -> torch.Tensor:
    """The integer kernel's arithmetic in float64: x quantised per block as the kernel does
    (round(x * levels / max|x|)), times the exactly dequantised weight."""
    blocks = x.float().view(x.shape[0], -1, quant.BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, levels / amax, torch.zeros_like(amax))
    xq = torch.round(blocks * inv)
    dx = amax / levels
    return (xq.double() * dx.double()).view_as(x) @ reference.double().T


@pytest.mark.parametrize("format", FORMATS)
def test_layout_dequantises_as_gguf_does(format) -> None:
    weight, reference = gguf_weight(format, 48)
    assert weight.shape == tuple(reference.shape) and weight.data.dtype == torch.uint8
    assert weight.nbytes == quant.row_bytes(format, reference.shape[1]) * 48
    assert torch.equal(dequantize(weight), reference)
    needs_kernels()
    assert torch.equal(ops.quant_dequantize(weight.data, weight.code, torch.float32), reference)
    bf16 = ops.quant_dequantize(weight.data, weight.code, torch.bfloat16)
    assert torch.equal(bf16, reference.to(torch.bfloat16))


@pytest.mark.parametrize("route", QUANT_ROUTES)
@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("num_rows", [1, 3, 4, 7, 16, 21])
def test_integer_kernel_matches_the_float_reference(route, format, num_rows) -> None:
    weight, reference = gguf_weight(format, 40)
    x = torch.randn(num_rows, reference.shape[1], generator=torch.Generator().manual_seed(7))
    with quant_gemm_capped(route):
        out = ops.quant_gemm_integer(x, weight.data, weight.code, None)
    assert out.shape == (num_rows, 40) and out.dtype == torch.float32
    assert relative_error(out, F.linear(x, reference)) <= max_integer_error(format)
    assert relative_error(out, emulated(x, reference, levels_of(format))) <= MAX_EMULATION_ERROR


@pytest.mark.parametrize("route", QUANT_ROUTES)
@pytest.mark.parametrize("num_rows", [1, 5, 9])
def test_q8_0_on_int8_activations_where_its_code_says(route, num_rows) -> None:
    """A Q8_0 weight with ``int8_activations`` (its code + INT8_ACTIVATIONS) runs on the
    int8 route; the same bytes without it on int16."""
    wide, reference = gguf_weight("Q8_0", 40, seed=4)
    narrow = replace(wide, int8_activations=True)
    assert (wide.code, narrow.code) == (CODES["Q8_0"], CODES["Q8_0"] + INT8_ACTIVATIONS)
    assert (wide.activations, narrow.activations) == ("int16", "int8")
    x = torch.randn(num_rows, reference.shape[1], generator=torch.Generator().manual_seed(4))
    with quant_gemm_capped(route):
        narrow_out = ops.quant_gemm_integer(x, narrow.data, narrow.code, None)
        wide_out = ops.quant_gemm_integer(x, wide.data, wide.code, None)
    assert relative_error(narrow_out, emulated(x, reference, INT8_LEVELS)) <= MAX_EMULATION_ERROR
    assert relative_error(wide_out, emulated(x, reference, INT16_LEVELS)) <= MAX_EMULATION_ERROR
    # int16 brings the product ~100x nearer the float reference.
    exact = F.linear(x, reference)
    assert relative_error(wide_out, exact) * 20 <= relative_error(narrow_out, exact)


@pytest.mark.parametrize("format", [f for f in FORMATS if f != "Q8_0"])
def test_int8_activations_are_the_other_formats_own(format) -> None:
    """The flag changes Q8_0's code only: the other formats are on int8 already."""
    weight, _ = gguf_weight(format, 8, seed=3)
    assert replace(weight, int8_activations=True).code == weight.code == CODES[format]
    assert weight.activations == "int8"


def test_an_activation_flag_on_another_format_is_refused() -> None:
    needs_kernels()
    weight, _ = gguf_weight("Q4_0", 8, seed=3)
    x = torch.randn(1, weight.shape[1])
    with pytest.raises(RuntimeError, match="unknown weight format"):
        ops.quant_gemm(x, weight.data, CODES["Q4_0"] + INT8_ACTIVATIONS, None)


@pytest.mark.parametrize("route", QUANT_ROUTES)
@pytest.mark.parametrize("format", FORMATS)
def test_integer_kernel_in_bf16_with_bias(route, format) -> None:
    weight, reference = gguf_weight(format, 40, seed=1)
    x = torch.randn(2, reference.shape[1]).to(torch.bfloat16)
    bias = torch.randn(40).to(torch.bfloat16)
    with quant_gemm_capped(route):
        out = ops.quant_gemm(x, weight.data, weight.code, bias)
    assert out.dtype == torch.bfloat16
    # bf16's own rounding of x and of the output (~4e-3) bounds Q8_0 here too.
    assert relative_error(out, F.linear(x.float(), reference, bias.float())) <= MAX_INTEGER_ERROR


@pytest.mark.parametrize("format", FORMATS)
def test_every_integer_route_gives_the_same_bits(format) -> None:
    needs_kernels()
    weight, _ = gguf_weight(format, 64, seed=2)
    x = torch.randn(5, weight.shape[1])
    outs = {}
    for route in QUANT_ROUTES:
        saved = ops.set_quant_gemm_isa(route)
        try:
            if ops.quant_gemm_isa() == route:
                outs[route] = ops.quant_gemm_integer(x, weight.data, weight.code, None)
        finally:
            ops.set_quant_gemm_isa(saved)
    if len(outs) < 2:
        pytest.skip(f"this CPU has one integer route only ({', '.join(outs) or 'none'})")
    first = next(iter(outs.values()))
    assert all(torch.equal(out, first) for out in outs.values())


@pytest.mark.parametrize("route", QUANT_ROUTES)
@pytest.mark.parametrize(
    ("format", "activations"), [(f, "int8") for f in FORMATS] + [("Q8_0", "int16")]
)
def test_a_row_gets_the_same_bits_whatever_rows_share_its_call(route, format, activations) -> None:
    """Eight rows or more take the rows-in-lanes kernel (a row's values in one lane of a
    vector, padded to whole groups of rows); fewer take the row kernel. Every row of a call
    is bit for bit that row alone, in float32 and bf16 with a bias, on widths with a last
    partial group; on two threads too, where a prompt's rows (640 here: past parallel_rows'
    fork threshold) are quantised and laid into lanes by both. Each thread's buffers are
    reused without a fill: a call after a larger one (12 rows after 33) gives the same bits."""
    width = 512 if format in K_QUANTS else 224 + 32 * (len(format) % 3)
    weight, _ = gguf_weight(format, 24, width=width, seed=5)
    weight = replace(weight, int8_activations=activations == "int8")
    assert weight.activations == activations
    saved = torch.get_num_threads()
    try:
        with quant_gemm_capped(route):
            for threads, dtype in ((1, torch.float32), (1, torch.bfloat16), (2, torch.float32)):
                torch.set_num_threads(threads)
                for num_rows in (8, 9, 17, 33, 12) if threads == 1 else (33, 640):
                    x = torch.randn(
                        num_rows, width, generator=torch.Generator().manual_seed(num_rows)
                    ).to(dtype)
                    bias = torch.randn(24).to(dtype)
                    together = ops.quant_gemm_integer(x, weight.data, weight.code, bias)
                    alone = [
                        ops.quant_gemm_integer(x[r : r + 1], weight.data, weight.code, bias)
                        for r in range(num_rows)
                    ]
                    assert torch.equal(together, torch.cat(alone)), (threads, dtype, num_rows)
    finally:
        torch.set_num_threads(saved)


def repeating_weight(format: str, rows: int, width: int, period: int = 37):
    """A weight whose row i is row i % period: every row's logits tie every `period` columns."""
    base = np.random.default_rng(period).standard_normal((period, width)).astype(np.float32)
    blocks = quantize(base[np.arange(rows) % period] * 0.05, format)
    return from_gguf_blocks(blocks, format, (rows, width))


@pytest.mark.parametrize("route", QUANT_ROUTES)
@pytest.mark.parametrize(
    ("format", "activations"), [(f, "int8") for f in FORMATS] + [("Q8_0", "int16")]
)
def test_the_head_argmax_is_the_argmax_of_its_logits(route, format, activations) -> None:
    """quant_gemm_argmax (a greedy step's head) gives argmax_rows(quant_gemm(...)) without
    the logits: columns in runs of 512 and, on two threads, in pieces merged in any order;
    ties (a weight of repeating rows: each maximum ~30 times) to the lowest index; a NaN
    column (from the bias, in the second run) before every number; bf16 on bf16 logits; rows
    past the integer kernel's through the logits."""
    width, n = (256 if format in K_QUANTS else 224), 1100
    weight = replace(repeating_weight(format, n, width), int8_activations=activations == "int8")
    nan_bias = torch.randn(n)
    nan_bias[700] = float("nan")
    saved = torch.get_num_threads()
    try:
        with quant_gemm_capped(route):
            for threads in (1, 2):
                torch.set_num_threads(threads)
                for dtype in (torch.float32, torch.bfloat16):
                    for num_rows in (1, 8, 17, 40):
                        gen = torch.Generator().manual_seed(num_rows)
                        x = torch.randn(num_rows, width, generator=gen).to(dtype)
                        for bias in (None, torch.randn(n).to(dtype), nan_bias.to(dtype)):
                            logits = ops.quant_gemm(x, weight.data, weight.code, bias)
                            got = ops.quant_gemm_argmax(x, weight.data, weight.code, bias)
                            expected = ops.argmax_rows(logits)
                            assert torch.equal(got, expected), (threads, dtype, num_rows)
                            if bias is None:
                                assert bool((got < 37).all())  # the first of each tie
    finally:
        torch.set_num_threads(saved)


# How many of the layout's first sections (quant_layout.section_sizes) hold the stored
# integers: the low bits, and the high bits where the format has them.
INTEGER_SECTIONS = {"Q5_0": 2, "Q5_K": 2, "Q6_K": 2}


# The stored bytes of the largest weights: all integer bits set; Q8_0's -128 (the sign
# trick's |q| = 128, and a code that says so) and -127 (the largest |q| the AVX2 lane
# kernel multiplies as |x| times q with x's sign).
LARGEST_BYTES = [("Q8_0", 0x80), ("Q8_0", 0x81)] + [(f, 0xFF) for f in FORMATS if f != "Q8_0"]


@pytest.mark.parametrize("route", QUANT_ROUTES)
@pytest.mark.parametrize(("format", "byte"), LARGEST_BYTES)
def test_the_largest_products_keep_their_bits_in_every_kernel(route, format, byte) -> None:
    """Every weight at its format's largest value against activations at +-127: the AVX2
    lane kernel adds maddubs's pair sums in int16 before widening them (four dwords for 31,
    two for Q6_K's 63); the rows in lanes give each row's own bits, near the reference."""
    rows, width = 16, 512
    weight, _ = gguf_weight(format, rows, width=width, seed=7)
    data = weight.data.clone()
    held = sum(section_sizes(format, width)[: INTEGER_SECTIONS.get(format, 1)])
    data[:, :held] = byte
    weight = replace(weight, data=data, int8_activations=True)
    assert weight.holds_minus_128 == (byte == 0x80 and format == "Q8_0")
    signs = torch.tensor([1.0, -1.0] * 4 + [0.5, -0.5])[:, None]
    x = torch.cat([signs * torch.ones(10, width), torch.randn(6, width)])
    with quant_gemm_capped(route):
        together = ops.quant_gemm_integer(x, weight.data, weight.code, None)
        alone = [
            ops.quant_gemm_integer(x[r : r + 1], weight.data, weight.code, None)
            for r in range(rows)
        ]
    assert torch.equal(together, torch.cat(alone))
    # Constant rows quantise exactly: only float rounding is left.
    expected = F.linear(x[:10], dequantize(weight))
    assert relative_error(together[:10], expected) <= 1e-5


@pytest.mark.parametrize("route", QUANT_ROUTES)
@pytest.mark.parametrize("format", [f for f in FORMATS if f not in K_QUANTS])
@pytest.mark.parametrize("blocks", [7, 9, 15, 28, 31])
def test_last_groups_of_every_length(route, format, blocks) -> None:
    """Rows whose last group has 1 to 7 blocks (the scales of such a group are moved into
    place from the row's last eight), and a row shorter than one group."""
    weight, reference = gguf_weight(format, 24, width=blocks * quant.BLOCK, seed=blocks)
    x = torch.randn(3, reference.shape[1], generator=torch.Generator().manual_seed(blocks))
    with quant_gemm_capped(route):
        out = ops.quant_gemm_integer(x, weight.data, weight.code, None)
    assert relative_error(out, emulated(x, reference, levels_of(format))) <= MAX_EMULATION_ERROR


@pytest.mark.parametrize("route", QUANT_ROUTES)
@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("num_rows", [3, 16])
def test_bf16_out_is_the_float32_sum_rounded_once(route, format, num_rows) -> None:
    """In bf16 the kernel adds the bias to each float32 sum and rounds once: the float32
    result (same activations, same bias) rounded to bf16, bit for bit; from the row kernel
    (3 rows) and the rows-in-lanes one (16: eight columns rounded and stored at once)."""
    weight, _ = gguf_weight(format, 40, seed=3)
    x = torch.randn(num_rows, weight.shape[1]).to(torch.bfloat16)
    bias = torch.randn(40).to(torch.bfloat16)
    with quant_gemm_capped(route):
        out = ops.quant_gemm_integer(x, weight.data, weight.code, bias)
        wide = ops.quant_gemm_integer(x.float(), weight.data, weight.code, bias.float())
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, wide.to(torch.bfloat16))


TILE_ROUTES = [(dtype, isa) for dtype, isas in ROUTES.items() for isa in isas]


@pytest.mark.parametrize(("dtype", "isa"), TILE_ROUTES, ids=[i for _, i in TILE_ROUTES])
@pytest.mark.parametrize("format", FORMATS)
def test_dequantised_tiles_match_the_float_reference(dtype, isa, format) -> None:
    """A prompt's rows on tiles of the weight dequantised into small_gemm's layout; 40 weight
    rows: the last group of 16 output columns is partial."""
    weight, reference = gguf_weight(format, 40, seed=3)
    x = torch.randn(37, reference.shape[1]).to(dtype)
    bias = torch.randn(40).to(dtype)
    with small_gemm_capped(dtype, isa):
        out = ops.quant_gemm_tiled(x, weight.data, weight.code, bias)
    assert out.dtype == dtype and out.shape == (37, 40)
    expected = F.linear(x.float(), reference, bias.float())
    assert relative_error(out, expected) <= (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("format", "activations"), [("Q5_0", "int8"), ("Q8_0", "int16")])
def test_quant_gemm_takes_the_integer_kernel_up_to_its_rows(dtype, format, activations) -> None:
    """Up to its row limit (-1: none; then a prompt's 1,100 rows, more than one of the
    kernel's chunks of rows) the integer kernel, beyond it dequantised tiles."""
    needs_kernels()
    weight, _ = gguf_weight(format, 48, seed=4)
    assert weight.activations == activations
    limit = ops.quant_gemm_int_rows(dtype, weight.code)
    cases = [(1100, ops.quant_gemm_integer)] if limit < 0 else []
    cases += (
        [(limit, ops.quant_gemm_integer), (limit + 1, ops.quant_gemm_tiled)] if limit > 0 else []
    )
    for rows, kernel in cases:
        x = torch.randn(rows, weight.shape[1]).to(dtype)
        chosen = ops.quant_gemm(x, weight.data, weight.code, None)
        assert torch.equal(chosen, kernel(x, weight.data, weight.code, None))


def test_the_integer_kernel_takes_any_rows_on_int8_unless_bf16_tiles_win() -> None:
    """int8 activations: no row limit in float32 (float32 tiles on FMAs are slower at every
    count measured) nor in bf16 on AVX-512-VNNI beside AVX-512-bf16 dot products; 8 rows
    where bf16 runs on the tile unit, 16 on other bf16 routes. Q8_0's int16 activations keep
    16 (bf16) and 32 (float32) rows, 8 on the tile unit."""
    needs_kernels()
    q5_0, q8_0 = (gguf_weight(f, 8, seed=1)[0] for f in ("Q5_0", "Q8_0"))
    amx = small_gemm_route(torch.bfloat16) == "amx"
    assert ops.quant_gemm_int_rows(torch.float32, q5_0.code) == -1
    assert ops.quant_gemm_int_rows(torch.float32, q8_0.code) == 32
    assert ops.quant_gemm_int_rows(torch.bfloat16, q8_0.code) == (8 if amx else 16)
    vnni = ops.quant_gemm_isa() == "avx512_vnni"
    expected = 8 if amx else -1 if vnni else 16
    assert ops.quant_gemm_int_rows(torch.bfloat16, q5_0.code) == expected
    with quant_gemm_capped("avx2"):
        assert ops.quant_gemm_int_rows(torch.bfloat16, q5_0.code) == (8 if amx else 16)
        assert ops.quant_gemm_int_rows(torch.float32, q5_0.code) == -1


@pytest.mark.parametrize("format", ["Q8_0", "Q6_K"])
def test_torch_path_without_kernels(monkeypatch, format) -> None:
    monkeypatch.setattr(quant, "TILE_ELEMENTS", 16 * 512)  # tiles of 16, 16, 8 rows
    weight, reference = gguf_weight(format, 40, width=512, seed=5)
    x = torch.randn(3, 4, 512)
    bias = torch.randn(40)
    out = quant_linear(x, weight, bias, None)
    assert torch.allclose(out, F.linear(x, reference, bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("formats", [("Q4_1", "Q4_1"), ("Q6_K", "Q6_K", "Q6_K")])
def test_parts_in_one_format_fuse(formats) -> None:
    parts = [gguf_weight(f, 16, width=512, seed=i) for i, f in enumerate(formats)]
    weight = concat_rows([w for w, _ in parts])
    assert isinstance(weight, QuantWeight) and weight.format == formats[0]
    assert weight.shape == (16 * len(formats), 512)
    assert torch.equal(dequantize(weight), torch.cat([ref for _, ref in parts]))
    order = torch.tensor([3, 0, 17])
    assert torch.equal(dequantize(weight.rows(order)), dequantize(weight)[order])


@pytest.mark.parametrize(
    "formats",
    [
        ("Q5_0", "Q5_0", "Q8_0"),  # the real Qwen2.5-Coder and gemma-3-270m files' q, k, v
        ("Q4_K", "Q4_K", "Q6_K"),  # llama.cpp's Q4_K_M, where v has more bits
        ("Q4_1", "Q8_0"),
    ],
)
def test_parts_in_several_formats_stay_apart(formats) -> None:
    """Kept as stored, each part in its own format: the same values and bytes, each part
    its own product, the outputs side by side (bias split with them)."""
    parts = [gguf_weight(f, 16 * (i + 1), width=512, seed=i) for i, f in enumerate(formats)]
    weight = concat_rows([w for w, _ in parts])
    rows = sum(16 * (i + 1) for i in range(len(formats)))
    assert isinstance(weight, QuantParts) and weight.format == "+".join(formats)
    assert weight.shape == (rows, 512) and weight.nbytes == sum(w.nbytes for w, _ in parts)
    full = torch.cat([ref for _, ref in parts])
    assert torch.equal(dequantize(weight), full)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(rows, generator=torch.Generator().manual_seed(2))
    out = quant_linear(x, weight, bias, None)
    assert torch.allclose(out, F.linear(x, full, bias), rtol=1e-5, atol=1e-4)
    order = torch.tensor([0, 3, 17, 20, rows - 1])  # in the parts' order: a rank's rows
    assert torch.equal(dequantize(weight.rows(order)), full[order])
    assert isinstance(weight.rows(slice(0, 8)), QuantWeight)
    with pytest.raises(ValueError, match="parts' order"):
        weight.rows(torch.tensor([rows - 1, 0]))


def test_parts_of_several_widths_are_refused() -> None:
    parts = [gguf_weight("Q8_0", 16, width=w)[0] for w in (256, 512)]
    with pytest.raises(ValueError, match="share their width"):
        concat_rows(parts)


def test_unsupported_shapes_and_formats_are_refused() -> None:
    blocks = gguf.quants.quantize(np.zeros((2, 32), np.float32), gguf.GGMLQuantizationType.Q5_1)
    with pytest.raises(ValueError, match="unsupported quantized format 'Q5_1'"):
        from_gguf_blocks(blocks, "Q5_1", (2, 32))
    blocks = gguf.quants.quantize(np.zeros((2, 288), np.float32), gguf.GGMLQuantizationType.Q8_0)
    with pytest.raises(ValueError, match="whole blocks of 256"):
        from_gguf_blocks(blocks, "Q6_K", (2, 288))


def test_the_kernels_check_the_layout() -> None:
    needs_kernels()
    weight, _ = gguf_weight("Q4_K", 16, width=512)
    with pytest.raises(RuntimeError, match="unknown weight format 5"):
        ops.quant_gemm(torch.randn(1, 512), weight.data, 5, None)
    with pytest.raises(RuntimeError, match="does not hold 512 weights"):
        ops.quant_gemm(torch.randn(1, 512), weight.data, quant.CODES["Q6_K"], None)
    with pytest.raises(RuntimeError, match="does not hold 256 weights"):
        ops.quant_gemm(torch.randn(1, 256), weight.data, weight.code, None)
