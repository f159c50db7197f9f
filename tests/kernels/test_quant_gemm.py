"""Linears on GGUF block-quantized weights (kernels/quant.py, csrc/quant_gemm.cpp) against the
float reference: the weight dequantised by the ``gguf`` package, then ``F.linear``.

quant_gemm quantises activations to int8 per 32-block (a rounding of at most 1/254 of the
block's largest value per element), so its outputs are held to a relative error of 1e-2
against the float reference; against the same arithmetic emulated in float64 (activations
quantised alike) they agree to 1e-5. Each route this CPU has runs (AVX-512-VNNI, AVX-VNNI,
AVX2); a route the CPU lacks skips with the reason.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagedllm.kernels import ops as kernel_ops
from pagedllm.kernels import quant
from pagedllm.kernels.quant import (
    QuantWeight,
    concat_rows,
    dequantize,
    from_gguf_blocks,
    quant_linear,
)

gguf = pytest.importorskip("gguf")

ops = kernel_ops.layer_ops()
ROUTES = ["avx512_vnni", "avx_vnni", "avx2"]
FORMATS = ["Q8_0", "Q4_0", "Q4_1"]


@pytest.fixture(params=ROUTES)
def route(request):
    """Runs the test on one route, capped with set_quant_gemm_isa; skips where this CPU (or
    the build) lacks it."""
    if ops is None:
        pytest.skip("the C++ kernels did not build")
    saved = ops.set_quant_gemm_isa(request.param)
    try:
        if ops.quant_gemm_isa() != request.param:
            pytest.skip(f"this CPU has no {request.param} (quant_gemm runs {ops.quant_gemm_isa()})")
        yield request.param
    finally:
        ops.set_quant_gemm_isa(saved)


def gguf_weight(format: str, rows: int, width: int, seed: int = 0):
    """(QuantWeight, the gguf package's float32 dequantisation) of a random weight."""
    qtype = gguf.GGMLQuantizationType[format]
    array = np.random.default_rng(seed).standard_normal((rows, width)).astype(np.float32)
    blocks = gguf.quants.quantize(array * 0.05, qtype)
    reference = gguf.quants.dequantize(blocks, qtype).reshape(rows, width)
    return from_gguf_blocks(blocks, format, (rows, width)), torch.from_numpy(reference.copy())


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    return float((actual - expected).norm() / expected.norm())


def emulated(x: torch.Tensor, weight: QuantWeight, reference: torch.Tensor) -> torch.Tensor:
    """quant_gemm's arithmetic in float64: x quantised per block as the kernel does, times
    the exactly dequantised weight."""
    blocks = x.float().view(x.shape[0], -1, quant.BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    xq = torch.round(blocks * inv)
    dx = amax / 127.0
    return (xq.double() * dx.double()).view_as(x) @ reference.double().T


@pytest.mark.parametrize("format", FORMATS)
def test_layout_dequantises_as_gguf_does(format) -> None:
    weight, reference = gguf_weight(format, 48, 96)
    assert weight.shape == (48, 96)
    assert torch.equal(dequantize(weight), reference)
    if ops is None:
        pytest.skip("the C++ kernels did not build")
    assert torch.equal(ops.quant_dequantize(weight.data, torch.float32), reference)
    bf16 = ops.quant_dequantize(weight.data, torch.bfloat16)
    assert torch.equal(bf16, reference.to(torch.bfloat16))


@pytest.mark.usefixtures("route")
@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("num_rows", [1, 3, 4, 7, 16])
def test_quant_gemm_matches_the_float_reference(format, num_rows) -> None:
    weight, reference = gguf_weight(format, 72, 576)
    x = torch.randn(num_rows, 576, generator=torch.Generator().manual_seed(num_rows))
    out = ops.quant_gemm(x, weight.data, None)
    assert out.shape == (num_rows, 72) and out.dtype == torch.float32
    assert relative_error(out, F.linear(x, reference)) <= 1e-2
    assert relative_error(out, emulated(x, weight, reference)) <= 1e-5


@pytest.mark.usefixtures("route")
@pytest.mark.parametrize("format", FORMATS)
def test_quant_gemm_in_bf16_with_bias(format) -> None:
    weight, reference = gguf_weight(format, 40, 160, seed=1)
    x = torch.randn(2, 160).to(torch.bfloat16)
    bias = torch.randn(40).to(torch.bfloat16)
    out = ops.quant_gemm(x, weight.data, bias)
    assert out.dtype == torch.bfloat16
    expected = F.linear(x.float(), reference, bias.float())
    assert relative_error(out, expected) <= 1e-2


@pytest.mark.parametrize("format", FORMATS)
def test_every_route_gives_the_same_bits(format) -> None:
    if ops is None:
        pytest.skip("the C++ kernels did not build")
    weight, _ = gguf_weight(format, 64, 320, seed=2)
    x = torch.randn(5, 320)
    outs = {}
    for name in ROUTES:
        saved = ops.set_quant_gemm_isa(name)
        try:
            if ops.quant_gemm_isa() == name:
                outs[name] = ops.quant_gemm(x, weight.data, None)
        finally:
            ops.set_quant_gemm_isa(saved)
    if len(outs) < 2:
        pytest.skip(f"this CPU has one route only ({', '.join(outs) or 'none'})")
    first = next(iter(outs.values()))
    assert all(torch.equal(out, first) for out in outs.values())


@pytest.mark.parametrize("with_ops", [True, False], ids=["kernels", "torch"])
@pytest.mark.parametrize("format", FORMATS)
def test_many_rows_use_dequantised_tiles(monkeypatch, format, with_ops) -> None:
    if with_ops and ops is None:
        pytest.skip("the C++ kernels did not build")
    monkeypatch.setattr(quant, "TILE_ELEMENTS", 20 * 64)  # three tiles of 20, 20, 8 rows
    weight, reference = gguf_weight(format, 48, 64, seed=3)
    x = torch.randn(quant.QUANT_GEMM_MAX_ROWS + 1, 64)
    bias = torch.randn(48)
    out = quant_linear(x, weight, bias, ops if with_ops else None)
    assert torch.allclose(out, F.linear(x, reference, bias), rtol=1e-5, atol=1e-5)


def test_rows_and_concat_keep_the_layout() -> None:
    first, ref_first = gguf_weight("Q4_0", 8, 64, seed=4)
    second, ref_second = gguf_weight("Q4_1", 4, 64, seed=5)
    fused = concat_rows([first, second])
    assert fused.format == "Q4_0+Q4_1" and fused.shape == (12, 64)
    assert torch.equal(dequantize(fused), torch.cat((ref_first, ref_second)))
    order = torch.tensor([3, 0, 11])
    assert torch.equal(dequantize(fused.rows(order)), torch.cat((ref_first, ref_second))[order])
    with pytest.raises(ValueError, match="one quantized layout"):
        concat_rows([first, gguf_weight("Q8_0", 4, 64)[0]])


def test_unsupported_shapes_and_formats_are_refused() -> None:
    blocks = gguf.quants.quantize(np.zeros((2, 32), np.float32), gguf.GGMLQuantizationType.Q5_0)
    with pytest.raises(ValueError, match="unsupported quantized format 'Q5_0'"):
        from_gguf_blocks(blocks, "Q5_0", (2, 32))
