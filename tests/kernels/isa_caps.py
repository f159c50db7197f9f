"""Run a test on one kernel route: the kernels cap their ISA on request, so a CPU with
AVX-512 runs the AVX2 route too (and AMX the AVX-512-bf16 one, AVX-512-VNNI the AVX-VNNI and
AVX2 integer ones)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from pagedllm.kernels.ops import layer_ops

# Every small_gemm route, best first, per dtype.
ROUTES = {torch.bfloat16: ("amx", "avx512_bf16"), torch.float32: ("avx512", "avx2")}
# Every quant_gemm integer route, best first: Intel Sapphire Rapids and AMD Zen 4 run the
# first, Alder Lake the second, Zen 3 the third.
QUANT_ROUTES = ("avx512_vnni", "avx_vnni", "avx2")


@contextmanager
def small_gemm_capped(dtype: torch.dtype, isa: str) -> Iterator[None]:
    """small_gemm runs ``dtype`` on ``isa`` inside the block (the cap is restored after);
    skips with the reason where this CPU or the build lacks that route."""
    ops = layer_ops()
    if ops is None:
        pytest.skip("the C++ kernels did not build")
    if dtype == torch.bfloat16:
        cap, current = ops.set_small_gemm_isa, ops.small_gemm_isa
    else:
        cap, current = ops.set_small_gemm_f32_isa, ops.small_gemm_f32_isa
    saved = cap(isa)
    try:
        if current() != isa:
            pytest.skip(f"this CPU has no {isa} route for {dtype} (small_gemm runs {current()})")
        yield
    finally:
        cap(saved)


@contextmanager
def quant_gemm_capped(isa: str) -> Iterator[None]:
    """quant_gemm's integer kernel runs on ``isa`` inside the block; skips with the reason
    where this CPU or the build lacks it."""
    ops = layer_ops()
    if ops is None:
        pytest.skip("the C++ kernels did not build")
    saved = ops.set_quant_gemm_isa(isa)
    try:
        if ops.quant_gemm_isa() != isa:
            pytest.skip(f"this CPU has no {isa} (quant_gemm runs {ops.quant_gemm_isa()})")
        yield
    finally:
        ops.set_quant_gemm_isa(saved)
