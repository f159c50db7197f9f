"""The elastic KV pool on the default model: shrink under load, grow, idle, copy cost.

Parts (``--part``, default all), each printed as a table; one JSON line at the end:

- ``shrink``: ``--num-requests`` (16) greedy requests of ``--prompt-len`` random token ids
  generate ``--max-tokens`` each in a ``--pool`` (3GiB) cache whose free list was first
  shuffled (the block order of a pool after long churn, so live blocks lie all over it).
  After ``--warm-steps`` steps the pool is shrunk to ``--target`` (0.5GiB) in slices
  between steps. Reported: whether every output equals the run without the shrink, failed
  requests, the shrink's report (blocks moved, ms), resident memory (``VmRSS``) against
  the bytes released within 2 s of the request, and output tokens per second during the
  shrink's steps against the steady steps before it. ``--long`` adds the same at 4k-token
  contexts (``--long-requests`` requests of 4096 - max_tokens prompt tokens). One engine
  runs the requests once without the shrink, then ``--rounds`` times with it (grown back,
  prompt cache reset, free list shuffled again); figures are medians of those rounds, with
  the range.
- ``grow``: the pool grown by ``--grow`` (2GiB) and shrunk back, ``--rounds`` times: the
  call's ms, then the ms of the background fault-in of the new pages.
- ``idle``: automatic mode ``--auto-range`` (``MIN:MAX``): a peak of requests that share
  prefixes grows the pool; after the idle period the pool holds ``blocks_total`` against
  the packed minimum (blocks used + cached).
- ``timeline``: the same peak-then-idle load with a fixed pool of MAX and in automatic
  mode: resident memory over time.
- ``copy``: the worker's block copy (compaction's cost) per GiB moved, slices of 64, 256,
  1024 random blocks in the model's cache layout (medians of ``--rounds``).

    .venv/bin/python benchmarks/elastic.py [--part shrink] [--long] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from pagedllm.engine.args import parse_size, parse_size_range  # noqa: E402
from pagedllm.engine.config import EngineConfig  # noqa: E402
from pagedllm.engine.elastic import process_resident_bytes  # noqa: E402
from pagedllm.engine.llm_engine import LLMEngine  # noqa: E402
from pagedllm.kernels.probe import cpu_info  # noqa: E402
from pagedllm.sampling_params import SamplingParams  # noqa: E402

MIB = 1 << 20
GIB = 1 << 30


def build(args: argparse.Namespace, **config: Any) -> LLMEngine:
    config.setdefault("max_num_seqs", 64)
    config.setdefault("max_model_len", 4096)
    return LLMEngine.from_config(
        EngineConfig(model=args.model, dtype=args.dtype, num_threads=args.threads, **config)
    )


def shuffle_free_list(engine: LLMEngine, seed: int) -> None:
    """Hand out every block and take them back in random order: allocation then follows
    that order, as in a pool after long churn."""
    pool = engine.kv.pool
    blocks = pool.allocate(pool.num_free_blocks)
    random.Random(seed).shuffle(blocks)
    pool.decref(blocks)


def prompts_of(num: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randint(100, 20000) for _ in range(length)] for _ in range(num)]


def rss() -> int:
    return process_resident_bytes() or 0


# ---- shrink under load ------------------------------------------------------------------


def generate(
    engine: LLMEngine,
    prompts: list[list[int]],
    max_tokens: int,
    *,
    shrink_to: int | None = None,
    warm_steps: int = 0,
) -> dict[str, Any]:
    """Run the requests to the end; with ``shrink_to``, start a shrink after
    ``warm_steps`` steps. Per step: wall time, new output tokens, resizing or not."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, params)
    seen: dict[str, int] = {}
    final: dict[str, Any] = {}
    steps, samples, reports = [], [], []
    started_at = None
    step = 0
    while engine.has_unfinished_requests():
        if shrink_to is not None and step == warm_steps:
            started_at = time.perf_counter()
            samples.append((0.0, rss()))
            engine.elastic.start(shrink_to, on_done=reports.append)
        resizing = engine.elastic.resizing
        begin = time.perf_counter()
        outputs = engine.step()
        wall = time.perf_counter() - begin
        new = 0
        for out in outputs:
            count = len(out.outputs[0].token_ids)
            new += count - seen.get(out.request_id, 0)
            seen[out.request_id] = count
            if out.finished:
                final[out.request_id] = out
        steps.append((wall, new, resizing or engine.elastic.resizing))
        if started_at is not None:
            samples.append((time.perf_counter() - started_at, rss()))
        step += 1
    failed = sum(1 for out in final.values() if out.error is not None)
    tokens = [tuple(final[str(i)].outputs[0].token_ids) for i in range(len(prompts))]
    return dict(tokens=tokens, failed=failed, steps=steps, rss=samples, reports=reports)


def shrink_case(args: argparse.Namespace, num: int, prompt_len: int, max_tokens: int) -> dict:
    """One engine: a run without the shrink, then ``--rounds`` runs with it (the pool grown
    back, the prompt cache reset and the free list shuffled again before each)."""
    prompts = prompts_of(num, prompt_len, args.seed)
    pool, target = parse_size(args.pool), parse_size(args.target)
    engine = build(args, kv_cache_memory=pool)
    rounds = []
    plain = None
    for i in range(args.rounds + 1):
        engine.reset_prefix_cache()
        if engine.kv.num_blocks * engine.runner.kv_block_bytes < pool:
            engine.elastic.resize(pool)
            engine.runner.kv_cache.arena.wait_populated()
        shuffle_free_list(engine, args.seed + i)
        run = generate(
            engine,
            prompts,
            max_tokens,
            shrink_to=target if i else None,
            warm_steps=args.warm_steps,
        )
        if i == 0:
            plain = run
        else:
            rounds.append(_shrink_round(args, run, plain))
    del engine
    result = {"requests": num, "context": prompt_len + max_tokens}
    result["identical"] = all(r["identical"] for r in rounds)
    result["failed"] = sum(r["failed"] for r in rounds)
    for key in rounds[0]:
        if key in ("identical", "failed", "blocks", "limited_by"):
            result.setdefault(key, rounds[0][key])
            continue
        values = [r[key] for r in rounds]
        result[key] = statistics.median(values)
        if key in ("shrink_ms", "throughput_ratio", "rss_drop_fraction", "blocks_moved"):
            result[f"{key}_range"] = f"{_fmt(min(values))}..{_fmt(max(values))}"
    return result


def _shrink_round(args: argparse.Namespace, run: dict, plain: dict) -> dict:
    (report,) = run["reports"]
    released = report.bytes_returned
    before = run["rss"][0][1]
    within = [r for t, r in run["rss"] if t <= 2.0]
    drop = before - min(within)
    # Decode steps only (the warm-up holds the prefill): steady = before the shrink.
    decode = [(w, n, r) for w, n, r in run["steps"][args.warm_steps // 2 :] if n]
    steady = [n / w for w, n, r in decode if not r]
    during = [n / w for w, n, r in decode if r]
    return {
        "identical": run["tokens"] == plain["tokens"],
        "failed": run["failed"],
        "blocks": f"{report.blocks_before} -> {report.blocks_after}",
        "blocks_moved": report.blocks_moved,
        "moved_mib": report.blocks_moved * report.bytes_per_block / MIB,
        "shrink_ms": report.duration_ms,
        "slices": report.num_slices,
        "released_mib": released / MIB,
        "rss_drop_mib_2s": drop / MIB,
        "rss_drop_fraction": drop / released if released else 0.0,
        "steady_tok_s": statistics.median(steady) if steady else 0.0,
        "during_tok_s": statistics.median(during) if during else 0.0,
        "during_steps": len(during),
        "throughput_ratio": (
            statistics.median(during) / statistics.median(steady) if during and steady else 0.0
        ),
        "limited_by": report.limited_by,
    }


def part_shrink(args: argparse.Namespace) -> list[dict]:
    cases = [shrink_case(args, args.num_requests, args.prompt_len, args.max_tokens)]
    if args.long:
        cases.append(shrink_case(args, args.long_requests, 4096 - args.max_tokens, args.max_tokens))
    print(
        f"\nshrink {args.pool} -> {args.target} while requests generate, medians of {args.rounds}"
    )
    keys = list(cases[0])
    for key in keys:
        print(f"  {key:24s}" + "".join(f"{_fmt(c[key]):>22s}" for c in cases))
    return cases


# ---- grow -------------------------------------------------------------------------------


def part_grow(args: argparse.Namespace) -> dict:
    """Grow by ``--grow`` and shrink back, ``--rounds`` times on one engine."""
    pool, extra = parse_size(args.target), parse_size(args.grow)
    engine = build(args, kv_cache_memory=pool)
    calls, faults, growth = [], [], []
    for _ in range(args.rounds):
        before = rss()
        begin = time.perf_counter()
        report = engine.elastic.resize(pool + extra)
        calls.append((time.perf_counter() - begin) * 1e3)
        engine.runner.kv_cache.arena.wait_populated()
        faults.append((time.perf_counter() - begin) * 1e3)
        growth.append((rss() - before) / MIB)
        engine.elastic.resize(pool)
    result = {
        "grow_mib": extra / MIB,
        "blocks": f"{report.blocks_before} -> {report.blocks_after}",
        "call_ms": statistics.median(calls),
        "call_ms_range": f"{min(calls):.1f}..{max(calls):.1f}",
        "faulted_in_ms": statistics.median(faults),
        "faulted_in_ms_range": f"{min(faults):.0f}..{max(faults):.0f}",
        "rss_growth_mib": statistics.median(growth),
    }
    print(f"\ngrow {args.target} by {args.grow}, medians of {args.rounds}")
    for key, value in result.items():
        print(f"  {key:20s}{_fmt(value):>16s}")
    return result


# ---- automatic mode: peak, then idle ----------------------------------------------------


def peak_load(engine: LLMEngine, args: argparse.Namespace, idle_s: float) -> list[tuple]:
    """A peak of requests sharing a few system prompts, then idle; RSS sampled at every
    step and every 50 ms of the idle tail (the server's timer ticks the policy)."""
    rng = random.Random(args.seed)
    systems = prompts_of(4, 512, args.seed + 1)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for i in range(args.peak_requests):
        tail = [rng.randint(100, 20000) for _ in range(rng.randint(64, 1024))]
        engine.add_request(f"peak{i}", systems[i % 4] + tail, params)
    start = time.perf_counter()
    samples = [(0.0, rss(), engine.kv.num_blocks)]
    while engine.has_unfinished_requests():
        engine.step()
        samples.append((time.perf_counter() - start, rss(), engine.kv.num_blocks))
    idle_from = time.perf_counter()
    while time.perf_counter() - idle_from < idle_s:
        time.sleep(0.05)
        engine.elastic.idle_tick()
        samples.append((time.perf_counter() - start, rss(), engine.kv.num_blocks))
    return samples


def part_idle(args: argparse.Namespace) -> dict:
    low, high = parse_size_range(args.auto_range)
    engine = build(args, kv_cache_memory=low, kv_cache_memory_max=high, elastic_idle_s=1.0)
    peak_load(engine, args, idle_s=1.5)
    stats = engine.get_stats()
    cache = stats.cache
    packed = cache.blocks_used + cache.blocks_cached_free
    result = {
        "range": args.auto_range,
        "peak_blocks": max(e.blocks_after for e in stats.elastic.events),
        "grows": stats.elastic.num_grows,
        "shrinks": stats.elastic.num_shrinks,
        "blocks_after_idle": cache.blocks_total,
        "packed_blocks": packed,
        "held_over_packed": cache.blocks_total / max(1, packed),
        "cached_prefix_blocks": cache.blocks_cached_free,
        "last_shrink_ms": stats.elastic.last_resize.duration_ms,
    }
    print(f"\nautomatic mode {args.auto_range}: after the idle period")
    for key, value in result.items():
        print(f"  {key:22s}{_fmt(value):>16s}")
    return result


def part_timeline(args: argparse.Namespace) -> dict:
    low, high = parse_size_range(args.auto_range)
    series = {}
    for name, config in (
        ("fixed", dict(kv_cache_memory=high)),
        ("elastic", dict(kv_cache_memory=low, kv_cache_memory_max=high, elastic_idle_s=1.0)),
    ):
        engine = build(args, **config)
        series[name] = peak_load(engine, args, idle_s=2.0)
        del engine
    print("\nresident memory over time (MiB), peak then idle")
    print(f"  {'':8s}{'t (s)':>8s}{'RSS':>10s}{'blocks':>9s}")
    summary = {}
    for name, samples in series.items():
        step = max(1, len(samples) // 8)
        for t, r, blocks in samples[::step] + [samples[-1]]:
            print(f"  {name:8s}{t:8.2f}{r / MIB:10.0f}{blocks:9d}")
        summary[name] = {
            "peak_rss_mib": max(r for _, r, _ in samples) / MIB,
            "end_rss_mib": samples[-1][1] / MIB,
        }
    return summary


# ---- block copy cost --------------------------------------------------------------------


def part_copy(args: argparse.Namespace) -> dict:
    engine = build(args, kv_cache_memory=parse_size(args.pool))
    cache = engine.runner.kv_cache
    block = engine.runner.kv_block_bytes
    n = cache.num_blocks
    rng = random.Random(args.seed)
    result = {}
    for count in (64, 256, 1024):
        times = []
        for _ in range(args.rounds):
            ids = rng.sample(range(n), 2 * count)
            pairs = list(zip(ids[:count], ids[count:], strict=True))
            begin = time.perf_counter()
            cache.copy_blocks(pairs)
            times.append(time.perf_counter() - begin)
        seconds = statistics.median(times)
        result[count] = {
            "ms": seconds * 1e3,
            "s_per_gib": seconds / (count * block / GIB),
            "spread_ms": (max(times) - min(times)) * 1e3,
        }
    print(f"\nblock copy (compaction), {block / 1024:.0f} KiB blocks, medians of {args.rounds}")
    for count, r in result.items():
        print(
            f"  {count:5d} blocks  {r['ms']:8.2f} ms  {r['s_per_gib']:6.3f} s/GiB  "
            f"(spread {r['spread_ms']:.2f} ms)"
        )
    return result


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=["shrink", "grow", "idle", "timeline", "copy", "all"])
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--pool", default="3GiB")
    parser.add_argument("--target", default="0.5GiB")
    parser.add_argument("--grow", default="2GiB")
    parser.add_argument("--auto-range", default="64MiB:3GiB")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--warm-steps", type=int, default=24)
    parser.add_argument("--long", action="store_true", help="also at 4k-token contexts")
    parser.add_argument("--long-requests", type=int, default=4)
    parser.add_argument("--peak-requests", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    part = args.part or "all"
    results: dict[str, Any] = {"cpu": f"{cpu_info().label}, {os.cpu_count()} cores"}
    for name, fn in (
        ("shrink", part_shrink),
        ("grow", part_grow),
        ("idle", part_idle),
        ("timeline", part_timeline),
        ("copy", part_copy),
    ):
        if part in (name, "all"):
            results[name] = fn(args)
    print(json.dumps(results, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
