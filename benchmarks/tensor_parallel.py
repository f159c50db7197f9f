"""What tensor parallelism costs on this machine: step time at TP=1 and TP=2 (gathers over
gloo and over shared memory), and the collectives' share of a step (all-gathers between
layers, the step broadcast).

On a 2-core machine TP=2 cannot be faster than one rank with both cores: the same work is
split in two, plus the gathers. What this measures is their cost, which is what a larger
machine would pay per step too (scaled by its link). Model: a random Llama-shaped
checkpoint built here (``--hidden``, ``--layers``, ...: KV heads that divide by 2), in
``--dtype``. Configurations, alternated over ``--rounds`` rounds:

- ``tp1-2t``: one rank, 2 threads (the whole machine);
- ``tp1-1t``: one rank, 1 thread (one rank's share of the machine);
- ``tp2-gloo``: two ranks gathering over gloo, 1 thread each;
- ``tp2-shm``:  two ranks gathering through shared memory, 1 thread each.

The two TP=2 configurations run one after the other (a process holds one process group),
each alternated with the TP=1 ones, which so run twice the rounds.

Workloads: ``decode`` (``--batch`` prompts of 32 tokens, ``--max-tokens`` greedy tokens)
and ``prefill`` (``--batch`` prompts of ``--prompt-len`` tokens, one token each). Per run:
ms per model step, and for tp2 rank 0's gather time, calls and bytes per step and the
step broadcast's time per step. Medians over rounds, with the spread.

    .venv/bin/python benchmarks/tensor_parallel.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from pagedllm.engine.llm import LLM  # noqa: E402
from pagedllm.sampling_params import SamplingParams  # noqa: E402
from pagedllm.testing import make_tiny_checkpoint  # noqa: E402

# name: (ranks, threads per rank, tp_collective)
CONFIGS = {
    "tp1-2t": (1, 2, "auto"),
    "tp1-1t": (1, 1, "auto"),
    "tp2-gloo": (2, 1, "gloo"),
    "tp2-shm": (2, 1, "shm"),
}


def build_engine(path: Path, args: argparse.Namespace, name: str) -> LLM:
    tp, threads, collective = CONFIGS[name]
    return LLM(
        model=str(path),
        dtype=args.dtype,
        tensor_parallel_size=tp,
        num_threads=threads,
        tp_collective=collective,
        kv_cache_memory=512 << 20,
        max_model_len=2048,
    )


def one_run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    engine = llm.engine
    # torch's thread count is per process, and every engine here shares rank 0's process
    torch.set_num_threads(engine.config.num_threads)
    comm = getattr(engine.runner.model, "comm", None)
    if comm is not None and hasattr(comm, "seconds"):
        comm.seconds, comm.num_calls, comm.num_bytes = 0.0, 0, 0
        engine.runner.step_broadcast_s = 0.0
    steps = engine.num_steps
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    steps = engine.num_steps - steps
    out = {"ms_per_step": 1000 * wall / steps, "steps": steps}
    if comm is not None and hasattr(comm, "seconds"):
        out["gather_ms_per_step"] = 1000 * comm.seconds / steps
        out["gathers_per_step"] = comm.num_calls / steps
        out["gather_kib_per_step"] = comm.num_bytes / steps / 1024
        out["broadcast_ms_per_step"] = 1000 * engine.runner.step_broadcast_s / steps
    engine.reset_prefix_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    path = make_tiny_checkpoint(
        Path(tempfile.mkdtemp()) / "m", dtype=args.dtype, hidden_size=args.hidden,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        intermediate_size=args.intermediate, num_hidden_layers=args.layers,
        vocab_size=args.vocab, max_position_embeddings=4096,
    )  # fmt: skip
    workloads = {
        "decode": ([[100 + i + j for j in range(32)] for i in range(args.batch)], args.max_tokens),
        "prefill": (
            [[1000 + i * 7 + j for j in range(args.prompt_len)] for i in range(args.batch)],
            1,
        ),
    }
    results: dict[str, dict[str, list[dict[str, float]]]] = {
        w: {c: [] for c in CONFIGS} for w in workloads
    }
    single = {name: build_engine(path, args, name) for name in ("tp1-2t", "tp1-1t")}
    # One process group per process: the TP=2 engines take turns, each alternated with
    # the TP=1 ones over its rounds (so tp1 gets twice the rounds).
    for name in ("tp2-gloo", "tp2-shm"):
        engines = {**single, name: build_engine(path, args, name)}
        run_rounds(engines, workloads, args.rounds, results)
        engines[name].close()
    for llm in single.values():
        llm.close()
    report(results, args)


def run_rounds(
    engines: dict[str, LLM], workloads: dict[str, Any], rounds: int, results: dict[str, Any]
) -> None:
    for llm in engines.values():  # warm-up: kernels built, buffers sized
        for prompts, max_tokens in workloads.values():
            one_run(llm, prompts[:2], min(max_tokens, 4))
    for _ in range(rounds):
        for workload, (prompts, max_tokens) in workloads.items():
            for name, llm in engines.items():
                results[workload][name].append(one_run(llm, prompts, max_tokens))


def med(runs: list[dict[str, float]], key: str) -> tuple[float, float, float]:
    values = [r[key] for r in runs]
    return statistics.median(values), min(values), max(values)


def report(results: dict[str, Any], args: argparse.Namespace) -> None:
    from pagedllm.kernels.probe import cpu_info

    cpu = cpu_info()
    print(f"random Llama-shaped model: hidden {args.hidden}, {args.heads} heads / "
          f"{args.kv_heads} KV heads, intermediate {args.intermediate}, {args.layers} layers, "
          f"vocab {args.vocab}, {args.dtype}; {cpu.model}, {cpu.num_cpus} CPUs ({cpu.isa}); "
          f"batch {args.batch}; medians of {args.rounds} rounds (min-max)")  # fmt: skip
    print(f"{'workload':<8} {'config':<8} {'ms/step':>20} {'gather ms/step':>20} "
          f"{'gathers':>8} {'us/gather':>9} {'KiB/step':>9} {'bcast ms/step':>14}")  # fmt: skip
    summary: dict[str, Any] = {}
    for workload, by_config in results.items():
        for name, runs in by_config.items():
            ms = med(runs, "ms_per_step")
            line = f"{workload:<8} {name:<8} {ms[0]:>8.2f} ({ms[1]:.2f}-{ms[2]:.2f})"
            entry = {"ms_per_step": ms}
            if "gather_ms_per_step" in runs[0]:
                g = med(runs, "gather_ms_per_step")
                b = med(runs, "broadcast_ms_per_step")
                per_call = 1000 * g[0] / runs[0]["gathers_per_step"]
                line += (f" {g[0]:>8.2f} ({g[1]:.2f}-{g[2]:.2f}) "
                         f"{runs[0]['gathers_per_step']:>8.0f} {per_call:>9.1f} "
                         f"{runs[0]['gather_kib_per_step']:>9.0f} {b[0]:>14.3f}")  # fmt: skip
                entry.update(gather_ms_per_step=g, broadcast_ms_per_step=b,
                             gather_us_per_call=per_call,
                             gathers_per_step=runs[0]["gathers_per_step"],
                             gather_kib_per_step=runs[0]["gather_kib_per_step"])  # fmt: skip
            print(line)
            summary[f"{workload}/{name}"] = entry
        for phase, name in enumerate(("tp2-gloo", "tp2-shm")):
            tp2 = [r["ms_per_step"] for r in by_config[name]]
            one = [r["ms_per_step"] for r in by_config["tp1-2t"]][phase * len(tp2) :][: len(tp2)]
            ratio = statistics.median(a / b for a, b in zip(tp2, one, strict=True))
            print(f"{workload}: {name} / tp1-2t step time x{ratio:.2f} "
                  "(median of per-round ratios)")  # fmt: skip
            summary[f"{workload}/{name}_over_tp1_2t"] = ratio
    print(json.dumps({"bench": "tensor_parallel", "args": vars(args), "results": summary}))


if __name__ == "__main__":
    main()
