"""--quantization: a float checkpoint's layer linears quantized at load (model/quantize.py)
against the float model, both fed the float model's greedy tokens (``run_in_lockstep``).

Measured on the tiny random models (largest KL over a prompt step and 6 decode steps):
int8 2.1e-6 (llama_gqa), 7.9e-7 (qwen2_bias); q4_0 4.7e-4, 7.8e-5; top-1 agreement on
decided rows 100% (int8), 85% and 100% (q4_0).
"""

from __future__ import annotations

import pytest

from pagedllm.engine.config import EngineConfig
from pagedllm.model import load_model
from pagedllm.model.llama import Linear

from .parity_helpers import PROMPTS
from .test_gguf_and_default_model import write_tiny_gguf
from .test_quantized_gguf import run_in_lockstep

pytest.importorskip("gguf")

BOUNDS = {"int8": (2e-5, 0.95), "q4_0": (2e-3, 0.8)}


@pytest.mark.parametrize("scheme", sorted(BOUNDS))
@pytest.mark.parametrize("variant", ["llama_gqa", "qwen2_bias"])
def test_quantized_at_load_stays_close_to_the_float_model(checkpoints, variant, scheme) -> None:
    source = checkpoints(variant)
    reference = load_model(source, dtype="float32", load_tokenizer=False)
    quantized = load_model(source, dtype="float32", load_tokenizer=False, quantization=scheme)
    kept = [m for m in quantized.model.modules() if isinstance(m, Linear) and m.quant is not None]
    assert len(kept) == 4 * quantized.config.num_hidden_layers  # the head stays float
    assert all(m.weight.numel() == 0 for m in kept)
    # measured 243 KB vs 460 KB: the tiny model is mostly its float embedding and head
    assert quantized.weight_bytes < 0.6 * reference.weight_bytes
    max_kl, min_top1 = BOUNDS[scheme]
    worst, top1 = run_in_lockstep(reference.model, quantized.model, PROMPTS)
    assert worst <= max_kl, f"KL {worst:.2e}"
    assert top1 >= min_top1, f"top-1 agreement {top1:.3f}"
    assert "at load" in quantized.model.routes().linears


def test_unknown_scheme_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="int4")


def test_a_gguf_quantized_otherwise_is_refused(tmp_path, checkpoints) -> None:
    gguf_file = write_tiny_gguf(checkpoints("llama_gqa"), tmp_path / "t.gguf", False, "Q4_1")
    with pytest.raises(ValueError, match="quantization='q8_0'"):
        load_model(gguf_file, dtype="float32", load_tokenizer=False, quantization="q8_0")
