"""The planner's predicted concurrency equals what the engine admits.

Given a model and a KV budget in bytes, the planner predicts the blocks and the maximum
number of concurrent sequences of a fixed length. The engine sizes its cache from the
same budget and runs requests of that length; the peak number running must equal the
prediction, or be one fewer: the engine keeps a 1% watermark of blocks free at admission.

The lengths are chosen so that a prompt's blocks already hold every token the sequence
will cache (prompt + output - 1): what is admitted is what runs to the end, with no
growth and no preemption, so the peak is the steady-state concurrency.
"""

from __future__ import annotations

import json
import random

import pytest

from pagedllm.cli import main
from pagedllm.planner.presets import GIB

BLOCK_SIZE = 16
TOKEN_BYTES = 2 * 2 * 16 * 2 * 4  # tiny llama: layers x KV heads x head dim x (K, V) x fp32


def _predicted(model_dir, kv_budget: int, length: int, capsys, extra=()) -> dict:
    args = [
        "plan",
        "--model",
        str(model_dir),
        "--kv-cache-memory",
        repr(kv_budget / GIB),
        "--block-size",
        str(BLOCK_SIZE),
        "--context-len",
        str(length),
        "--json",
        *extra,
    ]
    assert main(args) == 0
    return json.loads(capsys.readouterr().out)


def _run(engine, prompt_len: int, output_len: int, num_requests: int) -> int:
    """Peak number of running sequences over the whole run."""
    from pagedllm.sampling_params import SamplingParams

    rng = random.Random(prompt_len)  # distinct prompts: no prefix sharing inflates the count
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    for i in range(num_requests):
        engine.add_request(f"r{i}", [rng.randrange(256) for _ in range(prompt_len)], params)
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, len(engine.scheduler.running))
    assert engine.scheduler.stats().num_preemptions == 0
    return peak


@pytest.mark.parametrize(
    ("num_blocks", "prompt_len", "output_len"),
    [(400, 60, 4), (400, 120, 8), (400, 250, 6), (1000, 100, 12), (97, 30, 2)],
)
def test_fake_runner_engine_admits_the_predicted_concurrency(
    tmp_path, capsys, num_blocks, prompt_len, output_len
):
    torch = pytest.importorskip("torch")
    from pagedllm.engine.config import EngineConfig
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.testing import tiny_config
    from pagedllm.worker.fake_runner import FakeModelRunner
    from pagedllm.worker.kv_cache import KVCacheSpec, num_blocks_from_budget

    tiny_config("llama", dtype="float32").save_pretrained(tmp_path)  # config.json only
    kv_budget = num_blocks * BLOCK_SIZE * TOKEN_BYTES + 100  # a remainder no block can use
    plan = _predicted(tmp_path, kv_budget, prompt_len + output_len, capsys)
    spec = KVCacheSpec(2, 2, 16, BLOCK_SIZE, torch.float32)
    engine_blocks = num_blocks_from_budget(spec, kv_cache_memory=kv_budget)
    assert plan["kv_bytes_per_token"] == spec.bytes_per_token == TOKEN_BYTES
    assert plan["geometry"]["num_blocks"] == engine_blocks == num_blocks

    predicted = plan["concurrency"][0]["paged"]
    runner = FakeModelRunner(engine_blocks, BLOCK_SIZE)
    config = EngineConfig(
        block_size=BLOCK_SIZE,
        max_model_len=1024,
        max_num_seqs=1024,
        max_num_batched_tokens=prompt_len * (predicted + 8),
    )
    peak = _run(LLMEngine(config, runner), prompt_len, output_len, predicted + 8)
    assert predicted - 1 <= peak <= predicted
    # Exactly: admission keeps int(1% of blocks) free once something runs.
    blocks_per_seq = -(-(prompt_len + output_len) // BLOCK_SIZE)
    assert peak == (num_blocks - int(0.01 * num_blocks)) // blocks_per_seq


@pytest.mark.slow
def test_tiny_checkpoint_engine_admits_the_predicted_concurrency(tmp_path, capsys):
    """End to end: a real (random) checkpoint, the engine sizing its cache from bytes."""
    pytest.importorskip("torch")
    from pagedllm.engine.config import EngineConfig
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.testing import make_tiny_checkpoint

    model_dir = make_tiny_checkpoint(tmp_path / "tiny", "llama", seed=0)
    kv_budget = 100 * BLOCK_SIZE * TOKEN_BYTES
    prompt_len, output_len = 60, 4
    plan = _predicted(model_dir, kv_budget, prompt_len + output_len, capsys)
    predicted = plan["concurrency"][0]["paged"]
    config = EngineConfig(
        model=str(model_dir),
        kv_cache_memory=kv_budget,
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=prompt_len * (predicted + 4),
        max_num_seqs=512,
        dtype="float32",  # the checkpoint's dtype, which the plan sizes the cache for
    )
    engine = LLMEngine.from_config(config)
    assert plan["kv_bytes_per_token"] == TOKEN_BYTES
    assert plan["geometry"]["num_blocks"] == engine.runner.num_blocks == 100
    peak = _run(engine, prompt_len, output_len, predicted + 4)
    assert predicted == 25
    assert predicted - 1 <= peak <= predicted


# ---- sliding windows: the planner counts a window's blocks, not the context's ----------

# Gemma 3's pattern: five local layers, then a global one (6 KV cache groups of 1 layer).
GEMMA3_LAYERS = ["sliding_attention"] * 5 + ["full_attention"]
LAYER_TOKEN_BYTES = 2 * 16 * 2 * 4  # KV heads x head dim x (K, V) x fp32: one layer


def _window_config(path, window: int):
    from pagedllm.testing import tiny_config

    config = tiny_config(
        "gemma3_text",
        num_hidden_layers=len(GEMMA3_LAYERS),
        layer_types=GEMMA3_LAYERS,
        sliding_window=window,
        head_dim=16,
        query_pre_attn_scalar=16,
        max_position_embeddings=16384,
        dtype="float32",
    )
    config.save_pretrained(path)
    return path


@pytest.mark.parametrize(
    ("num_blocks", "window", "prompt_len", "budget"),
    # Prompts one token into a block, 14 tokens of output in the same block: a decoding
    # sliding group holds ceil(W / 16) + 1 blocks throughout, the full group never grows,
    # and a sequence lives 14 steps (one is admitted a step): longer than the pool holds.
    [(620, 64, 513, 1024), (4700, 512, 4097, 8192), (2800, 512, 2049, 4096)],
)
def test_window_model_engine_admits_the_predicted_concurrency(
    tmp_path, capsys, num_blocks, window, prompt_len, budget
):
    """A local/global model at long contexts: every sequence decoding holds its whole
    context in the full group but only a window in each of the five sliding groups; the one
    being admitted holds its whole prompt in every group for a step. The planner's figure
    (1 + (blocks - placeholder - that peak) // the decoding footprint) is what the engine
    admits, or one fewer (the watermark)."""
    pytest.importorskip("torch")
    from pagedllm.engine.config import EngineConfig
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.model.config import ModelConfig
    from pagedllm.worker.fake_runner import FakeModelRunner

    output_len = 14
    path = _window_config(tmp_path, window)
    kv_budget = num_blocks * BLOCK_SIZE * LAYER_TOKEN_BYTES + 100
    args = ["--max-num-batched-tokens", str(budget)]
    plan = _predicted(path, kv_budget, prompt_len + output_len, capsys, args)
    assert plan["geometry"]["num_blocks"] == num_blocks  # a block holds one layer here
    assert plan["kv_bytes_per_token"] == 6 * LAYER_TOKEN_BYTES
    assert [g["sliding_window"] for g in plan["model"]["kv_cache_groups"]] == [None] + [window] * 5
    predicted = plan["concurrency"][0]["paged"]
    full = -(-(prompt_len + output_len) // BLOCK_SIZE)
    steady = full + 5 * (window // BLOCK_SIZE + 1)
    assert predicted == 1 + (num_blocks - 1 - 6 * full) // steady

    config = EngineConfig(
        block_size=BLOCK_SIZE,
        max_model_len=budget,
        max_num_seqs=1024,
        max_num_batched_tokens=budget,
        enable_chunked_prefill=False,
    )
    engine = LLMEngine(
        config,
        FakeModelRunner(num_blocks, BLOCK_SIZE),
        model_config=ModelConfig.from_file(path / "config.json"),
    )
    assert engine.kv.windows == (None,) + (window,) * 5
    peak = _run(engine, prompt_len, output_len, predicted + 4)
    assert predicted - 1 <= peak <= predicted
    watermark = int(0.01 * num_blocks)
    assert peak == 1 + (num_blocks - 1 - watermark - 6 * full) // steady
    # One table for every layer would hold the whole context in all six layers.
    assert predicted >= 2 * ((num_blocks // 6) // full)


def test_window_checkpoint_engine_agrees_with_the_plan(tmp_path, capsys):
    """A real (random) local/global checkpoint sized from bytes: the engine's blocks (one
    layer each here), its bytes per token of a block and its peak concurrency are the
    plan's, and the start-up report says so."""
    pytest.importorskip("torch")
    from pagedllm.engine.config import EngineConfig
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.testing import make_tiny_checkpoint

    window, prompt_len, output_len, budget = 64, 513, 14, 1024
    model_dir = make_tiny_checkpoint(
        tmp_path / "g3",
        "gemma3_text",
        num_hidden_layers=len(GEMMA3_LAYERS),
        layer_types=GEMMA3_LAYERS,
        sliding_window=window,
        max_position_embeddings=2048,
    )
    kv_budget = 620 * BLOCK_SIZE * LAYER_TOKEN_BYTES
    args = ["--max-num-batched-tokens", str(budget)]
    plan = _predicted(model_dir, kv_budget, prompt_len + output_len, capsys, args)
    predicted = plan["concurrency"][0]["paged"]
    config = EngineConfig(
        model=str(model_dir),
        kv_cache_memory=kv_budget,
        block_size=BLOCK_SIZE,
        max_model_len=budget,
        max_num_batched_tokens=budget,
        enable_chunked_prefill=False,
        max_num_seqs=64,
        dtype="float32",
    )
    engine = LLMEngine.from_config(config)
    assert plan["geometry"]["num_blocks"] == engine.runner.num_blocks == 620
    assert engine.runner.spec.bytes_per_token == LAYER_TOKEN_BYTES
    assert f"{LAYER_TOKEN_BYTES:,} bytes per token = the formula" in engine.startup_report
    assert "6 KV cache groups" in engine.startup_report
    peak = _run(engine, prompt_len, output_len, predicted + 2)
    assert predicted == 8
    assert predicted - 1 <= peak <= predicted
