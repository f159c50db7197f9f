"""The integer matvec kernel (quant_gemm, decode rows) on the real models' weight shapes.

    .venv/bin/python benchmarks/quant_matvec.py [--models smollm2,qwen,gemma] [--threads 1,2]
        [--rows 1] [--rounds 3] [--variant-src base=DIR]

Each case is one linear of SmolLM2-135M (Q4_1, Q8_0 head), Qwen2.5-Coder-0.5B (Q5_0, Q8_0 v
and head, Q6_K / Q4_K down) or Gemma-3-270M (Q5_0, Q8_0, Q4_K, Q6_K) in the format and shape
the engine holds it: random blocks, in enough copies that one pass reads at least
``--working-set`` MiB (a decode step streams every weight once from L3 or memory, not from
L2). A pass runs x through every copy in turn on the integer kernel, in one step team on
more than one thread as a decode step does (``torch.ops.pagedllm.quant_gemm_bench``); a
second pass type only reads the same bytes, the memory's ceiling for that case. Figures:
microseconds per call and weight GB/s, the median pass of a child, then the median over
rounds; on one thread the thread's CPU time (on a shared host a pass's time off the core does
not count), on more the wall-clock time.

``--isa avx2`` (or ``avx_vnni``) caps the kernel's route: a CPU with AVX-512-VNNI times the
routes of CPUs without it. ``--variant-src NAME=DIR`` also runs the children from the checkout DIR (its ``src/``, e.g.
a ``git archive`` of main), alternated with this tree in every round (the order reversed
every other round), and prints each variant's time against this tree's: an A/B of two
kernels in one run. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant_decode import random_weight  # noqa: E402

# (model, linear, GGUF format, N, K): the products of one decode step, as the engine holds
# them (same-format q/k/v and gate/up fused into one weight).
CASES = (
    ("smollm2", "qkv", "Q4_1", 960, 576),
    ("smollm2", "o", "Q4_1", 576, 576),
    ("smollm2", "gate_up", "Q4_1", 3072, 576),
    ("smollm2", "down", "Q4_1", 576, 1536),
    ("smollm2", "head", "Q8_0", 49152, 576),
    ("qwen", "q", "Q5_0", 896, 896),
    ("qwen", "v", "Q8_0", 128, 896),
    ("qwen", "gate_up", "Q5_0", 9728, 896),
    ("qwen", "down", "Q6_K", 896, 4864),
    ("qwen", "down_q4k", "Q4_K", 896, 4864),
    ("qwen", "head", "Q8_0", 151936, 896),
    ("gemma", "q", "Q5_0", 1024, 640),
    ("gemma", "o", "Q4_K", 640, 1024),
    ("gemma", "gate_up", "Q5_0", 4096, 640),
    ("gemma", "down", "Q6_K", 640, 2048),
    ("gemma", "head", "Q8_0", 262144, 640),
)
MODELS = ("smollm2", "qwen", "gemma")
# The tree this script runs from.
THIS = "this"


def child(args: argparse.Namespace) -> dict:
    """Per case, thread count and row count: the median pass's seconds per call, of the
    kernel and of reading only."""
    import torch

    from pagedllm.kernels.ops import layer_ops

    ops = layer_ops()
    if ops is None or not hasattr(ops, "quant_gemm_bench"):
        raise SystemExit("the C++ kernels did not build (or lack quant_gemm_bench)")
    if args.isa:
        ops.set_quant_gemm_isa(args.isa)
        if ops.quant_gemm_isa() != args.isa:
            raise SystemExit(
                f"this CPU has no {args.isa} route (quant_gemm runs {ops.quant_gemm_isa()})"
            )
    results = []
    for model, linear, format, n, k in selected(args.models, args.linears):
        weight = random_weight(format, n, k)
        copies = max(1, -(-(args.working_set << 20) // weight.nbytes))
        weights = [weight.data] + [weight.data.clone() for _ in range(copies - 1)]
        # About 0.2 s of passes per case (at 10 GB/s), at least 5.
        passes = max(5, int(2e9 / (copies * weight.nbytes)))
        for threads in args.threads:
            torch.set_num_threads(threads)
            for rows in args.rows:
                x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
                kernel = ops.quant_gemm_bench(x, weights, weight.code, passes, False)
                read = ops.quant_gemm_bench(x, weights, weight.code, passes, True)
                # One thread: its CPU time (a pass spent off the core on a shared host does
                # not count); more: wall-clock, what a step waits.
                at = 1 if threads == 1 else 0
                results.append(
                    {
                        "model": model,
                        "linear": linear,
                        "format": format,
                        "shape": [n, k],
                        "bytes": weight.nbytes,
                        "threads": threads,
                        "rows": rows,
                        "us": statistics.median(kernel[at::2]) / copies * 1e6,
                        "read_us": statistics.median(read[at::2]) / copies * 1e6,
                    }
                )
        del weights
    return {"isa": ops.quant_gemm_isa(), "cases": results}


def selected(models: list[str], linears: list[str] | None) -> list[tuple]:
    return [c for c in CASES if c[0] in models and (not linears or c[1] in linears)]


def run_child(args: argparse.Namespace, src: str | None) -> dict:
    command = [sys.executable, __file__, "--child", "--working-set", str(args.working_set)]
    command += ["--models", ",".join(args.models), "--threads", ",".join(map(str, args.threads))]
    command += ["--rows", ",".join(map(str, args.rows))]
    if args.linears:
        command += ["--linears", ",".join(args.linears)]
    if args.isa:
        command += ["--isa", args.isa]
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = str(Path(src) / "src")
    out = subprocess.run(command, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"child ({src or THIS}) failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def key(case: dict) -> tuple:
    return (case["model"], case["linear"], case["threads"], case["rows"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models", default=",".join(MODELS), help="comma-separated: " + ", ".join(MODELS)
    )
    parser.add_argument(
        "--linears", default="", help="comma-separated: only these linears (e.g. head)"
    )
    parser.add_argument("--isa", choices=("avx512_vnni", "avx_vnni", "avx2"),
                        help="cap quant_gemm's route (e.g. avx2: the Zen 3 route on this CPU)")  # fmt: skip
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--rows", default="1", help="comma-separated activation row counts")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--working-set", type=int, default=64, help="MiB read per pass at least")
    parser.add_argument("--variant-src", action="append", default=[], metavar="NAME=DIR",
                        help="also run the kernels of the checkout DIR (its src/) as NAME")  # fmt: skip
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    unknown = set(args.models) - set(MODELS)
    if unknown or not args.models:
        parser.error(f"--models takes some of {', '.join(MODELS)}")
    args.linears = [name for name in args.linears.split(",") if name]
    if not selected(args.models, args.linears):
        parser.error("--models and --linears select no case")
    try:
        args.threads = [int(t) for t in args.threads.split(",")]
        args.rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        parser.error("--threads and --rows take comma-separated integers")
    if min(args.threads) < 1 or min(args.rows) < 1 or args.rounds < 1 or args.working_set < 1:
        parser.error("--threads, --rows, --rounds and --working-set must be positive")
    variants: dict[str, str | None] = {THIS: None}
    for spec in args.variant_src:
        name, sep, directory = spec.partition("=")
        if not sep or not name or not directory or name == THIS:
            parser.error(f"--variant-src takes NAME=DIR (NAME not {THIS!r}), got {spec!r}")
        variants[name] = directory
    if args.child:
        print(json.dumps(child(args)))
        return 0
    from pagedllm.kernels.probe import cpu_info

    print(f"CPU: {cpu_info().label}; rows {args.rows}; threads {args.threads}")
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    names = list(variants)
    for round_index in range(args.rounds):
        for name in names if round_index % 2 == 0 else reversed(names):
            runs[name].append(run_child(args, variants[name]))
            print(f"round {round_index} {name}: {runs[name][-1]['isa']}", flush=True)
    summary = summarise(runs)
    print_table(summary, names)
    print(json.dumps({"variants": {n: variants[n] for n in names}, "cases": summary}))
    return 0


def summarise(runs: dict[str, list[dict]]) -> list[dict]:
    """One row per case: per variant the median over rounds of µs per call and read µs."""
    first = next(iter(runs.values()))[0]["cases"]
    rows = []
    for case in first:
        row = {
            k: case[k] for k in ("model", "linear", "format", "shape", "bytes", "threads", "rows")
        }
        for name, rounds in runs.items():
            found = [c for r in rounds for c in r["cases"] if key(c) == key(case)]
            row[name] = {
                "us": statistics.median(c["us"] for c in found),
                "read_us": statistics.median(c["read_us"] for c in found),
                "rounds_us": [round(c["us"], 2) for c in found],
            }
        rows.append(row)
    return rows


def print_table(summary: list[dict], names: list[str]) -> None:
    head = " | ".join(f"{n} µs (GB/s)" for n in names)
    ratios = " | ".join(f"{n} / {THIS}" for n in names[1:])
    print(f"| model | linear | format | N x K | MiB | threads | rows | {head} | read GB/s |"
          + (f" {ratios} |" if ratios else ""))  # fmt: skip
    print("| --- " * (8 + len(names) + len(names[1:])) + "|")
    for row in summary:
        gb = row["bytes"] / 1e3
        cells = " | ".join(f"{row[n]['us']:.1f} ({gb / row[n]['us']:.1f})" for n in names)
        read = gb / row[THIS]["read_us"]
        ratio = " | ".join(f"{row[n]['us'] / row[THIS]['us']:.2f}" for n in names[1:])
        n, k = row["shape"]
        print(
            f"| {row['model']} | {row['linear']} | {row['format']} | {n} x {k} | "
            f"{row['bytes'] / 2**20:.2f} | {row['threads']} | {row['rows']} | {cells} | {read:.1f} |"
            + (f" {ratio} |" if ratio else "")
        )


if __name__ == "__main__":
    raise SystemExit(main())
