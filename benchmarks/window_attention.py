"""Prompt and decode speed of a sliding-window model by attention route, rounds alternated.

The model (default ``gemma-3-270m``: 18 layers, 15 of them local with a 512-token window,
one KV head of 256 dims; fetched beforehand with ``pagedllm generate --model gemma-3-270m``,
or any checkpoint directory) is loaded once; each round runs every configuration in turn on
the same requests through the engine (prefix caching off, so every round computes its
prompts):

- ``reference``: windowed / soft-capped layers on the reference path (gather through the
  table + masked SDPA) — how the CPU backend ran them before the kernel took windows;
- ``kernel``: those layers in the C++ ``paged_attention`` (blocks before the window unread),
  every layer module by module (torch ops);
- ``fused`` (where the model has a fast path): the kernel inside the model's one-call
  decoder op (``gemma_layers`` for Gemma, ``decoder_layers`` for the Llama family) for the
  steps it takes, module by module for the rest.

Workloads: ``short``: ``--batch`` prompts of 64 tokens, ``--decode`` tokens each; ``long``:
one prompt of ``--long`` tokens (4k by default: well past the window), ``--decode`` tokens.
Prompt tok/s = prompt tokens / time until every request has its first token; decode tok/s =
the other generated tokens / the rest of the time. Figures are the median over rounds, with
the spread (min-max), and each configuration's ratio to ``reference`` is the median of the
per-round ratios. Prints a table and one JSON line.

    python benchmarks/window_attention.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]
    decode: int


def make_reference_windows() -> Any:
    """A CpuAttention that sends windowed / soft-capped layers to the reference path."""
    from pagedllm.attention.base import FULL_ATTENTION, AttentionKind
    from pagedllm.attention.cpu import CpuAttention
    from pagedllm.attention.reference import paged_attention

    class ReferenceWindows(CpuAttention):
        def forward(self, query, key, value, k_cache, v_cache, meta, scale, kind=FULL_ATTENTION):
            if kind.is_full:
                return super().forward(query, key, value, k_cache, v_cache, meta, scale, kind)
            self._write_kv(key, value, k_cache, v_cache, meta.slot_mapping)
            return paged_attention(query, k_cache, v_cache, meta, scale, kind)

        def kind_route(self, dtype: Any, kind: AttentionKind) -> str:
            return "reference"

    return ReferenceWindows()


def configurations(engine: Any) -> dict[str, Callable[[], None]]:
    """name -> a function that switches the loaded model to that configuration."""
    from pagedllm.model.llama import Attention

    model = engine.runner.model
    attention = [m for m in model.modules() if isinstance(m, Attention)]
    kernel_backend = attention[0].backend
    reference_backend = make_reference_windows()
    fast_path = model.fast_path

    def use(backend: Any, fused: bool) -> Callable[[], None]:
        def switch() -> None:
            for module in attention:
                module.backend = backend
            model.fast_path = fast_path if fused else None

        return switch

    configs = {
        "reference": use(reference_backend, False),
        "kernel": use(kernel_backend, False),
    }
    if fast_path is not None:
        configs["fused"] = use(kernel_backend, True)
    return configs


def run_workload(engine: Any, workload: Workload) -> tuple[float, float]:
    """(prompt tok/s, decode tok/s) of one pass."""
    from pagedllm.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=workload.decode, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(workload.prompts):
        engine.add_request(f"{workload.name}-{time.monotonic_ns()}-{i}", prompt, params)
    started = time.perf_counter()
    first = None
    answered: set[str] = set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.outputs and out.outputs[0].token_ids:
                answered.add(out.request_id)
        if first is None and len(answered) == len(workload.prompts):
            first = time.perf_counter()
    end = time.perf_counter()
    first = first or end
    prompt_tokens = sum(len(p) for p in workload.prompts)
    decode_tokens = len(workload.prompts) * (workload.decode - 1)
    return prompt_tokens / (first - started), decode_tokens / max(end - first, 1e-9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--long", type=int, default=4096)
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--workloads", default="short,long")
    args = parser.parse_args()

    from pagedllm.engine.config import EngineConfig
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.kernels.probe import cpu_info

    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        enable_prefix_caching=False,
        kv_cache_memory=1 << 29,
        max_model_len=args.long + args.decode + 64,
    )
    engine = LLMEngine.from_config(config)
    vocab = engine.runner.model.config.vocab_size
    rng = random.Random(0)
    workloads = {
        "short": Workload(
            "short",
            [[rng.randrange(3, vocab) for _ in range(64)] for _ in range(args.batch)],
            args.decode,
        ),
        "long": Workload(
            "long", [[rng.randrange(3, vocab) for _ in range(args.long)]], args.decode
        ),
    }
    chosen = [workloads[name] for name in args.workloads.split(",")]
    configs = configurations(engine)
    for switch in configs.values():  # warm-up: every route once
        switch()
        run_workload(engine, Workload("warm", [[5] * 40], 3))
    results: dict[str, dict[str, list[tuple[float, float]]]] = {
        w.name: {name: [] for name in configs} for w in chosen
    }
    for _ in range(args.rounds):
        for workload in chosen:
            for name, switch in configs.items():
                switch()
                results[workload.name][name].append(run_workload(engine, workload))
    report(results, args, cpu_info())


def report(results: dict, args: argparse.Namespace, cpu: Any) -> None:
    print(
        f"model {args.model}, dtype {args.dtype}, {args.rounds} rounds; CPU {cpu.model} ({cpu.isa})"
    )
    header = f"{'workload':8} {'config':17} {'prompt tok/s':>22} {'decode tok/s':>22} {'x ref prompt':>13} {'x ref decode':>13}"
    print(header)
    summary: dict[str, Any] = {}
    for workload, by_config in results.items():
        ref = by_config["reference"]
        for name, runs in by_config.items():
            cells = []
            for phase in (0, 1):
                values = [r[phase] for r in runs]
                cells.append(
                    f"{statistics.median(values):9.1f} ({min(values):.1f}-{max(values):.1f})"
                )
            ratios = [
                statistics.median(r[phase] / b[phase] for r, b in zip(runs, ref, strict=True))
                for phase in (0, 1)
            ]
            print(
                f"{workload:8} {name:17} {cells[0]:>22} {cells[1]:>22} {ratios[0]:13.2f} {ratios[1]:13.2f}"
            )
            summary[f"{workload}/{name}"] = {
                "prompt_tok_s": statistics.median(r[0] for r in runs),
                "decode_tok_s": statistics.median(r[1] for r in runs),
                "prompt_vs_reference": ratios[0],
                "decode_vs_reference": ratios[1],
            }
    print(json.dumps({"model": args.model, "rounds": args.rounds, "results": summary}))


if __name__ == "__main__":
    main()
