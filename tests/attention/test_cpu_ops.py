"""The C++ greedy argmax against torch.argmax, and the kernel build/fallback plumbing."""

from __future__ import annotations

import pytest
import torch

from pagedllm.attention import cpu
from pagedllm.attention.cpu import argmax_rows, build_extension, load_library

needs_library = pytest.mark.skipif(not load_library(), reason="C++ kernels did not build")


@needs_library
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("width", [1, 15, 16, 17, 1000, 32000])
def test_argmax_matches_torch(dtype, width):
    gen = torch.Generator().manual_seed(width)
    x = torch.randn(9, width, generator=gen).to(dtype)
    assert torch.equal(argmax_rows(x), x.argmax(-1))


@needs_library
def test_argmax_ties_take_the_first_index():
    x = torch.zeros(3, 100)
    x[0, [7, 40, 99]] = 5.0  # several lanes hold the maximum
    x[1, [33, 17]] = 2.0
    x[2, 80:] = 1.0  # tail after the vector loop
    assert argmax_rows(x).tolist() == [7, 17, 80] == x.argmax(-1).tolist()


@needs_library
def test_argmax_strided_rows_and_nan():
    x = torch.randn(4, 64)[:, :50]
    assert torch.equal(argmax_rows(x), x.argmax(-1))
    y = torch.randn(2, 40)
    y[1, 21] = float("nan")
    assert argmax_rows(y).tolist() == y.argmax(-1).tolist()


def test_argmax_fallback_without_library(monkeypatch):
    monkeypatch.setattr(cpu, "load_library", lambda: False)
    x = torch.randn(5, 33)
    assert torch.equal(argmax_rows(x), x.argmax(-1))


def test_build_failure_raises_and_loader_falls_back(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(OSError):
        build_extension(tmp_path)
    assert not list(tmp_path.glob("*.so"))


def test_disabled_extension_uses_torch_path(monkeypatch):
    monkeypatch.setattr(cpu, "load_extension", lambda: None)
    backend = cpu.CpuAttention()
    assert not backend.uses_extension
    with pytest.raises(RuntimeError, match="could not be built"):
        cpu.CpuAttention(use_extension=True)
