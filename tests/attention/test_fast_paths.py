"""Every CPU fast path gives the reference path's greedy tokens.

Reference = ``ReferenceAttention`` + the plain model code (``optimize=False``) + the
sampler's general pipeline. Fast = ``CpuAttention`` (C++ kernel) + packed bf16 weights +
fused layer ops + the sampler's greedy shortcut. float32 must match token for token;
bfloat16 logits must agree to within bf16 rounding.
"""

from __future__ import annotations

import random

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.attention.cpu import CpuAttention
from pagedllm.attention.reference import ReferenceAttention
from pagedllm.core.outputs import ScheduledSequence
from pagedllm.engine.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.kernels.build import load_library
from pagedllm.kernels.linear import pack_small_weight, pack_weight
from pagedllm.kernels.ops import layer_ops
from pagedllm.model.loader import load_model
from pagedllm.worker.model_runner import TorchModelRunner
from pagedllm.worker.sampler import Sampler


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):
    from pagedllm.testing import make_tiny_checkpoint

    # head_dim 64 and a GQA group of 4, like the benchmark model: the kernel's fast shapes.
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("fast-paths"),
        "llama",
        seed=5,
        hidden_size=256,
        intermediate_size=384,
        num_attention_heads=4,
        num_key_value_heads=1,
    )


def make_llm(path, dtype: str, fast: bool, block_size: int = 16, **config) -> LLM:
    backend = CpuAttention() if fast else ReferenceAttention()
    loaded = load_model(path, dtype, backend)
    runner = TorchModelRunner(
        loaded.model,
        block_size=block_size,
        num_blocks=512,
        optimize=fast,
        sampler=Sampler(fast_greedy=fast),
    )
    engine_config = EngineConfig(
        model=str(path), dtype=dtype, block_size=block_size, num_blocks=512, **config
    )
    engine = LLMEngine(engine_config, runner, loaded.tokenizer, model_config=loaded.config)
    return LLM.from_engine(engine)


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 256) for _ in range(rng.randint(3, 70))] for _ in range(count)]


def greedy_tokens(llm: LLM, batch, params) -> list[tuple[int, ...]]:
    return [tuple(o.outputs[0].token_ids) for o in llm.generate(batch, params, use_tqdm=False)]


@pytest.mark.parametrize("block_size", [16, 5])
def test_float32_greedy_tokens_match_the_reference(checkpoint, block_size):
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        for n in (30, 7, 19, 25, 1, 12)
    ]
    batch = prompts(len(params))
    reference = make_llm(checkpoint, "float32", fast=False, block_size=block_size)
    fast = make_llm(checkpoint, "float32", fast=True, block_size=block_size)
    expected = greedy_tokens(reference, batch, params)
    assert greedy_tokens(fast, batch, params) == expected
    assert sum(len(t) for t in expected) == sum(p.max_tokens for p in params)


def test_float32_chunked_prefill_matches(checkpoint):
    # A small token budget splits prompts into chunks that attend to a cached prefix.
    batch = prompts(4, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    results = [
        greedy_tokens(
            make_llm(checkpoint, "float32", fast, max_num_batched_tokens=24), batch, params
        )
        for fast in (False, True)
    ]
    assert results[0] == results[1]


def test_bfloat16_logits_agree(checkpoint):
    rows = []
    for fast in (False, True):
        backend = CpuAttention() if fast else ReferenceAttention()
        loaded = load_model(checkpoint, "bfloat16", backend)
        runner = TorchModelRunner(loaded.model, block_size=16, num_blocks=64, optimize=fast)
        seqs = [
            ScheduledSequence(f"r{i}", tuple(p), 0, tuple(range(1 + 8 * i, 8 + 8 * i)))
            for i, p in enumerate(prompts(3, seed=2))
        ]
        rows.append(runner.compute_logits(seqs))
    reference, fast_rows = rows
    assert (fast_rows - reference).abs().max() <= 0.05 * reference.abs().max()


def test_optimize_switches_the_fast_paths_on(checkpoint):
    loaded = load_model(checkpoint, "bfloat16", CpuAttention())
    plain = loaded.model.layers[0].mlp.gate_up_proj
    TorchModelRunner(loaded.model, block_size=16, num_blocks=8, optimize=False)
    assert plain.packed is None and plain.small is None and loaded.model.fast_path is None
    weight = plain.weight
    TorchModelRunner(loaded.model, block_size=16, num_blocks=8)
    ops = layer_ops()
    assert (loaded.model.fast_path is not None) == load_library()
    # One packed copy, in place of the plain weight: the small-batch tiles where the CPU has
    # the tile unit, else oneDNN's.
    if pack_small_weight(weight, ops) is not None:
        assert plain.small is not None and plain.packed is None and plain.weight.numel() == 0
    elif pack_weight(weight) is not None:
        assert plain.packed is not None and plain.weight.numel() == 0
    else:
        assert plain.weight is weight


def test_greedy_tokens_from_the_head_equal_the_argmax_of_the_logits(checkpoint):
    loaded = load_model(checkpoint, "bfloat16", CpuAttention())
    runner = TorchModelRunner(loaded.model, block_size=16, num_blocks=64)
    seqs = [
        ScheduledSequence(f"r{i}", tuple(p), 0, tuple(range(1 + 8 * i, 8 + 8 * i)))
        for i, p in enumerate(prompts(5, seed=3))
    ]
    ops = layer_ops()
    if ops is None or not ops.small_gemm_available(True):
        pytest.skip("no bf16 small_gemm here (no kernels, or neither AMX nor AVX-512-bf16)")
    hidden = runner.sampled_hidden(seqs)
    fused = loaded.model.greedy_tokens(hidden)
    assert fused is not None  # the kernel applies: the runner must not take the logits path
    logits = loaded.model.compute_logits(hidden, float32=False)
    assert fused.tolist() == logits.argmax(-1).tolist()
    assert loaded.model.greedy_tokens(hidden.float()) is None  # bf16 only


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_output_rows_are_the_full_forwards_rows_with_the_same_cache(checkpoint, dtype):
    # The fused path stops the last layer after attention for rows nobody reads; the rows
    # it returns, and every row's K/V, must be what the full forward gives.
    import torch

    from pagedllm.worker.input_batch import build_input_batch

    loaded = load_model(checkpoint, dtype, CpuAttention())
    runner = TorchModelRunner(loaded.model, block_size=16, num_blocks=64, optimize=True)
    model = runner.model
    assert model.fast_path is not None  # the fused path is the one under test
    seqs = [
        ScheduledSequence(f"r{i}", tuple(p), 0, tuple(range(1 + 8 * i, 8 + 8 * i)))
        for i, p in enumerate(prompts(3, seed=3))
    ]
    batch = build_input_batch(seqs, 16)
    empty = [(k.clone(), v.clone()) for k, v in runner.kv_caches]

    def run(rows):
        for (k, v), (k0, v0) in zip(runner.kv_caches, empty, strict=True):
            k.copy_(k0)
            v.copy_(v0)
        with torch.inference_mode():
            out = model(batch.input_ids, batch.positions, runner.kv_caches, batch.meta, rows)
        return out, [(k.clone(), v.clone()) for k, v in runner.kv_caches]

    full, full_cache = run(None)
    picked = batch.logits_indices
    assert 0 < picked.numel() < full.shape[0]
    for rows in (picked, picked.flip(0), picked[:0]):
        out, cache = run(rows)
        assert out.shape == (rows.numel(), full.shape[1])
        assert torch.equal(out, full[rows])
        assert all(
            torch.equal(k, k_full) and torch.equal(v, v_full)
            for (k, v), (k_full, v_full) in zip(cache, full_cache, strict=True)
        )
