"""The core benchmarks run, end with one JSON line, and show what they must show."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building
    spec.loader.exec_module(module)
    return module


def last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_fragmentation_small_trace(capsys):
    args = [
        "--quick",
        "--num-requests",
        "60",
        "--max-model-len",
        "512",
        "--num-slots",
        "4096",
        "--shared-prefix-len",
        "64",
        "--shared-prefix-fraction",
        "1.0",
        "-n",
        "2",
    ]
    assert load("fragmentation").main(args) == 0
    result = last_json(capsys)
    assert list(result) == ["contiguous_max_len", "contiguous_exact", "paged", "paged_shared"]
    keys = {
        "mean_concurrency",
        "peak_concurrency",
        "internal_waste",
        "external_waste",
        "duplication_waste",
        "admission_failures",
    }
    assert all(keys <= set(r) for r in result.values())
    assert result["contiguous_max_len"]["peak_concurrency"] <= 4096 // 512
    assert (
        result["paged"]["mean_concurrency"] > 1.3 * result["contiguous_max_len"]["mean_concurrency"]
    )
    assert result["paged"]["external_waste"] == 0.0
    assert result["paged"]["internal_waste"] < result["contiguous_exact"]["internal_waste"]
    # Every request shares a 64-token system prompt and samples twice.
    assert result["paged"]["duplication_waste"] > 0.05
    assert result["paged_shared"]["duplication_waste"] < result["paged"]["duplication_waste"] / 2
    assert result["paged_shared"]["mean_concurrency"] > result["paged"]["mean_concurrency"]


def test_core_ops_quick(capsys):
    assert load("core_ops").main(["--quick", "--num-seqs", "16", "--steps", "20"]) == 0
    result = last_json(capsys)
    for key in ("decode_step_us", "allocate_slots_us", "free_us", "prefix_lookup_us"):
        assert result[key] > 0
    assert result["num_seqs"] == 16


@pytest.mark.parametrize("bad", [["--trace", "nope"]])
def test_fragmentation_rejects_bad_args(bad):
    with pytest.raises(SystemExit):
        load("fragmentation").main(bad)


def test_kv_quant_bucket_kl_is_exact_over_the_whole_vocabulary_and_a_lower_bound_below():
    """kv_quant's KL from prompt logprobs: with every token listed it is the KL; with the
    top few and one bucket for the rest it never exceeds it."""
    import math

    from pagedllm.core.outputs import TokenLogprob
    from pagedllm.engine.outputs import position_logprobs, top_logprobs

    bench = load("kv_quant")
    p = [0.5, 0.3, 0.15, 0.05]
    q = [0.4, 0.2, 0.3, 0.1]
    exact = sum(a * math.log(a / b) for a, b in zip(p, q, strict=True))

    def position(dist, k, token_id=3):
        """vLLM's dict of a position whose actual token is ``token_id`` (here the least
        likely: outside a top 2, an entry more that the KL must not count)."""
        order = sorted(range(len(dist)), key=lambda i: -dist[i])[:k]
        top = tuple(math.log(dist[i]) for i in order)
        return position_logprobs(
            TokenLogprob(token_id, math.log(dist[token_id]), 4, tuple(order), top), None
        )

    def top(dist, k):
        return top_logprobs(position(dist, k), 3, k)

    assert math.isclose(bench.bucket_kl(top(p, 4), top(q, 4)), exact, rel_tol=1e-9)
    assert len(top(p, 2)) == 2
    assert 0 <= bench.bucket_kl(top(p, 2), top(q, 2)) <= exact
    same = bench.compare([[1, 3]], [[None, position(p, 4)]], [[None, position(p, 4)]], 4)
    assert same.mean_kl == 0.0 and same.top1 == 1.0 and same.delta_ppl == 0.0


@pytest.mark.parametrize(
    "bad",
    [
        ["--variant", "noequals"],
        ["--variant", "a=--x", "--variant", "a=--y"],
        ["--variant", "a=", "--variant-src", "b=/tmp"],
        ["--no-vllm-server"],
    ],
)
def test_serve_vs_vllm_rejects_bad_variants(bad):
    with pytest.raises(SystemExit):
        load("serve_vs_vllm").parse_args(bad)


def test_serve_vs_vllm_variants_get_ports_flags_and_ratios(tmp_path, monkeypatch):
    """Each --variant is one more pagedllm server (its own port, flags and source tree), and
    the summary holds its ratios against vLLM and against the default pagedllm, round by round."""
    bench = load("serve_vs_vllm")
    args = bench.parse_args(["--port", "9000", "--variant", "cap=--max-num-batched-tokens 1024",
                             "--variant", "old=", "--variant-src", f"old={tmp_path}"])  # fmt: skip
    started = []
    monkeypatch.setattr(bench, "Server", lambda *a: started.append(a) or a)
    bench.start_variants(args, "m", tmp_path)
    (name1, cmd1, port1, _, _), (name2, cmd2, port2, _, env2) = started
    assert (name1, port1, cmd1[-2:]) == ("pagedllm:cap", 9002, ["--max-num-batched-tokens", "1024"])
    assert (name2, port2, cmd2[-1]) == ("pagedllm:old", 9003, "4096")
    assert env2["PYTHONPATH"].split(":")[0] == str(tmp_path)
    rounds = {
        "pagedllm": [{"output_throughput": 100.0}, {"output_throughput": 110.0}],
        "vllm": [{"output_throughput": 50.0}, {"output_throughput": 50.0}],
        "pagedllm:cap": [{"output_throughput": 120.0}, {"output_throughput": 99.0}],
    }
    ratios = bench.summarize(rounds)["ratios"]
    assert ratios["output_throughput_vs_vllm"]["median"] == pytest.approx(2.1)
    assert ratios["cap_output_throughput_vs_vllm"] == pytest.approx(
        {"median": 2.19, "min": 1.98, "max": 2.4}
    )
    assert ratios["cap_output_throughput_vs_pagedllm"]["min"] == pytest.approx(0.9)


def test_dot_peak_times_every_unit_the_cpu_has_and_names_what_it_lacks(capsys):
    from pagedllm.kernels.probe import cpu_info

    peak = load("dot_peak")
    assert peak.main(["--seconds", "0.02", "--rounds", "1"]) == 0
    result = last_json(capsys)
    assert [row["unit"] for row in result["units"]] == list(peak.UNITS)
    flags = cpu_info().flags
    for row, unit in zip(result["units"], peak.UNITS.values()):
        if unit["needs"] <= flags:
            assert row["gflops_1_threads"] > 1.0
            assert row[f"gflops_{result['cores']}_threads"] > 1.0
        else:
            assert "lacks" in row["skipped"]


def test_dot_peak_rejects_bad_args():
    with pytest.raises(SystemExit):
        load("dot_peak").main(["--rounds", "0"])


def test_instruction_peak_names_its_unit_or_why_there_is_none(monkeypatch):
    from dataclasses import replace

    from pagedllm.kernels.probe import cpu_info

    peak = load("dot_peak")
    info = cpu_info()
    amx = replace(info, flags=info.flags | {"amx_tile", "amx_bf16"})
    monkeypatch.setattr(peak, "cpu_info", lambda: amx)
    assert peak.instruction_peak("bfloat16") == (
        None,
        "the AMX tile unit is not timed by dot_peak.py",
    )
    bare = replace(info, flags=frozenset({"sse2"}))
    monkeypatch.setattr(peak, "cpu_info", lambda: bare)
    rate, why = peak.instruction_peak("float32")
    assert rate is None and "no unit" in why
    monkeypatch.setattr(peak, "cpu_info", lambda: info)
    if not {"avx512f", "avx512_bf16"} <= info.flags or info.amx:
        pytest.skip("the bf16 dot-product peak needs AVX-512-bf16 without AMX")
    rate, why = peak.instruction_peak("bfloat16", seconds=0.02, rounds=1)
    assert why == "bf16 dot (vdpbf16ps zmm)" and rate > 1e9


def test_structured_outputs_times_both_ways_and_caches_the_schema(capsys, tmp_path):
    from pagedllm.testing import make_tiny_checkpoint

    model = make_tiny_checkpoint(tmp_path / "tiny", "llama", seed=1)
    args = ["--model", str(model), "--num-seqs", "4", "--steps", "3", "--warmup-steps", "1",
            "--rounds", "1"]  # fmt: skip
    assert load("structured_outputs").main(args) == 0
    result = last_json(capsys)
    for config in ("unconstrained", "constrained"):
        assert result[config]["step_ms"] > 0
    assert result["constrained"]["masks_per_step"] == 4  # every sequence masked every step
    assert result["unconstrained"]["masks_per_step"] == 0  # an unconstrained batch: none
    assert result["second_request_cached"] is True
    assert result["compile_ms"] > 0 and "constrained_step_slower" in result


def test_wire_round_trips_each_message(capsys):
    assert load("wire").main(["--quick", "--num-seqs", "8"]) == 0
    result = last_json(capsys)
    assert result["num_seqs"] == 8
    for name in ("deltas", "deltas_logprobs", "add"):
        assert result[f"{name}_us"] > 0 and result[f"{name}_bytes"] > 0
    assert result["deltas_logprobs_bytes"] > result["deltas_bytes"]


def test_quant_decode_kernels_small(capsys):
    pytest.importorskip("gguf")
    from pagedllm.kernels.ops import layer_ops
    from pagedllm.kernels.probe import cpu_info

    if layer_ops() is None:
        pytest.skip("the C++ kernels did not build")
    args = ["--part", "kernels", "--shape", "64", "512", "--rows", "1,17", "--repeats", "2"]
    assert load("quant_decode").main(args) == 0
    result = last_json(capsys)
    # The dense copy in the dtype --dtype auto would run (float32 without bf16 dot products).
    dense = "bfloat16" if cpu_info().bf16_dot else "float32"
    assert result["dtype"] == dense
    formats = {"Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q5_K", "Q6_K", dense}
    assert set(result["kernels"]) == formats
    assert all(set(r["us"]) == {"1", "17"} for r in result["kernels"].values())
    assert result["kernels"]["Q4_0"]["mib"] < result["kernels"][dense]["mib"] / 3


def test_spec_decode_runs_every_mode_and_keeps_greedy_tokens(capsys, tmp_path):
    from pagedllm.testing import make_tiny_checkpoint

    model = make_tiny_checkpoint(tmp_path / "tiny", "llama", seed=3)
    args = ["--model", str(model), "--dtype", "float32", "--concurrency", "1", "2"]
    args += ["--rounds", "1", "--max-tokens", "6", "--source-lines", "12"]
    args += ["--max-model-len", "1024", "--kv-mib", "64", "--num-threads", "1"]
    assert load("spec_decode").main(args) == 0
    result = last_json(capsys)
    assert set(result["cells"]) == {"code-edit c=1", "code-edit c=2", "chat c=1", "chat c=2"}
    for cell in result["cells"].values():
        assert set(cell) == {"off", "auto", "always"}
        assert cell["off"]["ratio"] == 1.0
        assert all(entry["greedy_identical"] for entry in cell.values())
        assert cell["always"]["output_tokens"] == cell["off"]["output_tokens"] > 0
    assert result["cpu"]


def test_serve_vs_vllm_json_schema_workload_validates_every_reply(capsys, tmp_path):
    """pagedllm alone on the structured workload: a real server on a tiny random model
    held to each of the eight schemas; every reply the grammar finished validates (only a
    reply cut by max_tokens may not), and the table counts them."""
    import socket

    from pagedllm.testing import make_tiny_checkpoint

    model = make_tiny_checkpoint(tmp_path / "tiny", "llama", seed=2, max_position_embeddings=4096)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    args = ["--model", str(model), "--dtype", "float32", "--workload", "json-schema",
            "--num-prompts", "8", "--max-concurrency", "4", "--output-len", "800",
            "--rounds", "1", "--port", str(port)]  # fmt: skip
    assert load("serve_vs_vllm").main(args) == 0  # 1: a failed request or an unheld grammar
    result = last_json(capsys)
    assert result["kind"] == "json-schema" and set(result["rounds"]) == {"pagedllm"}
    [run] = result["rounds"]["pagedllm"]
    assert run["completed"] == 8 and run["failed"] == 0
    assert run["invalid_uncut"] == 0 and run["invalid"] <= run["truncated"]
    assert run["invalid"] < 8 and run["output_throughput"] > 0


def test_the_json_schema_workload_checks_replies_against_their_schema():
    workload = load("json_schema_workload")
    bodies = workload.requests("m", 9, 100, seed=1)
    assert [name for name, _ in bodies][:8] == list(workload.SCHEMAS) and bodies[8][0] == "person"
    assert bodies != workload.requests("m", 9, 100, seed=2)  # another round, other prompts
    good = {"name": "Ada", "age": 36, "email": "a@b.c", "is_member": True}
    assert workload.check("person", json.dumps(good))
    assert not workload.check("person", json.dumps({**good, "age": 200}))
    assert not workload.check("person", json.dumps(good)[:-1])  # cut
    assert not workload.check("person", None)
    with pytest.raises(SystemExit):
        load("serve_vs_vllm").parse_args(["--workload", "json-schema", "--vllm", "x",
                                          "--no-vllm-server"])  # fmt: skip


def test_quant_quality_compares_each_format_and_cache_on_held_out_text(capsys, tmp_path):
    pytest.importorskip("gguf")
    from pagedllm.testing import make_tiny_checkpoint
    from tests.model.test_gguf_and_default_model import write_tiny_gguf

    checkpoint = make_tiny_checkpoint(tmp_path / "tiny", "llama", seed=1)
    gguf_file = write_tiny_gguf(checkpoint, tmp_path / "t.gguf", False, linears="Q4_1")
    models = f"{gguf_file},{gguf_file}@Q8_0,{tmp_path / 'absent.gguf'}"
    args = ["--models", models, "--kv-model", str(checkpoint), "--tokens", "40"]
    args += ["--texts", "argparse.py,email/message.py", "--threads", "1"]
    assert load("quant_quality").main(args) == 0
    result = last_json(capsys)
    rows = result["weights"]["rows"]
    assert set(rows[str(gguf_file)]["formats"]) == {"Q4_1"}
    assert set(rows[f"{gguf_file}@Q8_0"]["formats"]) == {"Q8_0"}  # requantized
    assert "neither a named model" in rows[str(tmp_path / "absent.gguf")]["skipped"]
    kv = result["kv"]["rows"]
    assert "bf16 weights, int8 KV (block 0 full) vs bf16 weights, bf16 KV" in kv
    for row in [rows[str(gguf_file)], rows[f"{gguf_file}@Q8_0"], *kv.values()]:
        assert row["positions"] == 2 * 39
        assert 0.5 < row["min_top1"] <= row["top1"] <= 1.0
        assert 0.0 <= row["mean_kl"] < 1e-2 and row["ppl"] > 1.0
        assert set(row["texts"]) == {"argparse.py", "email/message.py"}


def test_quant_matvec_times_the_kernel_and_the_read_and_ab_tests_a_tree(capsys):
    pytest.importorskip("gguf")
    from pagedllm.kernels.ops import layer_ops

    if layer_ops() is None:
        pytest.skip("the C++ kernels did not build")
    root = Path(__file__).resolve().parents[2]
    args = ["--models", "smollm2", "--linears", "o", "--threads", "1,2", "--rounds", "2"]
    assert (
        load("quant_matvec").main([*args, "--working-set", "1", "--variant-src", f"same={root}"])
        == 0
    )
    result = last_json(capsys)
    assert [(c["linear"], c["threads"]) for c in result["cases"]] == [("o", 1), ("o", 2)]
    for case in result["cases"]:
        assert case["bytes"] == 576 * 360  # Q4_1: 18 blocks of 20 bytes a row
        for variant in ("this", "same"):
            assert case[variant]["us"] > 0 and case[variant]["read_us"] > 0
            assert len(case[variant]["rounds_us"]) == 2


@pytest.mark.parametrize(
    "bad",
    [["--models", "llama"], ["--linears", "nope"], ["--variant-src", "this=/x"], ["--rows", "0"]],
)
def test_quant_matvec_rejects_bad_args(bad):
    with pytest.raises(SystemExit):
        load("quant_matvec").main(bad)


def test_memory_split_reports_each_phase_and_the_goal(capsys, tmp_path):
    pytest.importorskip("gguf")
    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc/self/smaps_rollup")
    from pagedllm.testing import make_tiny_checkpoint
    from tests.model.test_gguf_and_default_model import write_tiny_gguf

    checkpoint = make_tiny_checkpoint(tmp_path / "tiny", "llama", seed=1)
    gguf_file = write_tiny_gguf(checkpoint, tmp_path / "t.gguf", False, "Q4_1", "Q8_0")
    args = ["--model", str(gguf_file), "--kv-mib", "8", "--prompt-tokens", "20"]
    args += ["--output-tokens", "4"]
    assert load("memory_split").main(args) == 0
    (row,) = last_json(capsys)["models"]
    assert list(row["phases"]) == ["imports", "LLM()", "first step", "warm"]
    assert row["kv_mib"] == 8.0 and 0 < row["weights_mib"] < 1
    assert row["rest_mib"] == pytest.approx(row["rss_mib"] - row["weights_mib"] - 8.0, abs=0.2)
    assert row["goal_mib"] == pytest.approx(row["weights_mib"] * 1.1 + 8.0 + 300, abs=0.2)
    assert all(0 < p["anonymous"] < p["rss"] for p in row["phases"].values())


@pytest.mark.slow
def test_memory_split_serve_reports_each_process(capsys, tmp_path):
    """``--serve``: the API server and the engine core (a child process) read apart, the
    weights and KV cache from the core's start-up report, the goal on the core's RSS."""
    pytest.importorskip("gguf")
    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc/PID/smaps_rollup")
    from pagedllm.testing import make_tiny_checkpoint

    checkpoint = make_tiny_checkpoint(tmp_path / "tiny", "llama", seed=1)
    args = ["--serve", "--model", str(checkpoint), "--kv-mib", "8", "--prompt-tokens", "20"]
    args += ["--output-tokens", "4"]
    assert load("memory_split").main(args) == 0
    (row,) = last_json(capsys)["serve"]
    processes = row["processes"]
    assert {"API server", "engine core"} <= set(processes)
    assert row["kv_mib"] == 8.0 and 0 <= row["weights_mib"] < 1
    assert row["total_mib"] == pytest.approx(sum(p["rss"] for p in processes.values()), abs=0.2)
    assert row["core_goal_mib"] == pytest.approx(row["weights_mib"] * 1.1 + 8.0 + 300, abs=0.2)
    assert all(0 < p["anonymous"] < p["rss"] for p in processes.values())
