"""The cost of holding context (planner/holding.py) and `pagedllm plan` when nothing fits."""

from __future__ import annotations

import json
import math

import pytest

from pagedllm.cli import main
from pagedllm.planner.capacity import fixed_workload, recommend_block_size
from pagedllm.planner.holding import GIB, HoldingPrices, holding_cost


def test_holding_cost_by_hand():
    # 1 GiB (8,192 tokens x 131,072 bytes) on an 80 GiB device at 3.60 an hour:
    # 0.045 per GiB-hour = 0.0000125 per GiB-second; the device costs 0.001 a second.
    prices = HoldingPrices(
        device_hour=3.6,
        device_memory_bytes=80 * GIB,
        prefill_tokens_per_s=8192,  # recompute: 1 s of device time = 0.001
        tier_gib_hour=0.009,  # 0.0000025 per GiB-second
        tier_gib_per_s=20.0,  # load back: 0.05 s = 0.00005
    )
    cost = holding_cost(131_072, 8192, 60.0, prices)
    assert cost.bytes == GIB
    assert cost.resident == pytest.approx(60 * 0.0000125)
    assert cost.tier == pytest.approx(60 * 0.0000025 + 0.00005)
    assert cost.recompute == pytest.approx(0.001) and cost.recompute_s == pytest.approx(1.0)
    # resident vs tier: 0.00005 / (0.0000125 - 0.0000025) = 5 s;
    # tier vs recompute: (0.001 - 0.00005) / 0.0000025 = 380 s.
    assert cost.resident_until_s == pytest.approx(5.0)
    assert cost.tier_until_s == pytest.approx(380.0)
    assert cost.cheapest == "tier"
    assert holding_cost(131_072, 8192, 1.0, prices).cheapest == "resident"
    assert holding_cost(131_072, 8192, 1000.0, prices).cheapest == "recompute"
    # Without a tier: resident until the recompute cost, 0.001 / 0.0000125 = 80 s.
    plain = HoldingPrices(device_hour=3.6, device_memory_bytes=80 * GIB, prefill_tokens_per_s=8192)
    alone = holding_cost(131_072, 8192, 60.0, plain)
    assert alone.resident_until_s == pytest.approx(80.0) and alone.tier_until_s is None
    # Without a prefill speed nothing bounds keeping it.
    assert (
        holding_cost(131_072, 8192, 60.0, HoldingPrices(3.6, 80 * GIB)).resident_until_s == math.inf
    )
    with pytest.raises(ValueError):
        HoldingPrices(device_hour=0, device_memory_bytes=GIB)


def test_a_tier_slower_to_load_than_recompute_never_wins():
    prices = HoldingPrices(
        3.6, 80 * GIB, prefill_tokens_per_s=1e9, tier_gib_hour=0.001, tier_gib_per_s=1
    )
    cost = holding_cost(131_072, 8192, 10.0, prices)
    assert cost.tier_until_s is None and cost.cheapest == "recompute"


def test_nothing_fits_recommends_no_block_size():
    advice = recommend_block_size(0, 1000, fixed_workload(4096), 8192)
    assert advice.block_size is None
    assert "not one sequence fits" in advice.reasoning
    assert all(row.concurrency == 0 for row in advice.rows)


def test_plan_kimi_k2_on_one_h200_says_nothing_fits(capsys):
    assert main(["plan", "--model", "Kimi-K2", "--memory", "H200-141GB"]) == 0
    text = capsys.readouterr().out
    assert "nothing fits at any block size" in text
    assert "no --block-size to recommend" in text
    assert "recommended --block-size" not in text
    assert main(["plan", "--model", "Kimi-K2", "--memory", "H200-141GB", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["block_size_advice"]["block_size"] is None


def test_plan_prints_the_holding_cost(capsys):
    argv = ["plan", "--model", "Llama-3.1-8B", "--memory", "H100-80GB", "--context-len", "8192"]
    more = [
        "--gpu-hour-price",
        "2.5",
        "--prefill-tokens-per-s",
        "10000",
        "--tier-gib-hour-price",
        "0.005",
    ]
    assert main([*argv, *more, "--json"]) == 0
    holding = json.loads(capsys.readouterr().out)["holding"]
    assert holding["num_tokens"] == 8192 and holding["bytes"] == GIB
    assert holding["cheapest"] == "tier"
    assert main([*argv, *more]) == 0
    text = capsys.readouterr().out
    assert "holding context: 8,192 tokens" in text and "break-even" in text
    assert main(argv) == 0
    assert "holding context" not in capsys.readouterr().out
