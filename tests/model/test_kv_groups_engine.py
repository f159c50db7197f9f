"""Models mixing local and global layers (Gemma 2/3, Qwen2 with max_window_layers) through
the engine with one block table per KV cache group: greedy tokens equal to transformers'
at block size 16 with prefix hits, 16-token chunks, preemption (a swap request falls back
to recompute) and n=2, and in multi-step decoding; a long generation holds at most
ceil(W / block) + 1 blocks in each sliding group's table while the full group keeps every
block; the reports carry the groups."""

from __future__ import annotations

import pytest
import torch

from pagedllm.engine.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.messages import Codec
from pagedllm.engine.reports import EngineStats, blocks_report, cache_report
from pagedllm.sampling_params import SamplingParams

from .parity_helpers import PROMPTS, HFReference, build_checkpoint

MIXED = ("qwen2_window", "gemma2", "gemma3")
LONG = PROMPTS[2] + PROMPTS[1] + PROMPTS[0]  # 31 tokens


def run(engine: LLMEngine) -> dict[str, list[tuple[int, ...]]]:
    done = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = [c.token_ids for c in output.outputs]
        engine.kv.check_invariants()
    return done


@pytest.mark.parametrize("variant", MIXED)
def test_block_size_16_with_hits_chunks_preemption_and_n2(checkpoints, variant: str) -> None:
    torch.set_num_threads(1)
    config = EngineConfig(
        model=str(checkpoints(variant)),
        dtype="float32",
        block_size=16,
        num_blocks=7,
        max_model_len=64,
        max_num_batched_tokens=16,
        preemption_mode="swap",
        num_host_blocks=8,
    )
    engine = LLMEngine.from_config(config)
    assert len(engine.kv.groups) == 2
    prompts = [LONG + [3, 4], LONG + [5], PROMPTS[1], LONG]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, n=2)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    done = run(engine)
    hf = HFReference(checkpoints(variant))
    for i, prompt in enumerate(prompts):
        expected = tuple(hf.greedy(prompt, 10))
        assert done[str(i)] == [expected, expected], f"request {i}"
    stats = engine.get_stats()
    assert stats.num_preemptions > 0 and stats.num_preemptions_swap == 0
    assert stats.cache.prefix_hits_tokens > 0
    assert engine.kv.stats().blocks_used == 1  # the placeholder


def test_multi_step_decoding_per_group(checkpoints) -> None:
    torch.set_num_threads(1)
    config = EngineConfig(
        model=str(checkpoints("gemma3")),
        dtype="float32",
        block_size=4,
        num_blocks=64,
        max_model_len=64,
        num_scheduler_steps=4,
    )
    engine = LLMEngine.from_config(config)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for i, prompt in enumerate((PROMPTS[1], PROMPTS[2])):
        engine.add_request(str(i), prompt, params)
    done = run(engine)
    hf = HFReference(checkpoints("gemma3"))
    for i, prompt in enumerate((PROMPTS[1], PROMPTS[2])):
        assert done[str(i)] == [tuple(hf.greedy(prompt, 12))]


@pytest.mark.parametrize("variant", ["gemma3", "qwen2_window"])
def test_speculative_decoding_per_group(checkpoints, variant: str) -> None:
    """Drafts over one block table per group: slots taken and rolled back in every group,
    sliding groups releasing what their window passed; greedy tokens as transformers'."""
    from tests.engine.test_spec_decode_engine import ScriptedProposer

    torch.set_num_threads(1)
    config = EngineConfig(
        model=str(checkpoints(variant)),
        dtype="float32",
        block_size=4,
        num_blocks=64,
        max_model_len=64,
        speculative_config={"num_speculative_tokens": 5, "automatic": False},
    )
    engine = LLMEngine.from_config(config)
    hf = HFReference(checkpoints(variant))
    prompts = (LONG, PROMPTS[1])
    expected = {str(i): tuple(hf.greedy(prompt, 20)) for i, prompt in enumerate(prompts)}
    engine.speculator.proposer = ScriptedProposer(expected, engine.runner.vocab_size)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    assert run(engine) == {rid: [tokens] for rid, tokens in expected.items()}
    assert engine.get_stats().speculative.num_accepted_tokens > 0
    assert engine.kv.stats().blocks_used == 1  # the placeholder


def test_long_generation_holds_a_window_per_sliding_group(tmp_path) -> None:
    """Gemma 3's pattern (two local layers, one global; window 16, block 4) generating 200
    tokens: after every step each sliding group's table holds at most 16 / 4 + 1 real
    blocks while the full group's holds every one; the reports say so per group."""
    torch.set_num_threads(1)
    layers = ["sliding_attention", "sliding_attention", "full_attention"]
    path = build_checkpoint(
        tmp_path / "g3", "gemma3_text", sliding_window=16, num_hidden_layers=3, layer_types=layers
    )
    config = EngineConfig(
        model=str(path), dtype="float32", block_size=4, num_blocks=80, max_num_batched_tokens=8
    )
    engine = LLMEngine.from_config(config)
    assert engine.kv.windows == (None, 16, 16)
    prompt = PROMPTS[2]
    engine.add_request("long", prompt, SamplingParams(max_tokens=200, ignore_eos=True))
    most = [0, 0, 0]
    report = None
    while engine.has_unfinished_requests():
        engine.step()
        for group, tables in enumerate(engine.kv.live_group_block_tables()):
            for table in tables.values():
                real = sum(b != engine.kv.null_block for b in table)
                most[group] = max(most[group], real)
        engine.kv.check_invariants()
        if report is None and engine.has_unfinished_requests():
            report = blocks_report(engine)
    total = len(prompt) + 200 - 1  # the last sampled token is never written
    assert most == [-(-total // 4), 16 // 4 + 1, 16 // 4 + 1]
    row = report["requests"][0]
    assert len(row["group_block_tables"]) == 2
    stats = engine.get_stats()
    codec = Codec()
    wired = codec.decode_value(codec.encode_value(stats), EngineStats)
    assert wired.cache == stats.cache and wired.group_waste == stats.group_waste
    groups = cache_report(stats)["kv_cache_groups"]
    assert [g["sliding_window"] for g in groups] == [None, 16, 16]
    assert groups[0]["freed_blocks"] == 0
    assert groups[1]["freed_blocks"] == groups[2]["freed_blocks"] >= total // 4 - 5


def test_waste_is_reported_per_group(checkpoints) -> None:
    """Mid-run, each group's internal waste is its own tables' partly filled blocks, and
    the engine's figure is their sum."""
    torch.set_num_threads(1)
    config = EngineConfig(
        model=str(checkpoints("gemma3")), dtype="float32", block_size=4, num_blocks=64
    )
    engine = LLMEngine.from_config(config)
    engine.add_request("a", PROMPTS[2], SamplingParams(max_tokens=5, ignore_eos=True))
    engine.step()  # the prompt: 17 tokens computed
    stats = engine.get_stats()
    internal = [w.internal_tokens for w in stats.group_waste]
    # Full group: 5 blocks for 17 tokens; window 4 (the next query, 17, sees 14..17): its
    # blocks 3..4 hold 12..16, 3 slots free in each group.
    assert internal == [3, 3]
    assert stats.waste.internal_tokens == sum(internal)
    entries = cache_report(stats)["kv_cache_groups"]
    assert [e["waste"]["internal"]["tokens"] for e in entries] == [3, 3]
