"""The engine's start-up report and `pagedllm plan` end to end (in-process)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pagedllm.cli import main
from pagedllm.planner.presets import GIB
from pagedllm.planner.report import startup_figures, startup_report

SMOL = {
    "num_hidden_layers": 30,
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "intermediate_size": 1536,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
}


def test_startup_report_figures_by_hand():
    # 512 blocks x 16 = 8,192 tokens; 23,040 bytes/token (30 x 3 x 64 x 2 x 2).
    f = startup_figures(SMOL, 2, 16, 512, 2048, typical_len=500)
    assert f.kv_bytes_per_token == 23_040
    assert f.num_tokens == 8192
    assert f.cache_bytes == 512 * 16 * 23_040
    assert f.concurrency_at_max_len == 4  # 512 // 128 blocks
    assert f.concurrency_at_typical_len == 16  # 512 // ceil(500 / 16) = 512 // 32
    text = startup_report(SMOL, 2, 16, 512, 2048, typical_len=500)
    assert "23,040 bytes per token" in text
    assert "512 blocks x 16 tokens = 8,192 tokens" in text
    assert "4 at max_model_len 2,048 tokens, 16 at 500 tokens" in text
    assert "(180MiB)" in text  # 512 x 16 x 23,040 bytes
    same = startup_report(SMOL, 2, 16, 512, 1024)  # typical length defaults to 1,024
    assert (
        "Maximum concurrency (whole blocks per sequence): 8 at max_model_len 1,024 tokens\n" in same
    )


def test_startup_report_names_the_knob():
    too_small = startup_report(SMOL, 2, 16, 100, 8192)
    assert "too small for one 8,192-token sequence" in too_small
    # One 8,192-token sequence: 512 blocks x 16 x 23,040 bytes = 180 MiB; four: 720 MiB.
    assert "--kv-cache-memory at least 180MiB (720MiB for 4)" in too_small
    assert "lower --max-model-len to 1,600" in too_small
    assert "16-bit --dtype" not in too_small  # already 16-bit
    assert "16-bit --dtype" in startup_report(SMOL, 4, 16, 100, 8192)
    # 100,000 blocks of 16 tokens hold 1,562 typical (1,024-token) sequences; 8 run at once,
    # and 8 x 64 blocks x 368,640 bytes = 180 MiB would hold them.
    too_large = startup_report(SMOL, 2, 16, 100_000, 2048, max_num_seqs=8)
    assert "the surplus only serves as prefix cache; --kv-cache-memory 180MiB" in too_large
    crowding = startup_report(SMOL, 2, 16, 10_000, 2048, memory_bytes=4 * GIB)
    assert "lower --kv-cache-memory or --memory-fraction" in crowding
    few = startup_report(SMOL, 2, 16, 130, 2048)
    assert "too few to batch" in few
    assert "sized sensibly" in startup_report(SMOL, 2, 16, 2000, 2048)


def _plan_json(capsys, *args: str) -> dict:
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_json_for_a_preset(capsys):
    plan = _plan_json(
        capsys,
        "--model",
        "Llama-3.1-8B",
        "--memory",
        "80",
        "--context-len",
        "32768",
        "--reserve",
        "1",
    )
    assert plan["kv_bytes_per_token"] == 131_072
    budget = plan["budget"]
    assert budget["kv_budget_bytes"] == int(80 * GIB * 0.9) - budget["weight_bytes"] - GIB
    blocks = budget["kv_budget_bytes"] // (131_072 * 16)
    assert plan["geometry"]["num_blocks"] == blocks
    (row,) = plan["concurrency"]
    assert row["paged"] == blocks // 2048
    assert row["contiguous_max"] == blocks * 16 // 131_072
    assert plan["verdicts"][0].startswith(f"Llama-3.1-8B fits {row['paged']} concurrent 32k-token")


def test_plan_text_shows_formula_verdict_and_reasons(capsys):
    assert (
        main(
            [
                "plan",
                "--model",
                "DeepSeek-V3",
                "--memory",
                "H200-141GB",
                "--tp",
                "8",
                "--dist",
                "sharegpt",
                "--num-requests",
                "200",
                "--shared-prefix",
                "500",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "61 layers x (512 latent rank + 64 RoPE dims) x 2 bytes = 70,272 bytes/token" in out
    assert "verdict: DeepSeek-V3 fits" in out
    assert "recommended --block-size" in out
    assert "memory fraction for 16 concurrent sessions" in out


def test_plan_reads_a_config_and_a_trace(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(SMOL))
    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        "\n".join(
            json.dumps({"prompt_tokens": 300, "output_tokens": 100, "prefix_id": "a"})
            for _ in range(10)
        )
        + "\n"
    )
    plan = _plan_json(
        capsys,
        "--model",
        str(tmp_path),
        "--kv-cache-memory",
        "1",
        "--trace",
        str(trace),
        "--shared-prefix",
        "256",
    )
    blocks = GIB // (23_040 * 16)
    (row,) = plan["concurrency"]
    assert row["paged"] == blocks // 25  # 400 tokens -> 25 blocks
    assert row["paged_shared"] == (blocks - 16) // 9  # 256 shared tokens = 16 full blocks


def test_bad_input_is_reported_not_raised(capsys):
    assert main(["plan", "--model", "no-such-model"]) == 2
    assert "--model" in capsys.readouterr().out
    assert main(["plan", "--memory", "lots"]) == 2
    assert main(["plan", "--model", "Llama-3.1-8B", "--context-len", "999999"]) == 2
    with pytest.raises(SystemExit):  # argparse: "not a size"
        main(["plan", "--kv-cache-memory", "lots"])


def test_plot_writes_a_png(tmp_path, capsys):
    path = tmp_path / "plan.png"
    assert (
        main(
            [
                "plan",
                "--model",
                "Qwen2.5-7B",
                "--memory",
                "L4-24GB",
                "--shared-prefix",
                "1000",
                "--plot",
                str(path),
            ]
        )
        == 0
    )
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()


def test_planner_imports_no_torch():
    code = (
        "import sys, pagedllm.planner.cli, pagedllm.planner.capacity, pagedllm.planner.report, "
        "pagedllm.planner.simulate, pagedllm.planner.cache_report, pagedllm.planner.cachelog; "
        "bad = [m for m in ('torch', 'numpy', 'transformers') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("memory", ["H100-80GB", "A100-40GB", "this machine"])
def test_every_device_preset_plans(memory, capsys):
    assert main(["plan", "--model", "Mistral-7B", "--memory", memory, "--context-len", "4096"]) == 0
    assert "verdict:" in capsys.readouterr().out


def test_plan_counts_an_unquantized_first_block(capsys):
    """int4 keeps each sequence's first block in the model's dtype by default: the plan
    names its bytes (Llama-3.1-8B in bf16: 131,072 B/token x 16); int8 does not, unless
    asked; the flag turns int4's off."""
    common = ("--model", "Llama-3.1-8B", "--memory", "80", "--reserve", "1")
    plan = _plan_json(capsys, *common, "--kv-dtype", "int4")
    assert plan["first_block_bytes"] == 131_072 * 16
    assert _plan_json(capsys, *common, "--kv-dtype", "int8")["first_block_bytes"] is None
    asked = _plan_json(capsys, *common, "--kv-dtype", "int8", "--kv-cache-unquantized-first-block")
    assert asked["first_block_bytes"] == 131_072 * 16
    off = ("--kv-dtype", "int4", "--no-kv-cache-unquantized-first-block")
    assert _plan_json(capsys, *common, *off)["first_block_bytes"] is None
    assert main(["plan", *common, "--kv-dtype", "int4"]) == 0
    assert "+ 2,097,152 bytes a sequence: its first block unquantized" in capsys.readouterr().out


def test_startup_report_counts_unquantized_first_blocks():
    report = startup_report(
        SMOL, 0.5, 16, 1000, 2048, max_num_seqs=4, kv_cache_dtype="int4",
        staging_block_bytes=368_640, unquantized_first_block=True,
    )  # fmt: skip
    assert "first block (tokens 0-15) stays in the model's dtype" in report
    assert "up to 2 x 4 x 368,640 bytes = 3MiB" in report
    plain = startup_report(
        SMOL, 0.5, 16, 1000, 2048, max_num_seqs=4, kv_cache_dtype="int4",
        staging_block_bytes=368_640,
    )  # fmt: skip
    assert "first block" not in plain
