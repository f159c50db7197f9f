"""Many sequences at once, end to end: ``LLM.generate`` against ``llama-batched-bench``.

Both engines get ``--sequences`` independent prompts of ``--prompt-tokens`` random tokens
and decode ``--gen-tokens`` each (greedy, EOS ignored), all admitted together; the figure is
output tokens over the wall time of the whole batch, prompts included (llama-batched-bench's
``T``; its prompts are not shared either, no ``-pps``). pagedllm runs the GGUF as stored
(``LLM(model=NAME)``, the prefix cache off) in a fresh child process per round, so each
engine is alone on the machine for its turn; the order alternates every round. pagedllm's
figure per round is the best of ``REPEATS`` batches after a warm-up, llama.cpp's is one
``llama-batched-bench`` run (it warms up itself); the table shows medians over rounds and
the spread.

    .venv/bin/python benchmarks/batched_peer.py --llama-cpp DIR --rounds 3
    .venv/bin/python benchmarks/batched_peer.py --llama-cpp DIR --model qwen2.5-coder-0.5b

Build llama.cpp as ``benchmarks/llama_cpp_peer.py`` says; it is never a dependency.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# Timed batches in each pagedllm child; the child reports the best.
REPEATS = 2


def child(model: str, sequences: int, prompt_tokens: int, gen_tokens: int) -> dict:
    import random

    from pagedllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(
        model=model,
        max_num_seqs=sequences,
        max_model_len=prompt_tokens + gen_tokens + 16,
        kv_cache_memory=(sequences * (prompt_tokens + gen_tokens) * 64 << 10) + (64 << 20),
        enable_prefix_caching=False,
    )
    load_s = time.perf_counter() - start
    vocab = llm.get_tokenizer().vocab_size
    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randrange(100, vocab - 100) for _ in range(prompt_tokens)]}
        for _ in range(sequences)
    ]
    params = SamplingParams(max_tokens=gen_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - start)
        produced = sum(len(o.outputs[0].token_ids) for o in outputs)
        if produced != sequences * gen_tokens:
            raise RuntimeError(f"{produced} tokens, expected {sequences * gen_tokens}")
    best = min(times)
    return {
        "output_tok_s": sequences * gen_tokens / best,
        "total_tok_s": sequences * (prompt_tokens + gen_tokens) / best,
        "seconds": best,
        "load_s": load_s,
        "linears": getattr(llm.engine.routes, "linears", ""),
    }


def parse_batched(line: str) -> dict:
    """One ``llama-batched-bench --output-format jsonl`` record as our figures."""
    record = json.loads(line)
    outputs = record["pl"] * record["tg"]
    return {
        "output_tok_s": outputs / record["t"],
        "total_tok_s": record["speed"],
        "seconds": record["t"],
        "decode_tok_s": record["speed_tg"],
        "prompt_tok_s": record["speed_pp"],
    }


def llama_batched(args: argparse.Namespace, gguf: Path) -> dict:
    from llama_cpp_peer import find_tool

    context = args.sequences * (args.prompt_tokens + args.gen_tokens) + 64
    command = [
        str(find_tool(args.llama_cpp, "llama-batched-bench")),
        *("-m", str(gguf), "-c", str(context), "-t", str(args.threads)),
        *("-npp", str(args.prompt_tokens), "-ntg", str(args.gen_tokens)),
        *("-npl", str(args.sequences), "--output-format", "jsonl"),
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"llama-batched-bench failed ({done.returncode}): {done.stderr[-500:]}")
    return parse_batched(lines[-1])


def pagedllm_batched(args: argparse.Namespace) -> dict:
    command = [sys.executable, __file__, "--child", "--model", args.model]
    command += ["--sequences", str(args.sequences), "--prompt-tokens", str(args.prompt_tokens)]
    command += ["--gen-tokens", str(args.gen_tokens)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"pagedllm child failed ({done.returncode}): {done.stderr[-800:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarize(rounds: list[dict]) -> dict:
    speeds = [r["output_tok_s"] for r in rounds]
    return {
        "output_tok_s": statistics.median(speeds),
        "min": min(speeds),
        "max": max(speeds),
        "seconds": statistics.median(r["seconds"] for r in rounds),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp", metavar="DIR", help="llama.cpp build/bin (else ours only)")
    parser.add_argument("--model", default="default", help="default | qwen2.5-coder-0.5b | PATH")
    parser.add_argument("--llama-model", help="the GGUF for llama.cpp (default: --model's)")
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--gen-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.model, args.sequences, args.prompt_tokens, args.gen_tokens)))
        return 0
    from pagedllm.kernels.probe import cpu_info

    engines = {"pagedllm": lambda: pagedllm_batched(args)}
    if args.llama_cpp:
        from llama_cpp_peer import gguf_path

        gguf = Path(args.llama_model) if args.llama_model else gguf_path(args.model)
        engines["llama.cpp"] = lambda: llama_batched(args, gguf)
    results: dict[str, list[dict]] = {name: [] for name in engines}
    for round_index in range(args.rounds):
        names = list(engines) if round_index % 2 == 0 else list(reversed(engines))
        for name in names:
            results[name].append(engines[name]())
            print(f"round {round_index} {name}: {results[name][-1]['output_tok_s']:.1f} tok/s")
    summary = {name: summarize(rounds) for name, rounds in results.items()}
    label = f"{args.sequences} x ({args.prompt_tokens} in, {args.gen_tokens} out)"
    print(f"CPU: {cpu_info().label}; model {args.model}; {label}")
    print("| engine | output tok/s, median (min-max) | batch seconds |")
    print("| --- | --- | --- |")
    for name, s in summary.items():
        span = f"{s['output_tok_s']:.1f} ({s['min']:.1f}-{s['max']:.1f})"
        print(f"| {name} | {span} | {s['seconds']:.2f} |")
    if "llama.cpp" in summary:
        ratios = [
            ours["output_tok_s"] / theirs["output_tok_s"]
            for ours, theirs in zip(results["pagedllm"], results["llama.cpp"], strict=True)
        ]
        summary["ratio"] = {"median": statistics.median(ratios), "rounds": ratios}
        print(f"pagedllm / llama.cpp: {statistics.median(ratios):.2f}x (rounds "
              f"{', '.join(f'{r:.2f}' for r in ratios)})")  # fmt: skip
    print(json.dumps({"model": args.model, "workload": label, "cpu": cpu_info().label, **summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
