"""Capacity arithmetic against figures computed by hand from each model's config.json."""

from __future__ import annotations

import json

import pytest

from pagedllm.planner.capacity import (
    Workload,
    cache_geometry,
    concurrency_at_length,
    fixed_workload,
    kv_budget,
    kv_bytes_per_token,
    kv_formula,
    length_below_target,
    max_concurrency,
    param_count,
    recommend_block_size,
    recommend_memory_fraction,
    verdict,
    weight_bytes,
)
from pagedllm.planner.presets import (
    GIB,
    MIB,
    dtype_bytes,
    model_presets,
    parse_size,
    resolve_memory,
    resolve_model,
    spec_from_config,
)

PRESETS = model_presets()


@pytest.mark.parametrize(
    ("name", "kv_bytes", "tp", "expected"),
    [
        # 32 layers x 8 KV heads x 128 head dim x 2 (K, V) x 2 bytes
        ("llama-3.1-8b", 2, 1, 131_072),
        ("llama-3.1-8b", 1, 1, 65_536),
        ("llama-3.1-8b", 2, 2, 65_536),  # 4 KV heads per rank
        ("llama-3.1-8b", 2, 16, 16_384),  # more ranks than KV heads: one replica each
        ("llama-3.1-70b", 2, 1, 327_680),  # 80 x 8 x 128 x 2 x 2
        ("qwen2.5-7b", 2, 1, 57_344),  # 28 x 4 x 128 x 2 x 2
        ("qwen2.5-72b", 2, 1, 327_680),
        ("mistral-7b", 2, 1, 131_072),
        ("smollm2-135m", 2, 1, 23_040),  # 30 x 3 x 64 x 2 x 2
        # MLA: 61 layers x (512 latent + 64 RoPE) x 2 bytes, no separate V
        ("deepseek-v3", 2, 1, 70_272),
        ("deepseek-v3", 2, 8, 70_272),  # the latent is replicated, not split
        ("deepseek-v3", 1, 1, 35_136),
        ("kimi-k2", 2, 1, 70_272),
    ],
)
def test_kv_bytes_per_token_matches_hand_computation(name, kv_bytes, tp, expected):
    assert kv_bytes_per_token(PRESETS[name], kv_bytes, tp) == expected


def test_formula_shows_the_factors():
    assert kv_formula(PRESETS["llama-3.1-8b"], 2) == (
        "GQA: 32 layers x 8 KV heads x 128 head dim x 2 (K and V) x 2 bytes = 131,072 bytes/token"
    )
    mla = kv_formula(PRESETS["deepseek-v3"], 2)
    assert "61 layers x (512 latent rank + 64 RoPE dims) x 2 bytes = 70,272" in mla
    assert "no separate V" in mla


def test_mha_is_named_when_every_head_has_its_own_kv():
    config = {
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "vocab_size": 100,
    }
    spec = spec_from_config(config)
    assert spec.attention == "mha"
    assert kv_bytes_per_token(config, 4) == 2 * 4 * 16 * 2 * 4


def test_param_counts_match_published_totals():
    # Published totals: Llama-3.1-8B 8,030,261,248; SmolLM2-135M 134,515,008.
    assert param_count(PRESETS["llama-3.1-8b"]) == 8_030_261_248
    assert param_count(PRESETS["smollm2-135m"]) == 134_515_008
    # DeepSeek-V3: 671B without the multi-token-prediction module.
    assert 670e9 < param_count(PRESETS["deepseek-v3"]) < 672e9
    assert 1.0e12 < param_count(PRESETS["kimi-k2"]) < 1.05e12
    assert 70e9 < param_count(PRESETS["llama-3.1-70b"]) < 71e9
    assert weight_bytes(PRESETS["llama-3.1-8b"], 2, tp=2) == 8_030_261_248


def test_config_json_on_disk_reads_like_the_preset(tmp_path):
    config = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "max_position_embeddings": 131072,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "torch_dtype": "bfloat16",
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = resolve_model(str(tmp_path))
    assert kv_bytes_per_token(spec, 2) == 131_072
    assert param_count(spec) == param_count(PRESETS["llama-3.1-8b"])
    assert resolve_model("default").name == "SmolLM2-135M"
    with pytest.raises(ValueError, match="--model"):
        resolve_model("no-such-model")


def test_memory_inputs():
    assert resolve_memory("80").memory_bytes == 80 * GIB
    assert resolve_memory("24GiB").memory_bytes == 24 * GIB
    assert resolve_memory("512MiB").memory_bytes == 512 * MIB
    assert resolve_memory("2GB").memory_bytes == 2 * 10**9
    assert parse_size("1.5G") == 3 * GIB // 2
    assert resolve_memory("H100-80GB").memory_bytes == 81559 * MIB
    assert resolve_memory("this machine").memory_bytes > 0
    with pytest.raises(ValueError, match="--memory"):
        resolve_memory("lots")
    assert dtype_bytes("bf16") == 2 and dtype_bytes("fp8") == 1
    with pytest.raises(ValueError):
        dtype_bytes("float13")


def test_budget_and_geometry():
    budget = kv_budget(80 * GIB, 0.9, 16 * GIB, 1 * GIB)
    assert budget.kv_budget_bytes == int(80 * GIB * 0.9) - 17 * GIB
    assert kv_budget(10 * GIB, 0.9, 16 * GIB, 0).kv_budget_bytes == 0
    geometry = cache_geometry(10 * GIB, 131_072, 16)  # 2 MiB blocks
    assert geometry.num_blocks == 5120
    assert geometry.num_tokens == 81_920
    with pytest.raises(ValueError, match="memory_fraction"):
        kv_budget(GIB, 1.5, 0, 0)


def test_concurrency_per_scheme_by_hand():
    geometry = cache_geometry(10 * GIB, 131_072, 16)  # 5120 blocks, 81,920 tokens
    conc = concurrency_at_length(geometry, 1000, 131_072, shared_prefix=500)
    assert conc.contiguous_max == 0  # 81,920 < one 131,072-token reservation
    assert conc.contiguous_exact == 81  # 81,920 // 1000
    assert conc.paged == 81  # 5120 // ceil(1000 / 16) = 5120 // 63
    # 500 prompt tokens -> 31 full shared blocks held once; 32 own blocks each.
    assert conc.paged_shared == (5120 - 31) // 32
    conc = concurrency_at_length(geometry, 32_768, 32_768)
    assert (conc.contiguous_max, conc.contiguous_exact, conc.paged) == (2, 2, 2)


def test_mixed_lengths_use_the_mean_footprint():
    geometry = cache_geometry(100 * 16 * 1000, 1000, 16)  # 100 blocks of 16 tokens
    workload = Workload("mix", (10, 20, 30, 40))  # 1, 2, 2, 3 blocks -> mean 2
    conc = max_concurrency(geometry, workload, 64)
    assert conc.paged == 50
    assert conc.contiguous_exact == 1600 // 25
    assert conc.contiguous_max == 1600 // 64
    with pytest.raises(ValueError, match="max_model_len"):
        max_concurrency(geometry, workload, 32)


def test_two_prefix_groups_each_hold_one_copy():
    geometry = cache_geometry(100 * 16, 1, 16)  # 100 blocks
    workload = Workload("groups", (64, 64, 64, 64), (32, 32, 48, 48), ("a", "a", "b", "b"))
    # shared blocks: a -> 2, b -> 3; own blocks: 2, 2, 1, 1 (mean 1.5)
    assert max_concurrency(geometry, workload, 64).paged_shared == int((100 - 5) / 1.5)


def test_length_at_which_concurrency_drops_below_target():
    geometry = cache_geometry(10 * GIB, 131_072, 16)  # 5120 blocks
    # paged: 10 sequences of at most 512 blocks = 8192 tokens
    assert length_below_target(geometry, 10, 131_072, "paged") == 8193
    assert length_below_target(geometry, 10, 131_072, "contiguous_exact") == 8193
    # a 1024-token shared prompt: 64 blocks once, (5120 - 64) // 10 = 505 own blocks each
    assert length_below_target(geometry, 10, 131_072, "paged_shared", 1024) == (505 + 64) * 16 + 1
    assert length_below_target(geometry, 10, 4096, "paged") is None  # never within 4096
    assert length_below_target(geometry, 10, 131_072, "contiguous_max") == 1


def test_block_size_follows_the_lengths():
    # 100-token sequences: waste 4 at 8, 12 at 16, 28 at 32..128 -> 8 wins clearly.
    advice = recommend_block_size(10**8, 1000, fixed_workload(100), 1024)
    assert advice.block_size == 8
    row16 = next(row for row in advice.rows if row.block_size == 16)
    assert row16.internal_waste_tokens == 12
    # 4096-token sequences waste nothing at any size: the largest block wins.
    advice = recommend_block_size(10**9, 1000, fixed_workload(4096), 8192)
    assert advice.block_size == 256
    assert "256" in advice.reasoning
    # A 1000-token shared prompt: 1000 % 256 = 232 tokens unshared per sequence at 256.
    advice = recommend_block_size(10**8, 1000, fixed_workload(4096, 1000), 8192, tolerance=0.02)
    row256 = next(row for row in advice.rows if row.block_size == 256)
    assert row256.prefix_unshared_tokens == 232
    # 100,000 tokens. At 8: 12,500 blocks, 125 shared, 387 own -> 31. At 64: 1,562 blocks,
    # 15 shared, 49 own -> 31. At 128: 781 blocks, 7 shared, 25 own -> 30. Largest of the 31s.
    concurrency = {row.block_size: row.concurrency for row in advice.rows}
    assert (concurrency[8], concurrency[64], concurrency[128]) == (31, 31, 30)
    assert advice.block_size == 64
    # The default tolerance (5%) gives up 1 of 31 sessions for 128 (256 drops to 29).
    assert recommend_block_size(10**8, 1000, fixed_workload(4096, 1000), 8192).block_size == 128
    with pytest.raises(ValueError, match="tolerance"):
        recommend_block_size(10**8, 1000, fixed_workload(100), 1024, tolerance=1.5)


def test_memory_fraction_recommendation():
    spec = PRESETS["llama-3.1-8b"]
    weights = weight_bytes(spec, 2)
    advice = recommend_memory_fraction(
        80 * GIB, weights, GIB, 131_072, 16, fixed_workload(8192), target=20
    )
    needed = weights + GIB + 20 * 512 * 2 * MIB
    assert advice.memory_fraction == pytest.approx(-(-needed * 100 // (80 * GIB)) / 100)
    assert advice.needed_kv_bytes == 20 * GIB
    too_many = recommend_memory_fraction(
        80 * GIB, weights, GIB, 131_072, 16, fixed_workload(131_072), target=20
    )
    assert too_many.memory_fraction is None
    assert "does not fit" in too_many.reasoning


def test_verdict_lines():
    spec = PRESETS["llama-3.1-8b"]
    kvpt = kv_bytes_per_token(spec, 2)
    budget = kv_budget(80 * GIB, 0.9, weight_bytes(spec, 2), GIB)
    geometry = cache_geometry(budget.kv_budget_bytes, kvpt, 16)
    workload = fixed_workload(32_768)
    conc = max_concurrency(geometry, workload, 131_072)
    line = verdict(spec.name, budget, workload, conc, kvpt)
    assert line.startswith(f"Llama-3.1-8B fits {conc.paged} concurrent 32k-token sessions")
    assert "the cache is the limit" in line
    small = kv_budget(16 * GIB, 0.9, weight_bytes(spec, 2), GIB)
    assert "does not fit" in verdict(spec.name, small, workload, conc, kvpt)
