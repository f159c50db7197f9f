"""Quantized GGUF weights served as stored against the same weights dequantised.

Two parts:

- ``models`` (the default): one request's decode speed, first-token time and memory of a
  model whose GGUF runs natively (``LLM(model=NAME)``: linears kept as stored) against the
  float model converted from the same file (``LLM(model=<its converted directory>)``). The
  default model (SmolLM2-135M, Q4_1) unless ``--model qwen2.5-coder-0.5b`` (opt-in: the
  Qwen2.5-Coder-0.5B GGUF, mostly Q5_0 with Q8_0 / Q4_K / Q6_K tensors; or ``gemma-3-270m``,
  Q4_K_M: Q5_0, Q8_0, Q4_K and Q6_K). With ``--quantization int8|q8_0|q4_0`` the quantized
  configuration is the converted float directory quantized at load instead (linears,
  embedding and head). ``--model-dtype``: both configurations' ``dtype``. Each configuration
  runs in a fresh child process (so that its RSS is its own), in alternated rounds; figures
  are medians over the rounds of each round's best of ``REPEATS`` generations (on a shared
  machine a neighbour's burst lands in some generations: the best is the code's speed, the
  median over rounds keeps one lucky round from setting it). Decode tok/s: (output tokens -
  1) over the time after the first token (a one-token generation of the same prompt timed
  just before), greedy, ``ignore_eos``.
  ``--variant-src NAME=DIR`` adds a configuration NAME: the GGUF as stored, run from the
  checkout DIR (its ``src/``, e.g. a ``git archive`` of main), alternated with the others in
  every round, with its speed against this tree's (an A/B of two trees' kernels in one run);
  ``--no-float`` leaves the float model out.
- ``kernels``: one linear of each format (``kernels/quant.py``) on random blocks against
  small_gemm's copy of the same shape (``--dtype``; auto: bf16 where the CPU has bf16 dot
  products, else float32), at decode and prompt row counts:
  microseconds per call (the best of ``--repeats``).

    .venv/bin/python benchmarks/quant_decode.py --rounds 5
    .venv/bin/python benchmarks/quant_decode.py --model qwen2.5-coder-0.5b --prompt-tokens 256
    .venv/bin/python benchmarks/quant_decode.py --quantization int8 --model-dtype float32
    .venv/bin/python benchmarks/quant_decode.py --part kernels --rows 1,4,16,64,256
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

CONFIGS = ("float", "quantized")
# Timed generations in each child; the child reports the best.
REPEATS = 5
MODELS = ("default", "qwen2.5-coder-0.5b", "gemma-3-270m")


def child(args: argparse.Namespace) -> dict:
    from pagedllm import LLM, SamplingParams
    from pagedllm.model.loader import named_model

    directory, _ = named_model(args.model)
    config, prompt_tokens, output_tokens = args.child, args.prompt_tokens, args.output_tokens
    at_load = config == "quantized" and args.quantization is not None
    start = time.perf_counter()
    # No prefix cache: every call computes its prompt, as the first one did.
    llm = LLM(
        model=args.model if config == "quantized" and not at_load else str(directory),
        dtype=args.model_dtype,
        quantization=args.quantization if at_load else None,
        kv_cache_memory=args.kv_mib << 20,
        max_num_seqs=1,
        enable_prefix_caching=False,
    )
    load_s = time.perf_counter() - start
    text = "Write a short story about a lighthouse keeper who finds a message in a bottle. " * 60
    prompt = llm.get_tokenizer().encode(text)[:prompt_tokens]
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    full = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True)
    request = [{"prompt_token_ids": prompt}]
    llm.generate(request, full, use_tqdm=False)  # warm-up
    speeds, first_token_s, cpu_ms = [], [], []
    for _ in range(REPEATS):
        start, cpu = time.perf_counter(), time.process_time()
        llm.generate(request, first, use_tqdm=False)
        prompt_s, prompt_cpu = time.perf_counter() - start, time.process_time() - cpu
        start, cpu = time.perf_counter(), time.process_time()
        out = llm.generate(request, full, use_tqdm=False)
        total_s, total_cpu = time.perf_counter() - start, time.process_time() - cpu
        decoded = len(out[0].outputs[0].token_ids) - 1
        speeds.append(decoded / (total_s - prompt_s))
        cpu_ms.append((total_cpu - prompt_cpu) / decoded * 1e3)
        first_token_s.append(prompt_s)
    routes = llm.engine.routes
    held = re.search(r"weights ([\d,]+) MiB as held", llm.engine.startup_report or "")
    return {
        "weights_mib": float(held.group(1).replace(",", "")) if held else None,
        "decode_tok_s": max(speeds),
        # The process's CPU time per decoded token: on one thread (OMP_NUM_THREADS=1) the work
        # a token takes, which a busy neighbour does not add to as it does to wall time.
        "decode_cpu_ms": min(cpu_ms),
        "first_token_ms": min(first_token_s) * 1e3,
        "load_s": load_s,
        "rss_mib": _status("VmRSS") / 1024,
        "peak_rss_mib": _status("VmHWM") / 1024,
        "tokens": list(out[0].outputs[0].token_ids[:16]),
        "linears": getattr(routes, "linears", ""),
    }


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def models_part(args: argparse.Namespace) -> dict:
    from pagedllm.kernels.probe import cpu_info

    print(f"CPU: {cpu_info().label}; model {args.model}")
    # Each configuration: (the child's configuration, the checkout it runs from or None).
    configs = {c: (c, None) for c in CONFIGS if c != "float" or not args.no_float}
    configs.update({name: ("quantized", src) for name, src in args.variant_src.items()})
    results: dict[str, list[dict]] = {config: [] for config in configs}
    for round_index in range(args.rounds):
        order = list(configs) if round_index % 2 == 0 else list(reversed(configs))
        for config in order:
            kind, src = configs[config]
            command = [sys.executable, __file__, "--child", kind, "--model", args.model]
            command += ["--model-dtype", args.model_dtype]
            command += ["--quantization", args.quantization] if args.quantization else []
            command += ["--prompt-tokens", str(args.prompt_tokens)]
            command += ["--output-tokens", str(args.output_tokens), "--kv-mib", str(args.kv_mib)]
            env = dict(os.environ)
            if src is not None:
                env["PYTHONPATH"] = os.path.join(src, "src")
            line = subprocess.run(
                command, capture_output=True, text=True, check=True, env=env
            ).stdout
            result = json.loads(line.strip().splitlines()[-1])
            results[config].append(result)
            shown = {k: v for k, v in result.items() if k not in ("tokens", "linears")}
            print(round_index, config, json.dumps(shown))
    summary = {}
    print(
        "| | decode tok/s (rounds) | CPU ms a token | first token ms | RSS MiB (peak) | load s "
        "| weights MiB |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for config, rounds in results.items():
        speeds = [r["decode_tok_s"] for r in rounds]
        summary[config] = {
            "decode_tok_s": statistics.median(speeds),
            "decode_cpu_ms": statistics.median(r["decode_cpu_ms"] for r in rounds),
            "first_token_ms": statistics.median(r["first_token_ms"] for r in rounds),
            "rss_mib": statistics.median(r["rss_mib"] for r in rounds),
            "peak_rss_mib": max(r["peak_rss_mib"] for r in rounds),
            "load_s": statistics.median(r["load_s"] for r in rounds),
            "weights_mib": rounds[0]["weights_mib"],
        }
        s = summary[config]
        print(
            f"| {config} | {s['decode_tok_s']:.1f} ({', '.join(f'{v:.1f}' for v in speeds)}) "
            f"| {s['decode_cpu_ms']:.2f} | {s['first_token_ms']:.1f} | {s['rss_mib']:.0f} ({s['peak_rss_mib']:.0f}) "
            f"| {s['load_s']:.1f} | {s['weights_mib']} |"
        )
    quantized = results["quantized"][0]["tokens"]
    same = None
    if "float" in results:
        first = results["float"][0]["tokens"]
        same = sum(a == b for a, b in zip(first, quantized, strict=False))
        print(f"first 16 greedy tokens equal (float, quantized): {same} of {len(first)}")
    for name in args.variant_src:
        pairs = list(zip(results["quantized"], results[name], strict=True))
        ratios = [q["decode_tok_s"] / v["decode_tok_s"] for q, v in pairs]
        cpu = [v["decode_cpu_ms"] / q["decode_cpu_ms"] for q, v in pairs]
        summary[name]["this_over_variant"] = statistics.median(ratios)
        summary[name]["cpu_variant_over_this"] = statistics.median(cpu)
        summary[name]["same_tokens"] = results[name][0]["tokens"] == quantized
        print(
            f"quantized / {name} decode: {statistics.median(ratios):.3f} (rounds: "
            f"{', '.join(f'{r:.3f}' for r in ratios)}); CPU ms a token, {name} / quantized: "
            f"{statistics.median(cpu):.3f} ({', '.join(f'{r:.3f}' for r in cpu)}); "
            f"same tokens: {summary[name]['same_tokens']}"
        )
    print(f"quantized linears: {results['quantized'][0]['linears']}")
    return {
        "model": args.model,
        "quantization": args.quantization,
        "dtype": args.model_dtype,
        **summary,
        "equal_first_tokens": same,
    }


def random_weight(format: str, rows: int, width: int, seed: int = 0):
    """A ``QuantWeight`` of random GGUF blocks (quants uniform, scales about 1e-3): for
    timing, not for numbers."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from pagedllm.kernels.quant import from_gguf_blocks

    kind = GGMLQuantizationType[format]
    block, size = GGML_QUANT_SIZES[kind]
    count = rows * width // block
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (count, size), dtype=np.uint8)
    scales = rng.uniform(1e-4, 2e-3, count).astype(np.float16).view(np.uint8).reshape(count, 2)
    starts = {"Q6_K": [208]}.get(format, [0, 2] if format in ("Q4_1", "Q4_K", "Q5_K") else [0])
    for start in starts:
        raw[:, start : start + 2] = scales
    return from_gguf_blocks(raw.reshape(rows, -1), format, (rows, width))


def kernels_part(args: argparse.Namespace) -> dict:
    import torch

    from pagedllm.kernels.ops import layer_ops
    from pagedllm.kernels.probe import cpu_info
    from pagedllm.quant_layout import FORMATS, K_QUANTS

    ops = layer_ops()
    if ops is None:
        raise SystemExit("the C++ kernels did not build")
    torch.set_num_threads(args.threads)
    rows_list = [int(r) for r in args.rows.split(",")]
    n, k = args.shape
    cpu = cpu_info()
    # auto: the dtype --dtype auto runs a float32 checkpoint in on this CPU.
    name = args.dtype if args.dtype != "auto" else "bfloat16" if cpu.bf16_dot else "float32"
    dtype = torch.bfloat16 if name == "bfloat16" else torch.float32
    isa = ops.small_gemm_isa() if dtype == torch.bfloat16 else ops.small_gemm_f32_isa()
    if isa == "none":
        raise SystemExit(f"small_gemm has no {name} route on this CPU: --dtype float32")
    print(
        f"CPU: {cpu.label}; {args.threads} threads; weight {n} x {k}; {name} "
        f"activations; quant_gemm {ops.quant_gemm_isa()}, small_gemm {isa}; best of "
        f"{args.repeats}, microseconds per call"
    )

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times) * 1e6

    dense = ops.pack_small_gemm((torch.randn(n, k) * 0.05).to(dtype))
    table = {}
    print("| format | MiB | " + " | ".join(f"{r} rows" for r in rows_list) + " |")
    print("| --- | --- |" + " --- |" * len(rows_list))
    for format in (*FORMATS, name):
        quantized = format in FORMATS
        if quantized and format in K_QUANTS and k % 256:
            continue
        weight = random_weight(format, n, k) if quantized else None
        row = {}
        for rows in rows_list:
            x = torch.randn(rows, k).to(dtype)
            if quantized:
                row[rows] = best(lambda x=x, w=weight: ops.quant_gemm(x, w.data, w.code, None))
            else:
                row[rows] = best(lambda x=x: ops.small_gemm(x, dense, None))
        size = weight.nbytes if quantized else dense.numel() * dense.element_size()
        table[format] = {"mib": size / 2**20, "us": row}
        cells = " | ".join(f"{row[r]:.0f}" for r in rows_list)
        print(f"| {format} | {size / 2**20:.1f} | {cells} |")
    return {"shape": [n, k], "dtype": name, "threads": args.threads, "kernels": table}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("models", "kernels"), default="models")
    parser.add_argument("--model", choices=MODELS, default="default")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--kv-mib", type=int, default=64)
    parser.add_argument("--child", choices=CONFIGS)
    parser.add_argument("--quantization", choices=("int8", "q8_0", "q4_0"), default=None)
    parser.add_argument("--model-dtype", default="auto", help="models: LLM(dtype=)")
    parser.add_argument("--rows", default="1,4,16,64,256", help="kernels: row counts")
    parser.add_argument(
        "--shape", type=int, nargs=2, default=(9728, 896), help="kernels: weight N K"
    )
    parser.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                        help="kernels: activations (auto: bfloat16 with bf16 dot products)")  # fmt: skip
    parser.add_argument("--threads", type=int, default=1, help="kernels: torch threads")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--no-float", action="store_true", help="models: leave the float model out")
    parser.add_argument("--variant-src", action="append", default=[], metavar="NAME=DIR",
                        help="models: also the GGUF as stored run from the checkout DIR")  # fmt: skip
    args = parser.parse_args(argv)
    variants = {}
    for spec in args.variant_src:
        name, sep, directory = spec.partition("=")
        if not sep or not name or not directory or name in CONFIGS or name in variants:
            parser.error(f"--variant-src takes NAME=DIR with a new NAME, got {spec!r}")
        variants[name] = directory
    args.variant_src = variants
    if args.child:
        result = child(args)
        print(json.dumps(result))
        return 0
    result = models_part(args) if args.part == "models" else kernels_part(args)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
