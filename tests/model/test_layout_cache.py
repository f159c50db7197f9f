"""A GGUF's kept weights, repacked once, are read back from the layout cache on the next
load: the same weights, no repacking; a changed file is repacked afresh."""

from __future__ import annotations

import os

import pytest
import torch

from pagedllm.kernels.quant import QuantWeight
from pagedllm.model import gguf_loader
from pagedllm.model.gguf_loader import read_gguf
from pagedllm.model.layout_cache import layout_cache_file, load_layouts

from .test_gguf_and_default_model import write_tiny_gguf
from .test_quantized_gguf import qwen_coder_formats

pytest.importorskip("gguf")


def kept_weights(path, cache) -> dict[str, QuantWeight]:
    _, tensors, _ = read_gguf(path, keep_quantized=True, layout_cache=cache)
    return {name: t for name, t in tensors if isinstance(t, QuantWeight)}


def test_the_second_load_reads_the_repacked_weights(tmp_path, checkpoints, monkeypatch):
    source = checkpoints("qwen2_wide")
    path = write_tiny_gguf(source, tmp_path / "t.gguf", False, qwen_coder_formats, "Q5_0")
    cache = tmp_path / "layouts"
    first = kept_weights(path, cache)
    assert layout_cache_file(path, cache).is_file()

    def no_repacking(*args):
        raise AssertionError("repacked although cached")

    monkeypatch.setattr(gguf_loader, "quantized_tensor", no_repacking)
    second = kept_weights(path, cache)
    assert first.keys() == second.keys() and len(first) == 7 * 2 + 2  # q, k, v, o, gate, up, down
    for name, weight in first.items():
        again = second[name]
        assert (again.format, again.stored) == (weight.format, weight.stored)
        assert torch.equal(again.data, weight.data)
    os.utime(path, ns=(0, 12345))  # a changed file: another key, repacked again
    assert not layout_cache_file(path, cache).exists()
    with pytest.raises(AssertionError, match="repacked although cached"):
        kept_weights(path, cache)


def test_an_unreadable_layout_is_a_miss_and_a_new_one_replaces_the_old(tmp_path, checkpoints):
    source = checkpoints("qwen2_wide")
    path = write_tiny_gguf(source, tmp_path / "t.gguf", False, qwen_coder_formats, "Q5_0")
    cache = tmp_path / "layouts"
    first = kept_weights(path, cache)
    file = layout_cache_file(path, cache)
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])  # torn by a crash
    again = kept_weights(path, cache)  # repacked, not a failed load
    assert all(torch.equal(again[name].data, w.data) for name, w in first.items())
    assert load_layouts(file) is not None  # written back whole
    os.utime(path, ns=(0, 12345))
    kept_weights(path, cache)
    assert [p.name for p in cache.glob("*.safetensors")] == [layout_cache_file(path, cache).name]


def test_a_layout_that_cannot_be_written_costs_only_the_repacking(tmp_path, checkpoints):
    source = checkpoints("qwen2_wide")
    path = write_tiny_gguf(source, tmp_path / "t.gguf", False, qwen_coder_formats, "Q5_0")
    cache = tmp_path / "layouts"
    cache.write_text("a file where the directory should be")
    assert len(kept_weights(path, cache)) == 7 * 2 + 2
