"""Where an engine's resident memory goes: weights, KV cache and the rest, by phase.

Each model runs in a fresh child process (so that the resident set is its own), through
``LLM(model=...)`` with one sequence and a fixed KV cache: the resident set (anonymous and
file-mapped, from /proc/self/smaps_rollup) after the imports, after ``LLM()`` and after a
prompt step and warm decode steps, against the start-up report's split (weights as held,
the KV cache's bytes). The issue-44 goal: RSS <= weights x 1.1 + KV + 300 MiB.

``--serve``: the same model behind ``pagedllm serve`` (one sequence, the same KV cache),
the same requests over HTTP; the resident set of the API server process and of each of its
children (the engine core; multiprocessing's resource tracker), the goal on the core's.

    .venv/bin/python benchmarks/memory_split.py                      # the default model
    .venv/bin/python benchmarks/memory_split.py --model default qwen2.5-coder-0.5b gemma-3-270m
    .venv/bin/python benchmarks/memory_split.py --model path/to/model.gguf --kv-mib 16
    .venv/bin/python benchmarks/memory_split.py --serve --model gemma-3-270m
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

MIB = 1 << 20
PHASES = ("imports", "LLM()", "first step", "warm")
# The goal's allowance beside the weights (x 1.1) and the KV cache.
GOAL_SLACK_MIB = 300
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle. " * 60
# The start-up report's line (engine/builder.py's MemorySplit.line).
SPLIT_LINE = re.compile(r"memory: weights ([\d,]+) MiB as held, KV cache ([\d,]+) MiB")


def child(model: str, kv_mib: int, prompt_tokens: int, output_tokens: int) -> dict:
    from pagedllm.util.memory import resident_memory

    phases = {}

    def mark(phase: str) -> None:
        resident = resident_memory()
        phases[phase] = {"rss": resident.total / MIB, "anonymous": resident.anonymous / MIB}

    import torch  # noqa: F401

    from pagedllm import LLM, SamplingParams
    from pagedllm.engine.builder import memory_split

    mark("imports")
    llm = LLM(
        model=model, kv_cache_memory=kv_mib * MIB, max_num_seqs=1, enable_prefix_caching=False
    )
    mark("LLM()")
    prompt = {"prompt_token_ids": llm.get_tokenizer().encode(PROMPT)[:prompt_tokens]}
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    mark("first step")
    full = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True)
    for _ in range(3):
        llm.generate([prompt], full, use_tqdm=False)
    mark("warm")
    split = memory_split(llm.engine.weight_bytes, llm.engine.plan)
    return {
        "weights_mib": (split.weight_bytes or 0) / MIB,
        "kv_mib": split.kv_bytes / MIB,
        "phases": phases,
    }


def goal_mib(weights_mib: float, kv_mib: float) -> float:
    """The issue-44 goal's ceiling on a process's RSS."""
    return weights_mib * 1.1 + kv_mib + GOAL_SLACK_MIB


def rss_cell(resident: dict) -> str:
    """A table cell: RSS (anonymous), MiB."""
    return f"{resident['rss']:.0f} ({resident['anonymous']:.0f})"


def table_row(*cells: object) -> str:
    """A markdown table row; a goal cell as (ceiling, met)."""
    text = [
        f"{c[0]:.0f} ({'met' if c[1] else 'not met'})" if isinstance(c, tuple) else str(c)
        for c in cells
    ]
    return "| " + " | ".join(text) + " |"


def summary(model: str, result: dict) -> dict:
    weights, kv = result["weights_mib"], result["kv_mib"]
    warm = result["phases"]["warm"]["rss"]
    goal = goal_mib(weights, kv)
    return {
        "model": model,
        "weights_mib": round(weights, 1),
        "kv_mib": round(kv, 1),
        "rss_mib": round(warm, 1),
        "rest_mib": round(warm - weights - kv, 1),
        "goal_mib": round(goal, 1),
        "goal_met": warm <= goal,
        "phases": {k: {n: round(v, 1) for n, v in p.items()} for k, p in result["phases"].items()},
    }


def serve(model: str, kv_mib: int, prompt_tokens: int, output_tokens: int) -> dict:
    """``pagedllm serve --model model`` with one sequence and a ``kv_mib`` cache, a prompt
    step and three generations over HTTP, then each of its processes' resident set."""
    import httpx

    from pagedllm.model.loader import load_tokenizer
    from pagedllm.util.memory import resident_memory
    from pagedllm.util.net import free_port
    from serve_vs_vllm import wait_healthy

    port = free_port()
    command = [sys.executable, "-m", "pagedllm.cli", "serve", "--model", model, "--port",
               str(port), "--kv-cache-memory", f"{kv_mib}MiB", "--max-num-seqs", "1",
               "--no-enable-prefix-caching", "--log-level", "info"]  # fmt: skip
    log = Path(f"/tmp/memory_split_serve_{os.getpid()}.log")
    with log.open("w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, server, name="pagedllm serve", tail=lambda: log.read_text()[-2000:])
        prompt = load_tokenizer(model).encode(PROMPT)[:prompt_tokens]
        body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
        httpx.post(f"{base}/v1/completions", json=body, timeout=600).raise_for_status()
        body = {**body, "max_tokens": output_tokens, "ignore_eos": True}
        for _ in range(3):
            httpx.post(f"{base}/v1/completions", json=body, timeout=600).raise_for_status()
        children = [int(p) for p in Path(f"/proc/{server.pid}/task/{server.pid}/children")
                    .read_text().split()]  # fmt: skip
        processes = {"API server": server.pid}
        for pid in children:
            cmdline = Path(f"/proc/{pid}/cmdline").read_text()
            name = "resource tracker" if "resource_tracker" in cmdline else "engine core"
            processes[name if name not in processes else f"{name} {pid}"] = pid
        resident = {name: resident_memory(pid) for name, pid in processes.items()}
    finally:
        server.terminate()
        server.wait(60)
    found = SPLIT_LINE.search(log.read_text())
    if found is None:
        raise SystemExit(f"no start-up memory line in {log}")
    log.unlink()
    weights, kv = (float(g.replace(",", "")) for g in found.groups())
    return {
        "weights_mib": weights,
        "kv_mib": kv,
        "processes": {
            n: {"rss": r.total / MIB, "anonymous": r.anonymous / MIB} for n, r in resident.items()
        },
    }


def serve_table(args: argparse.Namespace) -> int:
    """One ``serve`` per model: each process's RSS, the total, the goal on the core's."""
    from pagedllm.kernels.probe import cpu_info

    print(f"CPU: {cpu_info().label}; pagedllm serve, KV cache {args.kv_mib} MiB; MiB, RSS "
          "(anonymous)")  # fmt: skip
    print("| model | weights | KV | API server | engine core | others | total | core goal |")
    print("| --- " * 8 + "|")
    rows = []
    for model in args.model:
        result = serve(model, args.kv_mib, args.prompt_tokens, args.output_tokens)
        processes = result["processes"]
        core = processes["engine core"]["rss"]
        others = sum(
            p["rss"] for n, p in processes.items() if n not in ("API server", "engine core")
        )
        goal = goal_mib(result["weights_mib"], result["kv_mib"])
        row = {"model": model, **result, "total_mib": round(sum(p["rss"] for p in processes.values()), 1),
               "core_goal_mib": round(goal, 1), "core_goal_met": core <= goal}  # fmt: skip
        rows.append(row)
        print(
            table_row(
                model,
                f"{result['weights_mib']:.0f}",
                f"{result['kv_mib']:.0f}",
                rss_cell(processes["API server"]),
                rss_cell(processes["engine core"]),
                f"{others:.0f}",
                f"{row['total_mib']:.0f}",
                (goal, row["core_goal_met"]),
            )  # fmt: skip
        )
    print(json.dumps({"kv_mib": args.kv_mib, "serve": rows}))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", nargs="+", default=["default"])
    parser.add_argument("--kv-mib", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--serve", action="store_true", help="behind pagedllm serve")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        return serve_table(args)
    if args.child:
        result = child(args.model[0], args.kv_mib, args.prompt_tokens, args.output_tokens)
        print(json.dumps(result))
        return 0
    from pagedllm.kernels.probe import cpu_info

    print(f"CPU: {cpu_info().label}; KV cache {args.kv_mib} MiB; MiB, RSS (anonymous)")
    print("| model | weights | KV | " + " | ".join(PHASES) + " | rest | goal |")
    print("| --- " * (len(PHASES) + 5) + "|")
    rows = []
    for model in args.model:
        command = [sys.executable, __file__, "--child", "--model", model]
        command += ["--kv-mib", str(args.kv_mib), "--prompt-tokens", str(args.prompt_tokens)]
        command += ["--output-tokens", str(args.output_tokens)]
        out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        row = summary(model, json.loads(out.strip().splitlines()[-1]))
        rows.append(row)
        phases = [rss_cell(p) for p in row["phases"].values()]
        print(
            table_row(
                model,
                f"{row['weights_mib']:.0f}",
                f"{row['kv_mib']:.0f}",
                *phases,
                f"{row['rest_mib']:.0f}",
                (row["goal_mib"], row["goal_met"]),
            )  # fmt: skip
        )
    print(json.dumps({"kv_mib": args.kv_mib, "models": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
