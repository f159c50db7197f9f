"""``decoder_layers`` (all layers in one C++ call) gives the per-layer loop's results bit for
bit, and steps it cannot take go to the loop."""

from __future__ import annotations

import pytest
import torch

from pagedllm.attention import cpu as cpu_attention
from pagedllm.attention.base import AttentionKind
from pagedllm.attention.cpu import CpuAttention
from pagedllm.model import fast_path
from pagedllm.model.loader import load_model
from pagedllm.testing import make_tiny_checkpoint
from pagedllm.worker.model_runner import TorchModelRunner

from .parity_helpers import HandDriver


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("decoder-layers")
    # head_dim 64 and a GQA group of 4, like the benchmark model; qwen2 adds q/k/v biases.
    shape = dict(
        hidden_size=256, intermediate_size=384, num_attention_heads=4, num_key_value_heads=1
    )
    # Sliding windows: every layer (Mistral) and the layers from 1 on (Qwen2), windows
    # edging inside the 16-token blocks.
    windows = {
        "mistral_window": ("mistral", {"sliding_window": 9}),
        "qwen2_window": (
            "qwen2",
            {"use_sliding_window": True, "sliding_window": 20, "max_window_layers": 1},
        ),
    }
    paths = {
        arch: make_tiny_checkpoint(root / arch, arch, seed=7, **shape)
        for arch in ("llama", "qwen2")
    }
    for name, (arch, extra) in windows.items():
        paths[name] = make_tiny_checkpoint(root / name, arch, seed=7, **shape, **extra)
    return paths


def make_runner(path, dtype: str, whole: bool, **cache) -> TorchModelRunner:
    loaded = load_model(path, dtype, CpuAttention())
    runner = TorchModelRunner(loaded.model, block_size=16, num_blocks=64, **cache)
    path = loaded.model.fast_path
    if path is None or path.plan is None:
        pytest.skip(
            "no small_gemm for this dtype here (bf16: AMX or AVX-512-bf16; float32: AVX-512 "
            "or AVX2), or no kernels"
        )
    if not whole:
        path.plan = None
    return runner


def run_steps(runner: TorchModelRunner) -> list[dict[str, torch.Tensor]]:
    """A whole prompt, a prompt in two chunks (the first samples nothing), then decode."""
    driver = HandDriver(runner)
    a = driver.add("a", [(7 * i) % 250 for i in range(37)])
    b = driver.add("b", [(11 * i + 3) % 250 for i in range(21)])
    steps = [driver.step([driver.schedule(a, 37), driver.schedule(b, 9, num_samples=0)])]
    steps.append(driver.step([driver.schedule(b, 12)]))
    for t in range(6):
        for seq in (a, b):
            driver.append(seq.request_id, (t * 13 + len(seq.token_ids)) % 250)
        steps.append(driver.step([driver.schedule(a, 1), driver.schedule(b, 1)]))
    return steps


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral_window", "qwen2_window"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_call_equals_the_layer_loop(checkpoints, monkeypatch, arch: str, dtype: str):
    calls = []
    real = fast_path.decoder_layers
    monkeypatch.setattr(fast_path, "decoder_layers", lambda *a: calls.append(1) or real(*a))
    whole = run_steps(make_runner(checkpoints[arch], dtype, whole=True))
    taken = len(calls)
    loop = run_steps(make_runner(checkpoints[arch], dtype, whole=False))
    assert len(calls) == taken  # the loop runner never calls it
    # Every decode step goes through the one call (and the prompt steps where the kernel
    # takes long queries: bf16 on the tile unit). Qwen2 with max_window_layers mixes full
    # and sliding layers: a block table per KV cache group (core/kv_groups.py), each layer
    # attending with its group's, in the one call as in the loop.
    assert taken >= 6
    assert len(whole) == len(loop)
    for mine, theirs in zip(whole, loop, strict=True):
        assert mine.keys() == theirs.keys()
        for request_id in mine:
            assert torch.equal(mine[request_id], theirs[request_id]), request_id


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "int4", "fp8_e4m3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("first_block", [False, True])
def test_one_call_over_a_quantized_cache_equals_the_layer_loop(
    checkpoints, monkeypatch, kv_cache_dtype: str, dtype: str, first_block: bool
):
    """quant_decoder_layers (quant_write and quant_attention per layer, in one C++ call)
    gives the per-layer loop's logits bit for bit over the same quantized cache: prompt
    steps and decode, blocks sealed mid-step and open ones staged."""
    calls = []
    real = fast_path.quant_decoder_layers
    monkeypatch.setattr(fast_path, "quant_decoder_layers", lambda *a: calls.append(1) or real(*a))
    cache = dict(kv_cache_dtype=kv_cache_dtype, unquantized_first_block=first_block)
    whole = run_steps(make_runner(checkpoints["qwen2"], dtype, whole=True, **cache))
    taken = len(calls)
    loop = run_steps(make_runner(checkpoints["qwen2"], dtype, whole=False, **cache))
    assert len(calls) == taken >= 6  # every decode step in one call; the loop runner never
    assert len(whole) == len(loop)
    for mine, theirs in zip(whole, loop, strict=True):
        assert mine.keys() == theirs.keys()
        for request_id in mine:
            assert torch.equal(mine[request_id], theirs[request_id]), request_id


def test_a_quantized_step_the_kernel_does_not_take_uses_the_loop(checkpoints, monkeypatch):
    runner = make_runner(checkpoints["llama"], "float32", whole=True, kv_cache_dtype="int8")
    backend = runner.model.fast_path.plan.backend
    driver = HandDriver(runner)
    seq = driver.add("a", list(range(5)))
    batch = runner.input_buffers.build(
        [driver.schedule(seq, 5)], runner.block_size, runner.device, runner.num_blocks
    )
    batch.meta.quant = runner.kv_cache.plan_step(batch.meta)
    k, v = runner.kv_caches[0]
    assert backend.quant_kernel_step(torch.float32, 64, k, v, batch.meta) is not None
    assert backend.quant_kernel_step(torch.bfloat16, 64, k, v, batch.meta) is None
    assert backend.quant_kernel_step(torch.float32, 32, k, v, batch.meta) is None
    windowed = AttentionKind(sliding_window=8)
    assert backend.quant_kernel_step(torch.float32, 64, k, v, batch.meta, windowed) is None
    runner.kv_cache.finish_step()
    # Without the C++ write the one-call op has nothing to call: the loop runs.
    calls = []
    real = fast_path.quant_decoder_layers
    monkeypatch.setattr(fast_path, "quant_decoder_layers", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(backend, "_quant_write", None)
    driver.step([driver.schedule(seq, 5)])
    assert calls == []


def test_steps_the_kernel_does_not_take_whole_use_the_loop(checkpoints, monkeypatch):
    calls = []
    real = fast_path.decoder_layers
    monkeypatch.setattr(fast_path, "decoder_layers", lambda *a: calls.append(1) or real(*a))
    # The AVX2 route also takes longer float32 queries over short contexts: not here.
    monkeypatch.setattr(cpu_attention, "AVX2_LONG_QUERY_MAX_SEQ_LEN", 0)
    runner = make_runner(checkpoints["llama"], "float32", whole=True)
    driver = HandDriver(runner)
    # float32 queries longer than MAX_KERNEL_QUERY_LEN go to SDPA: not a whole-kernel step.
    seq = driver.add("a", list(range(40)))
    driver.step([driver.schedule(seq, 40)])
    assert calls == []
    driver.append("a", 5)
    driver.step([driver.schedule(seq, 1)])
    assert calls == [1]


def test_kernel_step_refuses_what_the_op_would_not_take(checkpoints):
    runner = make_runner(checkpoints["llama"], "float32", whole=True)
    backend = runner.model.fast_path.plan.backend
    driver = HandDriver(runner)
    seq = driver.add("a", list(range(5)))
    batch = runner.input_buffers.build(
        [driver.schedule(seq, 5)], runner.block_size, runner.device, runner.num_blocks
    )
    k, v = runner.kv_caches[0]
    assert backend.kernel_step(torch.float32, 4, 64, k, v, batch.meta) is not None
    assert backend.kernel_step(torch.float16, 4, 64, k, v, batch.meta) is None
    assert backend.kernel_step(torch.float32, 4, 32, k, v, batch.meta) is None
    assert backend.kernel_step(torch.float32, 4, 64, k.transpose(1, 2), v, batch.meta) is None
    assert backend.kernel_step(torch.float32, 4, 64, k, v.to(torch.bfloat16), batch.meta) is None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_row_tiles_after_attention_equal_the_whole_step(checkpoints, monkeypatch, dtype: str):
    # Prompt steps run o / norm / MLP in row tiles (fast_path.after_attention); on
    # small_gemm every row's result is the same whichever tile holds it, so tiles of 8 rows
    # (a 37-token prompt: tiles ending mid-prompt and a short last tile) give the untiled
    # step's results bit for bit.
    monkeypatch.setattr(fast_path, "TILE_ROWS", 10**9)
    whole = run_steps(make_runner(checkpoints["llama"], dtype, whole=False))
    monkeypatch.setattr(fast_path, "TILE_ROWS", 8)
    calls = []
    real = fast_path._after_attention
    monkeypatch.setattr(fast_path, "_after_attention", lambda *a: calls.append(1) or real(*a))
    tiled = run_steps(make_runner(checkpoints["llama"], dtype, whole=False))
    assert len(calls) > len(tiled) * 2  # the prompt steps ran in several tiles per layer
    for mine, theirs in zip(tiled, whole, strict=True):
        for request_id in mine:
            assert torch.equal(mine[request_id], theirs[request_id]), request_id
