"""Run a test on one small_gemm route: the kernels cap their ISA on request, so a CPU with
AVX-512 runs the AVX2 route too (and AMX the AVX-512-bf16 one)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from pagedllm.kernels.ops import layer_ops

# Every small_gemm route, best first, per dtype.
ROUTES = {torch.bfloat16: ("amx", "avx512_bf16"), torch.float32: ("avx512", "avx2")}


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
