"""Which route runs is said, never silent: `pagedllm env`, the start-up report, /v1/cache."""

from __future__ import annotations

import json

import pytest
import torch

from pagedllm.cli import main
from pagedllm.engine.messages import Codec
from pagedllm.engine.reports import EngineStats, cache_report
from pagedllm.kernels.ops import layer_ops
from pagedllm.kernels.probe import cpu_info
from pagedllm.routes import Routes
from pagedllm.testing import make_tiny_checkpoint

ROUTE_NAMES = [
    "attention",
    "linears",
    "decode_loop",
    "sampler",
    "windowed_attention",
    "lm_head",
    "dtype",
    "dtype_reason",
    "speculative",
]


def test_env_reports_cpu_threads_kernels_and_every_route(tiny_model_dir, capsys):
    assert main(["env", "--model", str(tiny_model_dir), "--dtype", "bfloat16", "--json"]) == 0
    env = json.loads(capsys.readouterr().out)
    cpu = cpu_info()
    assert env["cpu"]["model"] == cpu.model and env["cpu"]["isa"] == cpu.isa
    assert env["cpu"]["max_isa"] == cpu.cap
    assert set(env["cpu"]["flags"]) <= cpu.flags
    assert env["threads"]["torch"] >= 1
    assert "gloo across machines" in env["tensor_parallel_gathers"]  # shm here, or why not
    routes = env["routes"]
    assert list(routes) == ROUTE_NAMES
    assert (
        routes["dtype"] == "bfloat16" and routes["dtype_reason"] == "asked for (--dtype bfloat16)"
    )
    ops = layer_ops()
    isa = "none" if ops is None else ops.small_gemm_isa()
    assert env["kernels"]["small_gemm_bf16"] == isa
    if ops is None:
        assert routes["decode_loop"] == "module by module (torch ops)"
        assert routes["attention"].startswith("torch")
    elif isa == "none":
        # No bf16 small_gemm: oneDNN's packed bf16 where oneDNN runs bf16 on this CPU (AVX-512),
        # else plain torch (an AVX2-only CPU).
        assert "small_gemm" not in routes["linears"]
        if torch.ops.mkldnn._is_mkldnn_bf16_supported():
            assert "oneDNN" in routes["linears"]
        else:
            assert routes["linears"] == f"{num_linears(tiny_model_dir)} on torch F.linear"
    else:  # the tiny model's linears are all in 16s and 32s: every one on the own kernel
        assert routes["linears"].startswith(f"{num_linears(tiny_model_dir)} on own kernel")
        assert routes["linears"].endswith(f"on own kernel small_gemm ({isa})")
        assert routes["decode_loop"].startswith("fused C++: every layer in one call")
        assert f"small_gemm_argmax, {isa}" in routes["sampler"]
        assert "paged_attention" in routes["attention"]


def test_env_names_the_float32_route(tiny_model_dir, capsys):
    assert main(["env", "--model", str(tiny_model_dir), "--dtype", "float32", "--json"]) == 0
    env = json.loads(capsys.readouterr().out)
    routes, ops = env["routes"], layer_ops()
    isa = "none" if ops is None else ops.small_gemm_f32_isa()
    assert env["kernels"]["small_gemm_f32"] == isa
    if isa == "none":
        assert "small_gemm" not in routes["linears"]
    else:  # AVX-512 or AVX2 + FMA: every linear on the own kernel, all layers in one call
        assert routes["linears"].startswith(f"{num_linears(tiny_model_dir)} on own kernel")
        # Every row count on the kernel: the packed copy is the weight's only one.
        assert routes["linears"].endswith(f"on own kernel small_gemm ({isa})")
        assert routes["decode_loop"].startswith("fused C++: every layer in one call")


def num_linears(model_dir) -> int:
    """qkv, o, gate_up and down per layer, and the LM head (tied or not)."""
    config = json.loads((model_dir / "config.json").read_text())
    return 4 * config["num_hidden_layers"] + 1


def test_env_text_names_each_route(tiny_model_dir, capsys):
    assert main(["env", "--model", str(tiny_model_dir), "--dtype", "float32"]) == 0
    text = capsys.readouterr().out
    for label in ("cpu:", "threads:", "kernels:", "attention:", "linears:", "decode loop:"):
        assert label in text
    assert "dtype: float32" in text


def test_env_names_the_speculative_route(tiny_model_dir, capsys):
    args = ["env", "--model", str(tiny_model_dir), "--json"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["routes"]["speculative"].startswith("off")
    spec = '{"method": "suffix", "num_speculative_tokens": 7}'
    assert main([*args, "--speculative-config", spec]) == 0
    route = json.loads(capsys.readouterr().out)["routes"]["speculative"]
    assert route.startswith("suffix decoding") and "up to 7 drafts" in route
    assert "one query of up to 8 tokens" in route


def test_reference_backend_is_named(tiny_model_dir, capsys):
    args = ["env", "--model", str(tiny_model_dir), "--attention-backend", "reference", "--json"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["routes"]["attention"].startswith("reference")


def test_engine_reports_routes_at_start_up_and_in_its_stats(model_engine):
    engine = model_engine(block_size=4, num_blocks=32, max_model_len=64, dtype="auto")
    routes = engine.get_stats().routes
    assert isinstance(routes, Routes)
    assert routes.dtype == ("bfloat16" if cpu_info().bf16_dot else "float32")
    assert routes.dtype_reason.startswith("auto: float32 checkpoint")
    assert "routes:" in engine.startup_report
    assert f"  attention: {routes.attention}" in engine.startup_report
    assert cache_report(engine.get_stats())["routes"] == routes.as_dict()
    codec = Codec()
    wired = codec.decode_value(codec.encode_value(engine.get_stats()), EngineStats)
    assert wired.routes == routes  # to the server
    assert routes.speculative.startswith("off")
    speculating = model_engine(
        block_size=4, num_blocks=32, max_model_len=64, speculative_config={"method": "ngram"}
    )
    assert speculating.get_stats().routes.speculative.startswith("n-gram prompt lookup")


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "int4", "fp8_e4m3"])
def test_a_quantized_cache_names_the_quantized_kernel(model_engine, kv_cache_dtype):
    """Over a quantized cache attention runs quant_attention, not paged_attention: the
    start-up report and the stats say so."""
    engine = model_engine(
        block_size=4, num_blocks=32, max_model_len=64, kv_cache_dtype=kv_cache_dtype
    )
    attention = engine.get_stats().routes.attention
    if layer_ops() is None:
        assert attention.startswith(f"torch: {kv_cache_dtype} blocks dequantized")
    else:
        assert attention.startswith("C++ quant_attention (")
        assert f"): {kv_cache_dtype} blocks read in place" in attention
        if cpu_info().isa == "avx2":
            assert "(AVX2 fp32, codes widened in registers" in attention
    assert "paged_attention" not in attention
    assert f"  attention: {attention}" in engine.startup_report
    # With every linear on small_gemm a quantized step runs in one call too.
    decode_loop = engine.get_stats().routes.decode_loop
    plan = engine.runner.model.fast_path and engine.runner.model.fast_path.plan
    if plan is None:
        assert "in one call" not in decode_loop
    else:
        assert decode_loop.startswith("fused C++: every layer in one call (quant_decoder_layers")
        assert f"over the {kv_cache_dtype} cache" in decode_loop


def test_env_names_the_quantized_route(tiny_model_dir, capsys):
    args = ["env", "--model", str(tiny_model_dir), "--dtype", "float32", "--json"]
    assert main([*args, "--kv-cache-dtype", "int8"]) == 0
    assert "quant_attention" in json.loads(capsys.readouterr().out)["routes"]["attention"]
    assert main([*args, "--attention-backend", "reference", "--kv-cache-dtype", "int8"]) == 0
    attention = json.loads(capsys.readouterr().out)["routes"]["attention"]
    assert attention.startswith("reference (int8 blocks dequantized")


def test_fake_runner_has_no_routes(fake_engine):
    engine = fake_engine()
    assert engine.get_stats().routes is None
    assert cache_report(engine.get_stats())["routes"] is None


@pytest.mark.parametrize(
    ("flags", "isa", "bf16_dot"),
    [
        ({"sse2"}, "none", False),
        ({"avx2", "fma"}, "avx2", False),
        ({"avx2", "avx512f"}, "avx512", False),
        ({"avx512f", "avx512_bf16"}, "avx512_bf16", True),
        ({"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}, "amx", True),
    ],
)
def test_cpu_isa_names_the_best_route(flags, isa, bf16_dot):
    from pagedllm.kernels.probe import CpuInfo

    cpu = CpuInfo("x", frozenset(flags), 1)
    assert (cpu.isa, cpu.bf16_dot) == (isa, bf16_dot)


def test_cpu_label_names_family_model_and_route(tmp_path, monkeypatch):
    from pagedllm.kernels import probe

    epyc = probe.CpuInfo("AMD EPYC", frozenset({"avx512f", "avx512_bf16"}), 2, "family 25 model 17")
    assert epyc.label == "AMD EPYC (family 25 model 17, avx512_bf16)"
    assert probe.CpuInfo("x", frozenset(), 1).label == "x (none)"
    # cpu_info() reads them from the first processor's lines, before its flags.
    monkeypatch.delenv("PAGEDLLM_MAX_ISA", raising=False)
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\n"
        "flags\t\t: avx2 avx512f avx512_bf16\n\nprocessor\t: 1\nmodel\t\t: 99\n"
    )
    real_open = open
    monkeypatch.setattr(
        "builtins.open",
        lambda path, *a, **k: real_open(cpuinfo if path == "/proc/cpuinfo" else path, *a, **k),
    )
    assert probe.cpu_info().label == "AMD EPYC (family 25 model 17, avx512_bf16)"


def test_windowed_layers_route_is_named(tmp_path, capsys):
    path = make_tiny_checkpoint(tmp_path / "mistral", "mistral", sliding_window=8)
    layers = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    assert main(["env", "--model", str(path), "--dtype", "float32", "--json"]) == 0
    routes = json.loads(capsys.readouterr().out)["routes"]
    prefix = f"sliding window 8 ({layers} of {layers} layers): "
    assert routes["windowed_attention"].startswith(prefix)
    if layer_ops() is not None:
        assert "C++ paged_attention" in routes["windowed_attention"]
        assert routes["decode_loop"].startswith("fused C++: every layer in one call")
    assert main(["env", "--model", str(path), "--attention-backend", "reference", "--json"]) == 0
    routes = json.loads(capsys.readouterr().out)["routes"]
    assert (
        routes["windowed_attention"]
        == prefix + "reference (masked SDPA over the visible blocks only)"
    )
