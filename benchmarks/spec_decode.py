"""Speculative decoding: output tok/s with and without drafts, on a code edit and a chat.

Workloads (greedy, ``ignore_eos`` off: a request ends at EOS or ``--max-tokens``):

- ``code-edit``: the chat-templated instruction to rename three names in a 176-line Python
  file (``data/edit_source.txt``), then the file; the model answers with the whole file.
  Each request renames other names, so the prompts share no prefix past the template.
- ``chat``: open questions, one per request, answered in prose: no text to copy.

Modes, on one engine (the offline ``LLM``, its defaults), alternated within each round:
``off`` (no speculation), ``auto`` (``--speculative-config``'s automatic mode: each
sequence drafts only while the measured cost pays) and ``always`` (every draft the
proposer finds). The prefix cache is emptied before every run. For each workload and
concurrency (all requests submitted at once): output tokens over wall time, and decode
tok/s (the tokens after each first one over the wall time less that of the prompts alone,
timed as one-token generations just before); each as the ratio to ``off`` in the same
round (the median over rounds is reported); the mean acceptance length; and whether the
greedy tokens equal ``off``'s.

    .venv/bin/python benchmarks/spec_decode.py --rounds 3
    .venv/bin/python benchmarks/spec_decode.py --model qwen2.5-coder-0.5b --concurrency 1 4

``--llama-cpp DIR`` (a llama.cpp build, ``llama_cpp_peer.py``) adds a ``llama.cpp`` mode: a
``llama-server`` on the same GGUF with its n-gram drafts (``--spec-type``, default
``ngram-simple`` with llama.cpp's own defaults), as many slots as the
highest concurrency, sent the same token ids on ``/completion`` (greedy, no prompt cache),
timed the same way and taking its turn in the same rounds; its ratio is to ``off``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

DATA = Path(__file__).resolve().parent / "data"
WORKLOADS = ("code-edit", "chat")
MODES = ("off", "auto", "always")
LLAMA = "llama.cpp"
RENAMES = (
    ("TraceRequest", "RequestRecord"),
    ("make_trace", "build_trace"),
    ("output_len", "num_output_tokens"),
    ("arrival_time", "arrives_at"),
    ("shared_prefix_len", "common_prefix_len"),
    ("max_model_len", "length_limit"),
)
QUESTIONS = (
    "Why do cats purr? Answer in a short paragraph.",
    "Describe a sunrise over the mountains for a child.",
    "What are three tips for learning a new language?",
    "Explain how a bicycle stays upright.",
    "Write a short note thanking a neighbour for help with a move.",
    "What makes bread rise?",
    "Give advice to someone starting their first job.",
    "Describe the taste of a fresh strawberry.",
    "How do bees find flowers?",
    "Suggest a plan for a rainy Sunday afternoon.",
    "What is the difference between weather and climate?",
    "Write a two-sentence story about a lost umbrella.",
    "Why is the sea salty?",
    "Explain what a library card is good for.",
    "How should I prepare for a long hike?",
    "What do owls eat, and how do they hunt?",
)


def code_edit_messages(index: int, source_lines: int | None = None) -> list[dict[str, str]]:
    source = "".join((DATA / "edit_source.txt").read_text().splitlines(True)[:source_lines])
    renames = [RENAMES[(index + j) % len(RENAMES)] for j in range(3)]
    asked = "; ".join(f"`{old}` to `{new}`" for old, new in renames)
    instruction = (
        f"Rename {asked} everywhere in the Python file below. Reply with the whole "
        "updated file and nothing else."
    )
    return [{"role": "user", "content": f"{instruction}\n\n```python\n{source}```"}]


def chat_messages(index: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": QUESTIONS[index % len(QUESTIONS)]}]


def prompts(
    llm: Any, workload: str, concurrency: int, source_lines: int | None = None
) -> list[list[int]]:
    """Token ids of each request (the chat template where the tokenizer has one)."""
    tokenizer = llm.get_tokenizer()
    result = []
    for i in range(concurrency):
        if workload == "code-edit":
            messages = code_edit_messages(i, source_lines)
        else:
            messages = chat_messages(i)
        if getattr(tokenizer, "chat_template", None):
            result.append(llm.encode_chat(messages))
        else:
            result.append(list(tokenizer.encode(messages[0]["content"])))
    return result


def set_mode(llm: Any, mode: str, config: dict[str, Any]) -> None:
    """Speculation off, automatic or always, on the same engine."""
    from pagedllm.engine.speculator import Speculator
    from pagedllm.spec_decode.config import SpeculativeConfig

    engine = llm.engine
    if mode == "off":
        engine.speculator = None
        return
    spec = SpeculativeConfig.from_value({**config, "automatic": mode == "auto"})
    engine.speculator = Speculator(spec)


def timed(llm: Any, token_ids: list[list[int]], max_tokens: int) -> tuple[float, list]:
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": t} for t in token_ids], params, use_tqdm=False)
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outputs]


def run(llm: Any, token_ids: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """One run: the prompts alone (one token each), then the whole generation. Decode
    tok/s: the tokens after the first over the time the prompts did not take."""
    prompt_s, _ = timed(llm, token_ids, 1)
    seconds, tokens = timed(llm, token_ids, max_tokens)
    speculator = llm.engine.speculator
    stats = speculator.stats() if speculator is not None else None
    num_tokens = sum(len(t) for t in tokens)
    return {
        "tok_s": num_tokens / seconds,
        "decode_tok_s": (num_tokens - len(tokens)) / max(seconds - prompt_s, 1e-9),
        "seconds": seconds,
        "tokens": tokens,
        "mean_acceptance_length": stats.mean_acceptance_length if stats else None,
        "draft_tokens": stats.num_draft_tokens if stats else 0,
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from pagedllm import LLM
    from pagedllm.kernels.probe import cpu_info

    llm = LLM(
        model=args.model,
        kv_cache_memory=args.kv_mib << 20,
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        num_threads=args.num_threads,
    )
    config = {"method": args.method, "num_speculative_tokens": args.num_speculative_tokens}
    cells: dict[str, dict[str, Any]] = {}
    modes = [*args.modes, LLAMA] if args.llama_cpp else list(args.modes)
    with ExitStack() as stack:
        llama_url = stack.enter_context(start_llama(args)) if args.llama_cpp else None
        for workload in args.workloads:
            for concurrency in args.concurrency:
                token_ids = prompts(llm, workload, concurrency, args.source_lines)
                rounds: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
                for round_index in range(args.rounds):
                    order = modes if round_index % 2 == 0 else list(reversed(modes))
                    for mode in order:
                        if mode == LLAMA:
                            rounds[mode].append(run_llama(llama_url, token_ids, args.max_tokens))
                            continue
                        set_mode(llm, mode, config)
                        rounds[mode].append(run(llm, token_ids, args.max_tokens))
                cells[f"{workload} c={concurrency}"] = summarise(rounds)
                print_cell(f"{workload} c={concurrency}", cells[f"{workload} c={concurrency}"])
    return {
        "cpu": cpu_info().label,
        "model": args.model,
        "method": args.method,
        "num_speculative_tokens": args.num_speculative_tokens,
        "max_tokens": args.max_tokens,
        "num_threads": args.num_threads,
        "rounds": args.rounds,
        "cells": cells,
    }


def start_llama(args: argparse.Namespace) -> Any:
    """A llama-server on the model's GGUF with n-gram drafts (``llama_cpp_peer.py``)."""
    from llama_cpp_peer import gguf_path, llama_server
    from pagedllm.util.net import free_port

    slots = max(args.concurrency)
    # llama.cpp's own defaults for its n-gram drafts (ngram-simple: 12-gram lookup, up to
    # 48 drafted tokens): its best setting, not ours.
    extra = ["--spec-type", args.llama_spec_type, "--no-cache-prompt"]
    return llama_server(
        args.llama_cpp,
        gguf_path(args.llama_model or args.model),
        free_port(),
        threads=args.num_threads or 2,
        parallel=slots,
        context=args.max_model_len * slots,
        extra_args=extra,
    )


def llama_completion(base_url: str, token_ids: list[int], max_tokens: int) -> list[int]:
    """One greedy completion of ``token_ids`` on llama-server's native endpoint."""
    body = {
        "prompt": token_ids,
        "n_predict": max_tokens,
        "temperature": 0.0,
        "cache_prompt": False,
        "return_tokens": True,
    }
    url = base_url.removesuffix("/v1") + "/completion"
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as answer:
        return list(json.loads(answer.read())["tokens"])


def llama_timed(base_url: str, token_ids: list[list[int]], max_tokens: int) -> tuple[float, list]:
    with ThreadPoolExecutor(len(token_ids)) as pool:
        start = time.perf_counter()
        tokens = list(pool.map(lambda t: llama_completion(base_url, t, max_tokens), token_ids))
        return time.perf_counter() - start, tokens


def run_llama(base_url: str, token_ids: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """``run`` against llama-server: the prompts alone, then the whole generation."""
    prompt_s, _ = llama_timed(base_url, token_ids, 1)
    seconds, tokens = llama_timed(base_url, token_ids, max_tokens)
    num_tokens = sum(len(t) for t in tokens)
    return {
        "tok_s": num_tokens / seconds,
        "decode_tok_s": (num_tokens - len(tokens)) / max(seconds - prompt_s, 1e-9),
        "seconds": seconds,
        "tokens": tokens,
        "mean_acceptance_length": None,
        "draft_tokens": 0,
    }


def summarise(rounds: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per mode: median tok/s, the median of its per-round ratio to ``off``, the mean
    acceptance length, and whether every run's tokens equal ``off``'s first run's."""
    base = rounds.get("off")
    summary = {}
    for mode, runs in rounds.items():
        entry: dict[str, Any] = {
            "tok_s": statistics.median(r["tok_s"] for r in runs),
            "decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs),
        }
        if base is not None:
            pairs = list(zip(runs, base, strict=True))
            entry["ratio"] = statistics.median(r["tok_s"] / b["tok_s"] for r, b in pairs)
            entry["decode_ratio"] = statistics.median(
                r["decode_tok_s"] / b["decode_tok_s"] for r, b in pairs
            )
            if mode != LLAMA:  # another engine's numerics: its greedy tokens may differ
                entry["greedy_identical"] = all(r["tokens"] == base[0]["tokens"] for r in runs)
        lengths = [r["mean_acceptance_length"] for r in runs if r["mean_acceptance_length"]]
        if lengths:
            entry["mean_acceptance_length"] = statistics.median(lengths)
            entry["draft_tokens"] = statistics.median(r["draft_tokens"] for r in runs)
        entry["output_tokens"] = sum(len(t) for t in runs[0]["tokens"])
        summary[mode] = entry
    return summary


def print_cell(name: str, summary: dict[str, Any]) -> None:
    for mode, entry in summary.items():
        ratio, decode = entry.get("ratio"), entry.get("decode_ratio")
        length = entry.get("mean_acceptance_length")
        print(
            f"{name:<16} {mode:<7} {entry['tok_s']:7.1f} tok/s"
            + (f" x{ratio:.2f}" if ratio is not None else "")
            + f"  decode {entry['decode_tok_s']:7.1f} tok/s"
            + (f" x{decode:.2f}" if decode is not None else "")
            + f"  {entry['output_tokens']} tokens"
            + (f"  accept-len {length:.2f}" if length else "")
            + ("" if entry.get("greedy_identical", True) else "  TOKENS DIFFER"),
            flush=True,
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help="default, qwen2.5-coder-0.5b, a path")
    parser.add_argument("--dtype", default="auto")
    # On a machine shared with other work, one thread: two threads that wait on each other
    # while others hold the cores lose several times over (docs/performance.md).
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 16])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--method", choices=("ngram", "suffix"), default="ngram")
    parser.add_argument("--num-speculative-tokens", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--kv-mib", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--source-lines", type=int, default=None, help="the code edit's first lines only (tests)"
    )
    parser.add_argument("--llama-cpp", metavar="DIR", help="a llama.cpp build/bin: add its server")
    parser.add_argument("--llama-spec-type", default="ngram-simple", help="llama-server's drafts")
    parser.add_argument("--llama-model", help="the GGUF for llama.cpp (default: --model's)")
    args = parser.parse_args(argv)
    if args.rounds < 1 or min(args.concurrency) < 1 or args.max_tokens < 1:
        parser.error("--rounds, --concurrency and --max-tokens must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = measure(args)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
