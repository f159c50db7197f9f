"""The families beyond plain Llama — sliding windows (Mistral, Qwen2, Gemma 2/3), Gemma's
norms, scale and soft-capping, mixtures of experts (Mixtral, Qwen3-MoE) — token for token
against transformers through every paging path: block sizes 1 and 16, prefix hits,
chunked prefill, copy-on-write forks (n > 1), swaps, and the engine with recompute
preemption. Windows are 4-5 tokens and prompts up to 28, so every path crosses them."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from pagedllm.core.outputs import SchedulerOutput
from pagedllm.engine.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams

from .parity_helpers import (
    MLA,
    PROMPTS,
    WINDOWED,
    HandDriver,
    HFReference,
    assert_close,
    greedy_batch,
    make_runner,
)

FAMILIES = (*WINDOWED, "mixtral", "qwen3_moe", *MLA)
LONG = PROMPTS[2] + PROMPTS[1]  # 28 tokens


@pytest.fixture(scope="module")
def references(checkpoints) -> Callable[[str], HFReference]:
    cache: dict[str, HFReference] = {}

    def get(variant: str) -> HFReference:
        if variant not in cache:
            cache[variant] = HFReference(checkpoints(variant))
        return cache[variant]

    return get


@pytest.mark.parametrize("variant", FAMILIES)
def test_block_size_one(checkpoints, references, variant: str) -> None:
    runner = make_runner(checkpoints(variant), block_size=1)
    greedy_batch(runner, references(variant), PROMPTS, 4)


@pytest.mark.parametrize("variant", FAMILIES)
def test_prefix_hit_then_chunks_beside_a_decode(checkpoints, references, variant: str) -> None:
    """A second sequence reuses the first's full prefix blocks, then prefills the rest in
    chunks (3, 5, rest), each step beside a decode of a third sequence."""
    block_size = 4
    runner = make_runner(checkpoints(variant), block_size)
    hf = references(variant)
    driver = HandDriver(runner)
    first = driver.add("a", LONG[:14])
    driver.step([driver.schedule(first, 14)])
    shared = 12 // block_size
    second = driver.add("b", LONG[:12] + [200, 201, 202, 203, 204, 205, 206, 207, 208, 9, 10])
    driver.set_tables(second, [t[:shared] for t in driver.tables(first)])
    second.num_computed = shared * block_size
    other = driver.add("o", PROMPTS[1])
    rows = driver.step([driver.schedule(other, len(PROMPTS[1]))])
    remaining = len(second.token_ids) - second.num_computed
    for size in (3, 5, remaining - 8):
        last = second.num_computed + size == len(second.token_ids)
        driver.append("o", int(rows["o"].argmax()))
        rows = driver.step(
            [driver.schedule(second, size, 1 if last else 0), driver.schedule(other, 1)]
        )
        assert_close(rows["o"], hf.logits(other.token_ids)[-1], "decode beside a chunk")
    assert_close(rows["b"], hf.logits(second.token_ids)[-1], "after prefix hit and chunks")


@pytest.mark.parametrize("variant", FAMILIES)
def test_fork_and_swap(checkpoints, references, variant: str) -> None:
    """Two samples share a partial block (copy on write), then one is swapped out and in."""
    runner = make_runner(checkpoints(variant), block_size=4, num_blocks=64, num_host_blocks=16)
    hf = references(variant)
    driver = HandDriver(runner)
    parent = driver.add("p", LONG[:23])
    rows = driver.step([driver.schedule(parent, 23)])
    first, second = rows["p"].topk(2).indices.tolist()
    child = driver.add("c", list(parent.token_ids))
    parent_tables = driver.tables(parent)
    driver.set_tables(child, [t[:-1] + [driver.free.pop()] for t in parent_tables])
    child.num_computed = parent.num_computed
    copies = tuple((p[-1], c[-1]) for p, c in zip(parent_tables, driver.tables(child)))
    driver.append("p", first)
    driver.append("c", second)
    rows = driver.step([driver.schedule(parent, 1), driver.schedule(child, 1)], block_copies=copies)
    assert_close(rows["p"], hf.logits(parent.token_ids)[-1], "parent after fork")
    assert_close(rows["c"], hf.logits(child.token_ids)[-1], "child after copy")
    driver.append("c", int(rows["c"].argmax()))
    old = [b for table in driver.tables(child) for b in table]
    host = list(range(len(old)))
    runner.apply_block_moves(SchedulerOutput(swap_out=tuple(zip(old, host, strict=True))))
    for k_cache, v_cache in runner.kv_caches:
        k_cache[torch.tensor(old)] = 0.0
        v_cache[torch.tensor(old)] = 0.0
    driver.set_tables(child, [[driver.free.pop() for _ in t] for t in driver.tables(child)])
    new = [b for table in driver.tables(child) for b in table]
    swap_in = tuple(zip(host, new, strict=True))
    rows = driver.step([driver.schedule(child, 1)], swap_in=swap_in)
    assert_close(rows["c"], hf.logits(child.token_ids)[-1], "after swap in")


@pytest.mark.parametrize("variant", FAMILIES)
def test_engine_greedy_equals_transformers(checkpoints, references, variant: str) -> None:
    """Through the scheduler: prefix caching, 5-token chunks, a pool small enough to
    preempt (recompute), n=2; every completion equals transformers' greedy tokens. Where
    every layer slides (Mistral here) the manager releases blocks out of the window, so the
    pool is smaller still."""
    torch.set_num_threads(1)
    config = EngineConfig(
        model=str(checkpoints(variant)),
        dtype="float32",
        block_size=4,
        num_blocks=6 if variant == "mistral_window" else 14,
        max_model_len=48,
        max_num_batched_tokens=5,
        preemption_mode="recompute",
    )
    engine = LLMEngine.from_config(config)
    prompts = [LONG[:19] + [3, 4], LONG[:19] + [5], PROMPTS[1], LONG]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, n=2)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output
        engine.kv.check_invariants()
    hf = references(variant)
    for i, prompt in enumerate(prompts):
        expected = tuple(hf.greedy(prompt, 8))
        assert [c.token_ids for c in done[str(i)].outputs] == [expected, expected]
    stats = engine.get_stats()
    assert stats.num_preemptions > 0
    # Every windowed model releases blocks: Mistral's one table, or the sliding groups'
    # tables of the models mixing local and global layers (their full group keeps all).
    assert (stats.cache.window_freed_blocks > 0) == (variant in WINDOWED)
    groups = stats.cache.groups
    assert len(groups) == (2 if variant in ("qwen2_window", "gemma2", "gemma3") else 0)
    assert [g.window_freed_blocks > 0 for g in groups] == [
        g.sliding_window is not None for g in groups
    ]
    assert stats.cache.prefix_hits_tokens > 0
    # Nothing held but the window placeholder (a manager with a window holds one).
    assert engine.kv.stats().blocks_used == (engine.kv.null_block is not None)


def test_long_generation_holds_a_window_of_blocks(tmp_path) -> None:
    """A window-16 Mistral generating 300 tokens: after every step each sequence's table
    holds at most ceil(16 / 4) + 1 real blocks (the rest point at the placeholder)."""
    from .parity_helpers import build_checkpoint

    torch.set_num_threads(1)
    path = build_checkpoint(tmp_path / "w16", "mistral", sliding_window=16)
    # Chunks of up to 8 tokens: a chunk sees at most 15 + 8 positions (6 + 1 blocks), so
    # even a recomputed 316-token sequence fits in 23 usable blocks.
    config = EngineConfig(
        model=str(path), dtype="float32", block_size=4, num_blocks=24, max_num_batched_tokens=8
    )
    engine = LLMEngine.from_config(config)
    assert engine.max_model_len == 1024  # the model's limit: the window bounds the blocks
    params = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)
    engine.add_request("long", PROMPTS[2], params)
    engine.add_request("short", PROMPTS[1], SamplingParams(max_tokens=40, ignore_eos=True))
    most = 0
    while engine.has_unfinished_requests():
        engine.step()
        for table in engine.kv.live_block_tables().values():
            most = max(most, sum(b != engine.kv.null_block for b in table))
        engine.kv.check_invariants()
    assert most == 16 // 4 + 1
    assert engine.get_stats().cache.window_freed_blocks >= 300 // 4 - 5


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("variant", MLA)
def test_latent_attention_on_each_backend(checkpoints, references, variant, backend) -> None:
    """The latent cache through the reference (the ground truth) and through the CPU
    backend's C++ kernel (multi-query over the latent rows)."""
    from pagedllm.attention.select import get_backend
    from pagedllm.model import load_model
    from pagedllm.worker.model_runner import TorchModelRunner

    attention = get_backend(backend)
    if backend == "cpu" and not attention.uses_extension:
        pytest.skip("the C++ attention kernel did not build here")
    loaded = load_model(checkpoints(variant), "float32", attention, load_tokenizer=False)
    runner = TorchModelRunner(loaded.model, block_size=4, num_blocks=64)
    assert runner.kv_caches[0][0] is runner.kv_caches[0][1]  # one latent tensor a layer
    assert runner.kv_caches[0][0].shape[2:] == (1, 32 + 8)
    greedy_batch(runner, references(variant), PROMPTS, 4)


def test_latent_cache_bytes_match_the_planner_and_hold_more_tokens(checkpoints) -> None:
    """An MLA checkpoint's cache takes layers x (kv_lora_rank + rope) elements a token, as
    the planner's formula says (and the start-up report checks), so a budget holds
    (2 x heads x head_dim) / (kv_lora_rank + rope) times the tokens of per-head K/V."""
    from pagedllm.planner.capacity import kv_bytes_per_token
    from pagedllm.worker.kv_cache import KVCacheSpec, num_blocks_from_budget

    budget = 4 << 20
    config = EngineConfig(
        model=str(checkpoints("deepseek_v3")), dtype="float32", block_size=4, kv_cache_memory=budget
    )
    engine = LLMEngine.from_config(config)
    mla, layers = engine.model_config.mla, engine.model_config.num_hidden_layers
    spec = engine.runner.spec
    assert spec.bytes_per_token == layers * (32 + 8) * 4
    planner = kv_bytes_per_token(
        {
            "num_hidden_layers": layers,
            "num_attention_heads": 4,
            "hidden_size": 64,
            "vocab_size": 320,
            "kv_lora_rank": mla.kv_lora_rank,
            "qk_rope_head_dim": mla.qk_rope_head_dim,
        },
        4,
    )
    assert spec.bytes_per_token == planner
    assert "= the formula" in engine.startup_report
    # The same model caching per-head K and V (head_dim: the key's nope + rope width).
    heads, head_dim = 4, mla.qk_head_dim
    mha = KVCacheSpec(layers, heads, head_dim, 4, torch.float32)
    mha_blocks = num_blocks_from_budget(mha, kv_cache_memory=budget)
    expected = (2 * heads * head_dim) / mla.latent_dim
    assert engine.runner.num_blocks / mha_blocks == pytest.approx(expected, rel=0.01)
