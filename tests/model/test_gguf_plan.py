"""``pagedllm plan`` on a GGUF counts the weights the engine holds: read from the header
alone (``gguf_header.held_weight_bytes``), they equal ``held_weight_bytes`` of the loaded
model, the figure of the start-up report, byte for byte, for the format mixes real files
have (Qwen2.5-Coder's Q5_0 with Q8_0 v, SmolLM2's Q4_1 with a Q8_0 tied embedding,
Q4_K_M's Q4_K with Q6_K v/down in some layers, whose q/k/v are kept apart there)."""

from __future__ import annotations

import json

import pytest

from pagedllm.cli import main
from pagedllm.gguf_header import held_weight_bytes, read_header
from pagedllm.model import load_model
from pagedllm.model.weights import held_weight_bytes as engine_weight_bytes

from .test_gguf_and_default_model import write_tiny_gguf
from .test_quantized_gguf import q4_k_m_formats, qwen_coder_formats

pytest.importorskip("gguf")


CASES = {
    "qwen_coder": ("qwen2_wide", qwen_coder_formats, "Q5_0"),
    "smollm2": ("llama_tied", "Q4_1", "Q8_0"),
    "q4_k_m": ("qwen2_wide", q4_k_m_formats, "Q4_K"),
    "q8_0": ("llama_gqa", "Q8_0", None),
}


def planned_weight_bytes(path, capsys, *extra: str) -> int:
    args = ["plan", "--model", str(path), "--memory", "16", "--context-len", "64", "--json"]
    assert main([*args, *extra]) == 0
    return json.loads(capsys.readouterr().out)["budget"]["weight_bytes"]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_plan_counts_the_weights_the_engine_holds(tmp_path, checkpoints, capsys, case, dtype):
    variant, linears, embedding = CASES[case]
    path = write_tiny_gguf(checkpoints(variant), tmp_path / "t.gguf", False, linears, embedding)
    loaded = load_model(path, dtype=dtype, load_tokenizer=False)
    held = engine_weight_bytes(loaded.model)
    float_bytes = 4 if dtype == "float32" else 2
    assert held_weight_bytes(read_header(path), float_bytes) == held
    assert planned_weight_bytes(path, capsys, "--weight-dtype", dtype) == held
    assert loaded.weight_bytes == held  # what the start-up report prints


def test_stored_bytes_are_the_files_where_the_layout_keeps_them(tmp_path, checkpoints, capsys):
    """Q8_0 and Q6_K keep their block size in the kernels' layout: the plan's weights are
    the file's tensor bytes, float ones at 4 bytes a weight."""
    path = write_tiny_gguf(checkpoints("llama_gqa"), tmp_path / "t.gguf", False, "Q8_0", "Q8_0")
    header = read_header(path)
    stored = sum(t.nbytes for t in header.tensors)
    assert all(t.type_name in ("Q8_0", "F32") for t in header.tensors)
    assert planned_weight_bytes(path, capsys, "--weight-dtype", "float32") == stored
    loaded = load_model(path, dtype="float32", load_tokenizer=False)
    assert loaded.weight_bytes == stored
