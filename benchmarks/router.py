"""Prefix-aware routing vs round robin (and least loaded, and an oracle in simulation).

Two parts, each printing a table; one JSON line at the end carries every figure.

**Real replicas** (``--replicas N``, 2-4): N ``pagedllm serve`` processes (one thread each)
and ``pagedllm router`` in front, one router per policy over the same replicas. Workload
(seeded): ``--tenants`` T system prompts of ``--prefix-len`` token ids, each followed by a
private question of 16-48 ids, ``--requests-per-tenant`` per tenant in shuffled order, sent
``--concurrency`` at a time, ``--max-tokens`` greedy tokens each. Every round of every
policy uses fresh prefixes (another seed), so the caches the previous run left are no help.
Per run: prefix hit rate (cached / prompt tokens, from the replicas' ``usage``), TTFT
(mean, p90), output tok/s over the run's wall time, and how far the router's predicted
cached tokens were from what the replicas reported: predicted when routing, and replayed
to where each replica looked the prompt up (``cache_event_seq``; it checks the hashing
itself, and must be exact). Medians over ``--rounds``, policies alternated.

**Simulation** (``planner/replicas.py``): the real scheduler and block manager per replica,
fabricated tokens, the same routing code; the shared-prefix workload and, with
``--trace PATH``, a JSONL trace (Mooncake's ``hash_ids``: each id becomes
``--tokens-per-hash`` ids) through 2 and 4 replicas, with the oracle that routes on every
replica's true cache.

``--variant NAME=FLAGS`` (repeatable) starts one set of replicas per variant, each with
those extra ``pagedllm serve`` flags, and alternates the variants within every round, their
order reversed every other round (A/B on the same host drift): for example ``--variant pins= --variant
nopins=--no-pin-waiting-prefixes``. ``--router-flags NAME=FLAGS`` gives variant NAME's
routers extra ``pagedllm router`` flags: ``--variant stream= --variant poll=
--router-flags poll=--cache-events=poll`` compares the pushed view with the polled one.
Each misprediction is counted where the replica's index changed: *before arrival* (the
view was behind when routing, or the index changed while the request travelled) or *in
the queue* (``arrival_event_seq``, see server/router.py).

    .venv/bin/python benchmarks/router.py --replicas 4 --rounds 3 \\
        --trace ../shared/data/mooncake_synthetic_trace.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx  # noqa: E402

from pagedllm.kernels.probe import cpu_info  # noqa: E402
from pagedllm.planner.replicas import (  # noqa: E402
    SIM_POLICIES,
    RouterSimConfig,
    SimRequest,
    read_routed_trace,
    simulate_router,
)
from pagedllm.planner.simulate import CostModel  # noqa: E402
from pagedllm.util.net import free_port  # noqa: E402
from serve_vs_vllm import wait_healthy  # noqa: E402

REAL_POLICIES = ("prefix_aware", "round_robin", "least_loaded")


@dataclass(frozen=True, slots=True)
class RunResult:
    policy: str
    hit_rate: float
    ttft_mean_s: float
    ttft_p90_s: float
    output_tok_s: float
    predicted_error: float  # |predicted when routing - reported| / reported cached tokens
    replayed_error: float  # the same for the view replayed to each replica's lookup
    unreplayed: int  # answers the router could not replay
    requests_per_replica: list[int]
    pins_given_up: int = 0  # the replicas' waiting requests' pins released for room
    before_arrival_error: float = 0.0  # the predicted error's share whose miss came before
    in_queue_error: float = 0.0  # arrival / in the queue (of reported cached tokens)


def workload(args: argparse.Namespace, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [
        [rng.randint(100, 20000) for _ in range(args.prefix_len)] for _ in range(args.tenants)
    ]
    order = [t for t in range(args.tenants) for _ in range(args.requests_per_tenant)]
    rng.shuffle(order)
    return [
        prefixes[t] + [rng.randint(100, 20000) for _ in range(rng.randint(16, 48))] for t in order
    ]


def start(argv: list[str]) -> subprocess.Popen:
    command = [sys.executable, "-m", "pagedllm.cli", *argv, "--log-level", "warning"]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL)


async def one_request(client: httpx.AsyncClient, base: str, prompt: list[int], max_tokens: int):
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    start_t = time.perf_counter()
    first = None
    usage: dict[str, Any] = {}
    async with client.stream("POST", f"{base}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("choices") and first is None:
                first = time.perf_counter() - start_t
            if event.get("usage"):
                usage = event["usage"]
    return first, usage


async def drive(base: str, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    queue = list(prompts)
    ttfts: list[float] = []
    prompt_tokens = cached = output = 0
    async with httpx.AsyncClient(timeout=600) as client:

        async def worker() -> None:
            nonlocal prompt_tokens, cached, output
            while queue:
                ttft, usage = await one_request(client, base, queue.pop(0), args.max_tokens)
                ttfts.append(ttft)
                prompt_tokens += usage["prompt_tokens"]
                output += usage["completion_tokens"]
                cached += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)

        start_t = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        wall = time.perf_counter() - start_t
        report = (await client.get(f"{base}/v1/router")).json()
    ttfts.sort()
    return {
        "hit_rate": cached / prompt_tokens,
        "ttft_mean_s": statistics.fmean(ttfts),
        "ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))],
        "output_tok_s": output / wall,
        "report": report,
    }


def parse_variants(specs: list[str]) -> dict[str, list[str]]:
    """``NAME=FLAGS`` -> {NAME: flags split on spaces}; none given: one, no extra flags."""
    return parse_flags(specs or ["default="])


def parse_flags(specs: list[str]) -> dict[str, list[str]]:
    variants = {}
    for spec in specs:
        name, sep, flags = spec.partition("=")
        if not sep or not name:
            raise SystemExit(f"--variant takes NAME=FLAGS, got {spec!r}")
        variants[name] = flags.split()
    return variants


def run_real(args: argparse.Namespace) -> dict[str, list[RunResult]]:
    variants = parse_variants(args.variant)
    router_flags = parse_flags(args.router_flags)
    if set(router_flags) - set(variants):
        raise SystemExit(f"--router-flags names no --variant: {sorted(router_flags)}")
    policies = args.policies.split(",")
    engine = ["--model", args.model, "--dtype", args.dtype, "--num-threads", "1",
              "--block-size", str(args.block_size), "--num-blocks", str(args.num_blocks)]  # fmt: skip
    urls: dict[str, list[str]] = {}
    replicas: list[subprocess.Popen] = []
    for name, flags in variants.items():
        ports = [free_port() for _ in range(args.replicas)]
        urls[name] = [f"http://127.0.0.1:{p}" for p in ports]
        replicas += [start(["serve", *engine, *flags, "--port", str(p)]) for p in ports]
    keys = [run_key(v, p, len(variants)) for v in variants for p in policies]
    results: dict[str, list[RunResult]] = {key: [] for key in keys}
    try:
        for url, proc in zip([u for us in urls.values() for u in us], replicas, strict=True):
            wait_healthy(url, proc, timeout=300)
        seed = 1000
        for round_index in range(args.rounds):
            # variants in turn, the order reversed every other round (A B, B A, ...)
            order = list(variants)[:: -1 if round_index % 2 else 1]
            for policy in policies:
                seed += 1
                prompts = workload(args, seed)  # every variant gets the same prompts
                for name in order:
                    key = run_key(name, policy, len(variants))
                    flags = router_flags.get(name, [])
                    results[key].append(real_run(args, urls[name], policy, prompts, flags))
                    print(f"  {key}: {asdict(results[key][-1])}", file=sys.stderr)
    finally:
        for proc in replicas:
            proc.terminate()
        for proc in replicas:
            proc.wait(60)
    return results


def run_key(variant: str, policy: str, num_variants: int) -> str:
    return f"{variant}/{policy}" if num_variants > 1 else policy


def pins_given_up(urls: list[str]) -> int:
    """The replicas' count of pins given up so far (0 from a replica that has none)."""
    return sum(httpx.get(f"{url}/v1/cache").json().get("pins_given_up", 0) for url in urls)


def real_run(
    args: argparse.Namespace, urls: list[str], policy: str, prompts: list, flags: list[str]
) -> RunResult:
    port = free_port()
    replica_flags = [flag for url in urls for flag in ("--replica", url)]
    router = start(["router", "--port", str(port), "--routing-policy", policy,
                    "--tokenizer", args.model, *replica_flags, *flags])  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, router, timeout=300)
        given_up = pins_given_up(urls)
        out = asyncio.run(drive(base, prompts, args))
        given_up = pins_given_up(urls) - given_up
    finally:
        router.terminate()
        router.wait(60)
    replicas = out["report"]["replicas"]
    predicted = sum(r["predicted_cached_tokens"] for r in replicas)
    replayed = sum(r["replayed_cached_tokens"] for r in replicas)
    reported = sum(r["reported_cached_tokens"] for r in replicas)
    before = sum(r["missed_before_arrival_tokens"] for r in replicas)
    queued = sum(r["missed_in_queue_tokens"] for r in replicas)
    return RunResult(
        policy=policy,
        hit_rate=out["hit_rate"],
        ttft_mean_s=out["ttft_mean_s"],
        ttft_p90_s=out["ttft_p90_s"],
        output_tok_s=out["output_tok_s"],
        predicted_error=abs(predicted - reported) / reported if reported else 0.0,
        replayed_error=abs(replayed - reported) / reported if reported else 0.0,
        unreplayed=sum(r["unreplayed_requests"] for r in replicas),
        requests_per_replica=[r["requests"] for r in replicas],
        pins_given_up=given_up,
        before_arrival_error=before / reported if reported else 0.0,
        in_queue_error=queued / reported if reported else 0.0,
    )


def run_simulation(
    name: str, requests: list[SimRequest], num_blocks: int, args: argparse.Namespace
) -> list[dict[str, Any]]:
    rows = []
    for num_replicas in (2, 4):
        for policy in SIM_POLICIES:
            config = RouterSimConfig(
                num_replicas, policy, num_blocks=num_blocks, block_size=args.block_size,
                max_model_len=1 << 20, cost=CostModel(args.step_ms, args.token_ms),
                event_delay_s=args.event_delay,
            )  # fmt: skip
            result = simulate_router(requests, config)
            rows.append({"workload": name, **asdict(result)})
    return rows


def med(values: list[float]) -> float:
    return statistics.median(values)


def print_real(results: dict[str, list[RunResult]], args: argparse.Namespace) -> dict[str, Any]:
    print(f"\nreal replicas: {args.replicas} x pagedllm serve ({args.model}, {args.dtype}, 1 thread "
          f"each; CPU: {cpu_info().label}, {os.cpu_count()} cores), {args.tenants} tenants x "
          f"{args.requests_per_tenant} requests, prefix {args.prefix_len} tokens, "
          f"concurrency {args.concurrency}; medians of {args.rounds} rounds (min-max)")  # fmt: skip
    print(f"{'policy':<22} {'hit rate':>18} {'TTFT mean s':>20} {'TTFT p90 s':>11} "
          f"{'out tok/s':>16} {'pred. err':>17} {'replay err':>10} {'pins given up':>14} "
          f"{'before arrival':>17} {'in queue':>17}")  # fmt: skip
    summary = {}
    for policy, runs in results.items():
        hits = [r.hit_rate for r in runs]
        ttft = [r.ttft_mean_s for r in runs]
        tput = [r.output_tok_s for r in runs]
        print(f"{policy:<22} {med(hits):>7.1%} ({min(hits):.0%}-{max(hits):.0%}) "
              f"{med(ttft):>8.3f} ({min(ttft):.2f}-{max(ttft):.2f}) "
              f"{med([r.ttft_p90_s for r in runs]):>11.3f} "
              f"{med(tput):>7.1f} ({min(tput):.0f}-{max(tput):.0f}) "
              f"{', '.join(f'{r.predicted_error:.2%}' for r in runs):>17} "
              f"{max(r.replayed_error for r in runs):>10.2%} "
              f"{', '.join(str(r.pins_given_up) for r in runs):>14} "
              f"{', '.join(f'{r.before_arrival_error:.2%}' for r in runs):>17} "
              f"{', '.join(f'{r.in_queue_error:.2%}' for r in runs):>17}")  # fmt: skip
        summary[policy] = {"runs": [asdict(r) for r in runs]}
    for a_key, b_key in ratio_pairs(list(results)):
        aware, other = results[a_key], results[b_key]
        ratios = {
            name: med([getattr(a, name) / max(getattr(b, name), 1e-9)
                       for a, b in zip(aware, other, strict=True)])
            for name in ("hit_rate", "ttft_mean_s", "output_tok_s")
        }  # fmt: skip
        print(f"{a_key} / {b_key} per round (median): hit rate x{ratios['hit_rate']:.2f}, "
              f"TTFT x{ratios['ttft_mean_s']:.2f}, output tok/s x{ratios['output_tok_s']:.2f}")  # fmt: skip
        summary[f"{a_key} / {b_key}"] = ratios
    return summary


def ratio_pairs(keys: list[str]) -> list[tuple[str, str]]:
    """prefix_aware over round_robin within each variant, and each variant over the first
    for the same policy."""
    pairs = []
    prefix = [k.rpartition("/")[0] for k in keys if k.endswith("prefix_aware")]
    for variant in prefix:
        head = f"{variant}/" if variant else ""
        if f"{head}round_robin" in keys:
            pairs.append((f"{head}prefix_aware", f"{head}round_robin"))
    variants = list(dict.fromkeys(k.rpartition("/")[0] for k in keys if "/" in k))
    for variant in variants[1:]:
        for key in keys:
            first, _, policy = key.partition("/")
            if first == variants[0]:
                pairs.append((f"{variants[0]}/{policy}", f"{variant}/{policy}"))
    return pairs


def print_simulation(rows: list[dict[str, Any]]) -> None:
    print(f"\n{'workload':<14} {'N':>2} {'policy':<13} {'hit rate':>9} {'pred/real':>9} "
          f"{'TTFT mean s':>11} {'TTFT p99 s':>10} {'out tok/s':>10}  requests per replica")  # fmt: skip
    for row in rows:
        pred = row["predicted_cached_tokens"] / max(1, row["cached_tokens"])
        print(f"{row['workload']:<14} {row['num_replicas']:>2} {row['policy']:<13} "
              f"{row['hit_rate']:>9.1%} {pred:>9.3f} {row['ttft_mean_s']:>11.3f} "
              f"{row['ttft_p99_s']:>10.3f} {row['output_tokens_per_s']:>10.0f}  "
              f"{row['requests_per_replica']}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--replicas", type=int, default=4, help="real replicas (0: simulation only)"
    )
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=96, help="KV blocks per replica")
    parser.add_argument("--tenants", type=int, default=12)
    parser.add_argument("--requests-per-tenant", type=int, default=4)
    parser.add_argument("--prefix-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--trace", default=None, help="JSONL trace for the simulation")
    parser.add_argument("--trace-requests", type=int, default=None)
    parser.add_argument("--skip-simulation", action="store_true")
    parser.add_argument("--tokens-per-hash", type=int, default=16)
    parser.add_argument("--trace-blocks", type=int, default=4000,
                        help="KV blocks per simulated replica for the trace")  # fmt: skip
    parser.add_argument("--event-delay", type=float, default=0.1,
                        help="simulated router's view of the caches lags by this (s)")  # fmt: skip
    parser.add_argument("--policies", default=",".join(REAL_POLICIES),
                        help="real replicas: comma-separated routing policies")  # fmt: skip
    parser.add_argument("--variant", action="append", default=[],
                        help="NAME=FLAGS: a replica set with extra serve flags (repeatable)")  # fmt: skip
    parser.add_argument("--router-flags", action="append", default=[],
                        help="NAME=FLAGS: extra router flags for variant NAME (repeatable)")  # fmt: skip
    parser.add_argument("--step-ms", type=float, default=10.0)
    parser.add_argument("--token-ms", type=float, default=0.05)
    args = parser.parse_args()
    if args.replicas and not 2 <= args.replicas <= 4:
        raise SystemExit("--replicas takes 2 to 4 (or 0)")
    out: dict[str, Any] = {"bench": "router", "args": vars(args)}
    shared = [
        SimRequest(0.02 * i, tuple(p), args.max_tokens)
        for i, p in enumerate(workload(args, seed=7) * 3)
    ]
    rows = (
        []
        if args.skip_simulation
        else run_simulation("shared-prefix", shared, args.num_blocks, args)
    )
    if args.trace and not args.skip_simulation:
        trace = read_routed_trace(
            args.trace, tokens_per_hash=args.tokens_per_hash, limit=args.trace_requests
        )
        rows += run_simulation(Path(args.trace).stem[:14], trace, args.trace_blocks, args)
    if rows:
        print_simulation(rows)
        out["simulation"] = rows
    if args.replicas:
        out["real"] = print_real(run_real(args), args)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
