"""A burst of requests that share a prefix, arriving together: in-flight sharing on vs off
(and vLLM, with ``--vs-vllm PYTHON``).

Workload (seeded): ``--num-requests`` N prompts of token ids, each a shared prefix of
``--prefix-len`` P ids (``randint(100, 10000)``) and a private tail of ``randint(16, 64)``
ids; ``--max-tokens`` greedy tokens each, ``ignore_eos``. All N are added at once, then the
engine steps until done. Per engine and mode:

- prompt tokens computed: sum over requests of prompt length - cached tokens (the prefix
  computed once means (N - 1) x P fewer);
- peak duplication waste (pagedllm only): ``core.accounting`` after every step, tokens and
  fraction of the allocated slots;
- TTFT mean / p99: from the burst's start to each request's first output token;
- output tok/s: all output tokens over the burst's wall time.

Rounds alternate on / off (/ vLLM); figures are medians of the rounds, ratios medians of the
per-round ratios. The prefix cache is reset before every round.

    .venv/bin/python benchmarks/burst.py --dtype bfloat16 --rounds 5 [--prefix-len 4096]
        [--vs-vllm /path/to/python-wrapped]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# The benchmarks' shared pieces sit beside them (run as scripts or loaded by path in tests).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from pagedllm.kernels.probe import cpu_info  # noqa: E402
from vllm_child import VllmChild  # noqa: E402


@dataclass(frozen=True, slots=True)
class Burst:
    prompts: list[list[int]]
    max_tokens: int

    @property
    def num_output_tokens(self) -> int:
        return len(self.prompts) * self.max_tokens


def make_burst(num_requests: int, prefix_len: int, max_tokens: int, seed: int = 0) -> Burst:
    rng = random.Random(seed)
    prefix = [rng.randint(100, 10000) for _ in range(prefix_len)]
    prompts = [
        prefix + [rng.randint(100, 10000) for _ in range(rng.randint(16, 64))]
        for _ in range(num_requests)
    ]
    return Burst(prompts, max_tokens)


@dataclass(frozen=True, slots=True)
class BurstResult:
    seconds: float
    ttft: list[float]
    prompt_tokens_computed: int
    cached_tokens: int
    peak_duplication_tokens: int | None = None
    peak_duplication_fraction: float | None = None

    def as_dict(self, burst: Burst) -> dict:
        ttft = sorted(self.ttft)
        out = {
            "seconds": round(self.seconds, 3),
            "output_tok_per_s": round(burst.num_output_tokens / self.seconds, 1),
            "ttft_mean_ms": round(1000 * statistics.fmean(ttft), 1),
            "ttft_p99_ms": round(1000 * percentile(ttft, 0.99), 1),
            "prompt_tokens_computed": self.prompt_tokens_computed,
            "cached_tokens": self.cached_tokens,
        }
        if self.peak_duplication_tokens is not None:
            out["peak_duplication_tokens"] = self.peak_duplication_tokens
            out["peak_duplication_fraction"] = round(self.peak_duplication_fraction, 4)
        return out


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile of sorted ``values``."""
    return values[min(len(values) - 1, max(0, int(round(q * len(values))) - 1))]


def run_pagedllm(engine, burst: Burst) -> BurstResult:
    """One burst through an ``LLMEngine``: add all, step until done."""
    from pagedllm import SamplingParams

    engine.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=burst.max_tokens, ignore_eos=True)
    start = time.perf_counter()
    for i, prompt in enumerate(burst.prompts):
        engine.add_request(f"b{i}", prompt, params)
    first: dict[str, float] = {}
    cached: dict[str, int] = {}
    peak_tokens, peak_fraction = 0, 0.0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.outputs[0].token_ids and out.request_id not in first:
                first[out.request_id] = now - start
            cached[out.request_id] = out.num_cached_tokens
        waste = engine.get_stats().waste
        if waste.duplication_tokens is not None and waste.duplication_tokens > peak_tokens:
            peak_tokens, peak_fraction = waste.duplication_tokens, waste.duplication_fraction
    seconds = time.perf_counter() - start
    num_cached = sum(cached.values())
    return BurstResult(
        seconds,
        list(first.values()),
        sum(len(p) for p in burst.prompts) - num_cached,
        num_cached,
        peak_tokens,
        peak_fraction,
    )


# vLLM in its own environment: loads the model, warms up, says VLLM_READY, then runs one
# burst per "run" line through its LLMEngine (add all, step until done), VLLM_RESULT.
VLLM_SCRIPT = r"""
import json, sys, time


def burst(llm, SamplingParams, spec, prompts, max_tokens):
    engine = llm.llm_engine
    llm.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"b{i}", {"prompt_token_ids": p}, params)
    first, cached = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            if out.outputs and out.outputs[0].token_ids and out.request_id not in first:
                first[out.request_id] = now - start
            if out.num_cached_tokens is not None:
                cached[out.request_id] = out.num_cached_tokens
    return {"seconds": time.perf_counter() - start, "ttft": list(first.values()),
            "cached_tokens": sum(cached.values())}


def main():
    spec = json.load(open(sys.argv[1]))
    from vllm import LLM, SamplingParams
    llm = LLM(model=spec["model"], dtype=spec["dtype"], seed=0, enable_prefix_caching=True,
              max_model_len=spec["max_model_len"])
    burst(llm, SamplingParams, spec, spec["prompts"][:2], 2)
    print("VLLM_READY {}", flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        result = burst(llm, SamplingParams, spec, spec["prompts"], spec["max_tokens"])
        print("VLLM_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
"""


def start_vllm(python: str, model: Path, dtype: str, burst: Burst, max_model_len: int):
    """vLLM loaded in its child process; returns a function that runs one burst there."""
    spec = {
        "model": str(model),
        "dtype": dtype,
        "prompts": burst.prompts,
        "max_tokens": burst.max_tokens,
        "max_model_len": max_model_len,
    }
    child = VllmChild(python, VLLM_SCRIPT, spec)
    total = sum(len(p) for p in burst.prompts)

    def run() -> BurstResult:
        r = child.ask("run")
        return BurstResult(r["seconds"], r["ttft"], total - r["cached_tokens"], r["cached_tokens"])

    return run, child.close


def build_engine(args: argparse.Namespace, model: Path, sharing: bool):
    from pagedllm.engine.args import parse_size
    from pagedllm.engine.config import EngineConfig
    from pagedllm.engine.llm_engine import LLMEngine

    config = EngineConfig(
        model=str(model),
        dtype=args.dtype,
        kv_cache_memory=parse_size(args.kv_cache_memory),
        max_model_len=args.max_model_len,
        enable_inflight_sharing=sharing,
    )
    return LLMEngine.from_config(config)


def median_result(results: list[BurstResult], burst: Burst) -> dict:
    """Every figure's median over the rounds (each figure on its own)."""
    dicts = [r.as_dict(burst) for r in results]
    return {k: statistics.median(d[k] for d in dicts) for k in dicts[0]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-requests", type=int, default=24)
    parser.add_argument("--prefix-len", type=int, default=400)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--kv-cache-memory", default="64MiB")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--vs-vllm", metavar="PYTHON", help="interpreter with vLLM installed")
    args = parser.parse_args(argv)

    from pagedllm.model.default_model import ensure_default_model

    model = ensure_default_model() if args.model == "default" else Path(args.model)
    burst = make_burst(args.num_requests, args.prefix_len, args.max_tokens)
    if args.max_model_len is None:
        args.max_model_len = args.prefix_len + 64 + args.max_tokens
    runners = {
        "on": build_engine(args, model, True),
        "off": build_engine(args, model, False),
    }
    for engine in runners.values():  # warm-up: kernels built, buffers sized
        run_pagedllm(engine, make_burst(2, 32, 2, seed=1))
    vllm, close_vllm = None, None
    if args.vs_vllm:
        vllm, close_vllm = start_vllm(args.vs_vllm, model, args.dtype, burst, args.max_model_len)
    results: dict[str, list[BurstResult]] = {"on": [], "off": [], "vllm": []}
    try:
        for r in range(args.rounds):
            order = ["on", "off", "vllm"] if r % 2 == 0 else ["vllm", "off", "on"]
            for name in order:
                if name == "vllm":
                    if vllm is not None:
                        results[name].append(vllm())
                else:
                    results[name].append(run_pagedllm(runners[name], burst))
    finally:
        if close_vllm is not None:
            close_vllm()
    report(args, burst, {k: v for k, v in results.items() if v})
    return 0


def report(args: argparse.Namespace, burst: Burst, results: dict[str, list[BurstResult]]) -> None:
    medians = {name: median_result(rs, burst) for name, rs in results.items()}
    cols = ["output_tok_per_s", "ttft_mean_ms", "ttft_p99_ms", "prompt_tokens_computed"]
    cols += ["cached_tokens", "peak_duplication_tokens", "peak_duplication_fraction"]
    print(
        f"burst: {len(burst.prompts)} requests, {args.prefix_len}-token shared prefix, "
        f"{burst.max_tokens} output tokens each, {args.dtype}, pool {args.kv_cache_memory}, "
        f"{args.rounds} rounds (medians)"
    )
    print(f"{'':8}" + "".join(f"{c:>26}" for c in cols))
    for name, m in medians.items():
        print(f"{name:8}" + "".join(f"{m.get(c, '-')!s:>26}" for c in cols))
    ratios = {}
    for other in ("off", "vllm"):
        if other in results:
            ratios[f"on/{other}"] = {
                "output_tok_per_s": ratio_median(results["on"], results[other], "seconds", True),
                "ttft_mean": ratio_median(results["on"], results[other], "ttft_mean_ms", False),
            }
    for key, value in ratios.items():
        print(
            f"{key}: throughput x{value['output_tok_per_s']:.2f}, TTFT mean x{value['ttft_mean']:.2f}"
        )
    print(json.dumps({"burst": medians, "ratios": ratios, "cpu": cpu_info().label}))


def ratio_median(
    mine: list[BurstResult], other: list[BurstResult], key: str, invert: bool
) -> float:
    """Median over rounds of mine/other for ``key`` (``invert``: other/mine, for times)."""
    pairs = []
    for m, o in zip(mine, other, strict=False):
        if key == "seconds":
            a, b = m.seconds, o.seconds
        else:
            a, b = statistics.fmean(m.ttft), statistics.fmean(o.ttft)
        pairs.append(b / a if invert else a / b)
    return round(statistics.median(pairs), 3)


if __name__ == "__main__":
    sys.exit(main())
