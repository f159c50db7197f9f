"""Where an engine's resident memory goes: weights, KV cache and the rest, by phase.

Each model runs in a fresh child process (so that the resident set is its own), through
``LLM(model=...)`` with one sequence and a fixed KV cache: the resident set (anonymous and
file-mapped, from /proc/self/smaps_rollup) after the imports, after ``LLM()`` and after a
prompt step and warm decode steps, against the start-up report's split (weights as held,
the KV cache's bytes). The issue-44 goal: RSS <= weights x 1.1 + KV + 300 MiB.

    .venv/bin/python benchmarks/memory_split.py                      # the default model
    .venv/bin/python benchmarks/memory_split.py --model default qwen2.5-coder-0.5b gemma-3-270m
    .venv/bin/python benchmarks/memory_split.py --model path/to/model.gguf --kv-mib 16
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

MIB = 1 << 20
PHASES = ("imports", "LLM()", "first step", "warm")
# The goal's allowance beside the weights (x 1.1) and the KV cache.
GOAL_SLACK_MIB = 300


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
    text = "Write a short story about a lighthouse keeper who finds a message in a bottle. " * 60
    prompt = {"prompt_token_ids": llm.get_tokenizer().encode(text)[:prompt_tokens]}
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


def summary(model: str, result: dict) -> dict:
    weights, kv = result["weights_mib"], result["kv_mib"]
    warm = result["phases"]["warm"]["rss"]
    goal = weights * 1.1 + kv + GOAL_SLACK_MIB
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", nargs="+", default=["default"])
    parser.add_argument("--kv-mib", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
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
        cells = " | ".join(f"{p['rss']:.0f} ({p['anonymous']:.0f})" for p in row["phases"].values())
        met = "met" if row["goal_met"] else "not met"
        print(
            f"| {model} | {row['weights_mib']:.0f} | {row['kv_mib']:.0f} | {cells} "
            f"| {row['rest_mib']:.0f} | {row['goal_mib']:.0f} ({met}) |"
        )
    print(json.dumps({"kv_mib": args.kv_mib, "models": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
