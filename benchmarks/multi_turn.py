"""Sessions that pause and resume: multi-turn chat with and without the disk tier.

Three modes, each printing a table and one JSON line:

**multi-turn** (default). ``--users`` U users x ``--rounds`` R rounds of chat on a pool
that holds about ``--pool-conversations`` whole conversations. Every user shares one
system prompt (``--system-len`` token ids); each round adds a user message of ShareGPT-like
length (``--message-len`` lo:hi, log-uniform) through the chat template's turn markers, and
``--max-tokens`` greedy reply tokens (``ignore_eos``); the next round's prompt is the whole
history: previous prompt + reply + new turn, as token ids (so the prefix is exact). A user
thinks ``--think-time`` seconds (uniform 0.5x..1.5x) between rounds. Time is a virtual
clock: it advances by each engine step's measured duration and jumps over idle gaps, so
TTFT (release of a round -> its first token) is what a user would see, without waiting
through think time. Runs: ``--runs off,on[,big]``: prefix cache in RAM only; with the disk
tier; and an engine big enough to keep everything resident (the reference outputs).
Reported per run: mean / p50 / p99 TTFT per round and overall; of the *history tokens*
(each request's prompt tokens that an earlier request had computed, in full blocks) the
share from RAM, from disk and recomputed; output tokens/s over the busy time; whether the
greedy outputs equal the first run's token for token. ``--restart-after-round K``: after
round K every user waits, the engine is closed and a new one is built on the same
directory; the first request of each user after it reports its cached tokens against its
history.

**--resume-at** L1,L2,...: one conversation of L prompt tokens (history + a 64-token new
message) resumed three (four with ``--cold``) ways, rounds alternated: *resident* (its
blocks still in RAM), *disk* (RAM emptied; files in the page cache), *disk cold* (files
also dropped from the page cache with ``posix_fadvise``), *recompute* (a fresh
``cache_salt``: nothing cached anywhere). Medians of ``--repeats`` rounds with min..max.

**--decode-cost**: what the background writes cost decoding: ``--decode-seqs`` sequences
of ``--decode-prompt`` token ids and ``--max-tokens`` greedy tokens, output tok/s once all
decode, on an engine with the tier and one without, rounds alternated (``--repeats``);
every full block the sequences fill is written to disk in the "on" engine.

**--trace** PATH: replays a Mooncake-format trace (``hash_ids`` of 512-token blocks,
multi-turn order preserved) through ``KVCacheManager`` + ``DiskTier`` in simulation (one
hash id = one block), one request at a time; block hit rates by tier against
``--trace-pool-blocks`` x ``--trace-disk-blocks``.

    .venv/bin/python benchmarks/multi_turn.py --users 16 --rounds 5
    .venv/bin/python benchmarks/multi_turn.py --resume-at 2048,8192 --cold
    .venv/bin/python benchmarks/multi_turn.py --trace ../shared/data/mooncake_synthetic_trace.jsonl
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import heapq
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


# ---------------------------------------------------------------- the workload


@dataclass(frozen=True, slots=True)
class Workload:
    system: list[int]
    messages: list[list[list[int]]]  # [user][round] -> token ids of the turn (markers included)
    max_tokens: int
    think: list[list[float]]  # [user][round] seconds after the round's reply
    block_size: int
    starts: list[float]  # [user] arrival of the first round

    @property
    def num_users(self) -> int:
        return len(self.messages)

    @property
    def num_rounds(self) -> int:
        return len(self.messages[0])

    def longest_conversation(self) -> int:
        return len(self.system) + max(
            sum(len(m) for m in user) + self.max_tokens * len(user) for user in self.messages
        )


def make_workload(
    args: argparse.Namespace, turn_open: list[int], turn_close: list[int], vocab_size: int
) -> Workload:
    rng = random.Random(args.seed)
    lo, hi = (int(x) for x in args.message_len.split(":"))
    first, end = min(1000, vocab_size // 4), min(30000, vocab_size)

    def ids(n: int) -> list[int]:
        return [rng.randrange(first, end) for _ in range(n)]

    def message() -> list[int]:
        n = int(math.exp(rng.uniform(math.log(lo), math.log(hi))))
        return turn_open + ids(n) + turn_close

    messages = [[message() for _ in range(args.rounds)] for _ in range(args.users)]
    think = [
        [args.think_time * rng.uniform(0.5, 1.5) for _ in range(args.rounds)]
        for _ in range(args.users)
    ]
    starts = [rng.uniform(0, 2 * args.think_time) for _ in range(args.users)]
    return Workload(ids(args.system_len), messages, args.max_tokens, think, args.block_size, starts)


# ---------------------------------------------------------------- engines


def build_engine(args: argparse.Namespace, *, num_blocks: int, offload_dir: str | None):
    from pagedllm.engine.config import EngineConfig
    from pagedllm.engine.llm_engine import LLMEngine

    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        block_size=args.block_size,
        num_blocks=num_blocks,
        max_model_len=args.max_model_len,
        kv_offload_dir=offload_dir,
        kv_offload_size=int(args.kv_offload_space * (1 << 30)),
        num_threads=args.num_threads,
    )
    return LLMEngine.from_config(config)


def chat_markers(engine: Any) -> tuple[list[int], list[int]]:
    """Token ids that open a user turn and close it (opening the assistant's), from the
    tokenizer's chat template where it has one."""
    tok = engine.tokenizer
    try:
        text = tok.apply_chat_template(
            [{"role": "user", "content": "\x00"}], tokenize=False, add_generation_prompt=True
        )
        head, tail = text.split("\x00")
        head = head[head.rfind("<|im_start|>") :] if "<|im_start|>" in head else head
        return list(tok.encode(head, add_special_tokens=False)), list(
            tok.encode(tail, add_special_tokens=False)
        )
    except Exception:  # no template: plain separators
        return list(tok.encode("\nUser: ")), list(tok.encode("\nAssistant: "))


# ---------------------------------------------------------------- multi-turn


@dataclass(slots=True)
class Turn:
    user: int
    round: int
    prompt: list[int]
    history: int  # prompt tokens an earlier request computed, in full blocks
    release: float
    first_token: float | None = None
    cached: int = 0
    output: tuple[int, ...] = ()


@dataclass(slots=True)
class RunResult:
    name: str
    turns: list[Turn] = field(default_factory=list)
    busy_seconds: float = 0.0
    disk_hit_tokens: int = 0
    restart: dict | None = None

    def ttft(self, round_: int | None = None) -> list[float]:
        return [
            t.first_token - t.release
            for t in self.turns
            if t.first_token is not None and (round_ is None or t.round == round_)
        ]

    def shares(self) -> dict[str, float]:
        history = sum(t.history for t in self.turns)
        cached = sum(min(t.cached, t.history) for t in self.turns)
        disk = min(self.disk_hit_tokens, cached)
        return {
            "history_tokens": history,
            "ram": (cached - disk) / history if history else 0.0,
            "disk": disk / history if history else 0.0,
            "recomputed": (history - cached) / history if history else 0.0,
        }

    def outputs(self) -> dict[tuple[int, int], tuple[int, ...]]:
        return {(t.user, t.round): t.output for t in self.turns}

    def outputs_digest(self) -> str:
        """sha256 of every reply in (user, round) order: equal digests across separate
        invocations mean the same greedy outputs token for token."""
        text = json.dumps(sorted(self.outputs().items()))
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def full_blocks(num_tokens: int, prompt_len: int, block_size: int) -> int:
    return min(num_tokens, prompt_len - 1) // block_size * block_size


def run_multi_turn(
    name: str, make_engine: Any, work: Workload, restart_after: int | None
) -> RunResult:
    from pagedllm.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=work.max_tokens, temperature=0, ignore_eos=True)
    engine = make_engine()
    warm_up(engine, work)
    result = RunResult(name)
    disk_base = engine.get_stats().cache.prefix_disk_hits_tokens
    clock = 0.0
    releases = [(work.starts[u], u) for u in range(work.num_users)]
    heapq.heapify(releases)
    prompts = [list(work.system) for _ in range(work.num_users)]
    computed = [0 for _ in range(work.num_users)]  # tokens of the user's context computed
    next_round = [0] * work.num_users
    active: dict[str, Turn] = {}
    held: list[tuple[float, int]] = []  # (planned release, user) waiting for the restart
    system_seen = False
    while releases or active or held:
        if held and not active and not releases:  # everyone finished round K: restart
            result.disk_hit_tokens += engine.get_stats().cache.prefix_disk_hits_tokens - disk_base
            engine.close()
            del engine
            gc.collect()
            engine = make_engine()
            warm_up(engine, work)
            disk_base = engine.get_stats().cache.prefix_disk_hits_tokens
            result.restart = {"after_round": restart_after, "first_turns": []}
            for item in held:  # each user still comes back after its own think time
                heapq.heappush(releases, item)
            held = []
            restart_after = None
        while releases and (releases[0][0] <= clock or not active):
            at, u = heapq.heappop(releases)
            clock = max(clock, at)
            r = next_round[u]
            prompt = prompts[u] + work.messages[u][r]
            known = computed[u] if r else (len(work.system) if system_seen else 0)
            system_seen = True
            turn = Turn(u, r, prompt, full_blocks(known, len(prompt), work.block_size), clock)
            active[f"u{u}r{r}"] = turn
            engine.add_request(f"u{u}r{r}", prompt, params)
        if not active:
            continue
        start = time.perf_counter()
        outputs = engine.step()
        clock += time.perf_counter() - start
        result.busy_seconds += time.perf_counter() - start
        for out in outputs:
            turn = active.get(out.request_id)
            if turn is None:
                continue
            if turn.first_token is None and out.outputs and out.outputs[0].token_ids:
                turn.first_token = clock
                turn.cached = out.num_cached_tokens
            if not out.finished:
                continue
            del active[out.request_id]
            turn.output = tuple(out.outputs[0].token_ids)
            result.turns.append(turn)
            if result.restart is not None and turn.round == result.restart["after_round"]:
                result.restart["first_turns"].append((turn.history, turn.cached))
            u = turn.user
            prompts[u] = turn.prompt + list(turn.output)
            computed[u] = len(prompts[u]) - 1  # the last reply token is never fed back
            next_round[u] += 1
            if next_round[u] >= work.num_rounds:
                continue
            release = (clock + work.think[u][turn.round], u)
            if restart_after is not None and next_round[u] == restart_after:
                held.append(release)
            else:
                heapq.heappush(releases, release)
    result.disk_hit_tokens += engine.get_stats().cache.prefix_disk_hits_tokens - disk_base
    engine.close()
    return result


def warm_up(engine: Any, work: Workload) -> None:
    """One short request under a salt of its own, as a server's start-up would run: the
    first steps of a new process pay one-off costs (first calls, first page faults)."""
    from pagedllm.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    engine.add_request("warm-up", work.system[:32], params, cache_salt="warm-up")
    while engine.has_unfinished_requests():
        engine.step()


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(run: RunResult, work: Workload, reference: RunResult | None) -> dict:
    rounds = []
    for r in range(work.num_rounds):
        ttft = run.ttft(r)
        rounds.append(
            {
                "round": r + 1,
                "mean": statistics.fmean(ttft),
                "p50": statistics.median(ttft),
                "p99": percentile(ttft, 0.99),
            }
        )
    ttft = run.ttft()
    out_tokens = sum(len(t.output) for t in run.turns)
    summary = {
        "ttft_mean": statistics.fmean(ttft),
        "ttft_p50": statistics.median(ttft),
        "ttft_p99": percentile(ttft, 0.99),
        "rounds": rounds,
        "shares": run.shares(),
        "output_tok_s": out_tokens / run.busy_seconds,
        "busy_seconds": run.busy_seconds,
        "outputs_sha256": run.outputs_digest(),
        "same_outputs_as_" + (reference.name if reference else "self"): (
            run.outputs() == reference.outputs() if reference else True
        ),
    }
    if run.restart is not None:
        first = run.restart["first_turns"]
        summary["restart"] = {
            "after_round": run.restart["after_round"],
            "history_tokens": sum(h for h, _ in first),
            "cached_tokens": sum(min(c, h) for h, c in first),
        }
    return summary


def multi_turn(args: argparse.Namespace) -> dict:
    runs = args.runs.split(",")
    probe = build_engine(args, num_blocks=64, offload_dir=None)
    markers = chat_markers(probe)
    vocab_size = probe.runner.vocab_size
    del probe
    gc.collect()
    work = make_workload(args, *markers, vocab_size)
    longest = work.longest_conversation()
    if args.max_model_len is None:
        args.max_model_len = min(8192, longest + args.block_size)
    pool_blocks = math.ceil(args.pool_conversations * longest / args.block_size)
    pool_blocks = max(pool_blocks, math.ceil(args.max_model_len / args.block_size) + 1)
    big_blocks = math.ceil(work.num_users * longest / args.block_size) + work.num_users
    base = Path(args.offload_dir or tempfile.mkdtemp(prefix="pagedllm-multi-turn-"))
    results: dict[str, RunResult] = {}
    for name in runs:
        directory = None
        if name == "on":
            directory = str(base / f"kv-{time.time_ns()}")
        blocks = big_blocks if name == "big" else pool_blocks

        def make(blocks: int = blocks, directory: str | None = directory) -> Any:
            return build_engine(args, num_blocks=blocks, offload_dir=directory)

        restart = args.restart_after_round if name == "on" else None
        results[name] = run_multi_turn(name, make, work, restart)
    reference = results[runs[0]]
    summaries = {
        n: summarize(r, work, reference if n != runs[0] else None) for n, r in results.items()
    }
    print(
        f"multi-turn: {work.num_users} users x {work.num_rounds} rounds, system "
        f"{len(work.system)} tokens, longest conversation {longest} tokens, pool "
        f"{pool_blocks} blocks of {args.block_size} (~{args.pool_conversations} conversations)"
    )
    header = f"{'run':<5} {'round':>5} {'mean s':>8} {'p50 s':>8} {'p99 s':>8}"
    print(header)
    for name, s in summaries.items():
        for row in s["rounds"]:
            print(
                f"{name:<5} {row['round']:>5} {row['mean']:8.3f} {row['p50']:8.3f} {row['p99']:8.3f}"
            )
        sh = s["shares"]
        print(
            f"{name:<5}   all {s['ttft_mean']:8.3f} {s['ttft_p50']:8.3f} {s['ttft_p99']:8.3f}"
            f"   history from RAM {sh['ram']:.1%}, disk {sh['disk']:.1%}, recomputed "
            f"{sh['recomputed']:.1%}; {s['output_tok_s']:.1f} output tok/s; "
            f"outputs {s['outputs_sha256']}"
        )
        if "restart" in s:
            rs = s["restart"]
            print(
                f"      restart after round {rs['after_round']}: first turns found "
                f"{rs['cached_tokens']} of {rs['history_tokens']} history tokens cached"
            )
    if "on" in summaries and "off" in summaries:
        ratio = summaries["off"]["ttft_mean"] / summaries["on"]["ttft_mean"]
        print(f"mean TTFT off / on: {ratio:.2f}x")
        summaries["ttft_off_over_on"] = ratio
    return summaries


# ---------------------------------------------------------------- resume-at


def drop_page_cache(store: Any, hashes: list[bytes]) -> None:
    for block_hash in hashes:
        path = store.block_path(block_hash)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resume_at(args: argparse.Namespace) -> dict:
    from pagedllm.core.hashing import hash_request_blocks
    from pagedllm.sampling_params import SamplingParams

    lengths = [int(x) for x in args.resume_at.split(",")]
    blocks = math.ceil((max(lengths) + args.max_tokens) * 3 / args.block_size)
    directory = Path(args.offload_dir or tempfile.mkdtemp(prefix="pagedllm-resume-"))
    engine = build_engine(
        args, num_blocks=blocks, offload_dir=str(directory / f"kv-{time.time_ns()}")
    )
    # A prompt of the model's whole length leaves room for max_tokens: 8192 -> 8188.
    lengths = [min(length, engine.max_model_len - args.max_tokens) for length in lengths]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    rng = random.Random(args.seed)
    ways = ["resident", "disk", *(["disk_cold"] if args.cold else []), "recompute"]
    counter = iter(range(10**9))

    def ttft(prompt: list[int], salt: str | None = None) -> tuple[float, int]:
        request_id = f"q{next(counter)}"
        start = time.perf_counter()
        engine.add_request(request_id, prompt, params, cache_salt=salt)
        first, cached = None, 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if first is None and out.outputs[0].token_ids:
                    first, cached = time.perf_counter() - start, out.num_cached_tokens
        return first, cached

    ttft([rng.randrange(1000, 30000) for _ in range(256)])  # warm-up
    table: dict[int, dict[str, list[tuple[float, int]]]] = {}
    for length in lengths:
        table[length] = {w: [] for w in ways}
        for rep in range(args.repeats):
            history = [rng.randrange(1000, 30000) for _ in range(length - 64)]
            ttft(history)  # the conversation so far: computed once, stored on disk
            engine.flush_disk_tier()
            hashes = hash_request_blocks(history, args.block_size)
            for way in ways:
                message = [rng.randrange(1000, 30000) for _ in range(64)]
                if way in ("disk", "disk_cold"):
                    engine.kv.evict_cached_blocks()
                if way == "disk_cold":
                    drop_page_cache(engine.disk_store, hashes)
                salt = f"fresh-{length}-{rep}" if way == "recompute" else None
                table[length][way].append(ttft(history + message, salt))
                if way == "resident":
                    engine.flush_disk_tier()
    engine.close()
    print(
        f"resume: TTFT of one conversation resumed with a 64-token message, {args.repeats} rounds"
    )
    print(
        f"{'tokens':>7} {'way':<10} {'median s':>9} {'min..max s':>17} {'cached':>7} {'vs recompute':>13}"
    )
    summary: dict[str, Any] = {}
    for length, by_way in table.items():
        medians = {w: statistics.median(t for t, _ in v) for w, v in by_way.items()}
        entry = {}
        for way, values in by_way.items():
            times = [t for t, _ in values]
            entry[way] = {
                "median_s": medians[way],
                "min_s": min(times),
                "max_s": max(times),
                "cached_tokens": values[-1][1],
                "speedup_vs_recompute": medians["recompute"] / medians[way],
            }
            print(
                f"{length:>7} {way:<10} {medians[way]:9.3f} {min(times):8.3f}..{max(times):<8.3f} "
                f"{values[-1][1]:>7} {medians['recompute'] / medians[way]:12.1f}x"
            )
        entry["disk_over_resident"] = medians["disk"] / medians["resident"]
        print(f"{length:>7} disk / resident: {entry['disk_over_resident']:.2f}x")
        summary[str(length)] = entry
    return summary


# ---------------------------------------------------------------- decode cost


def decode_rate(engine: Any, prompts: list[list[int]], max_tokens: int) -> float:
    """Output tokens per second once every request decodes (the prompt phase excluded)."""
    from pagedllm.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"d{i}", prompt, params)
    started: set[str] = set()
    start = None
    tokens = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if start is not None:
            tokens += len(outputs)
        for out in outputs:
            started.add(out.request_id)
        if start is None and len(started) == len(prompts):
            start = time.perf_counter()
    elapsed = time.perf_counter() - start
    engine.flush_disk_tier()  # the writes' cost stays inside the tier's own round
    return tokens / elapsed


def decode_cost(args: argparse.Namespace) -> dict:
    n, prompt_len, max_tokens = args.decode_seqs, args.decode_prompt, args.max_tokens
    blocks = math.ceil(n * (prompt_len + max_tokens) * 1.25 / args.block_size)
    if args.max_model_len is None:
        args.max_model_len = prompt_len + max_tokens
    directory = Path(args.offload_dir or tempfile.mkdtemp(prefix="pagedllm-decode-"))
    engines = {
        "off": build_engine(args, num_blocks=blocks, offload_dir=None),
        "on": build_engine(
            args, num_blocks=blocks, offload_dir=str(directory / f"kv-{time.time_ns()}")
        ),
    }
    rng = random.Random(args.seed)
    rates: dict[str, list[float]] = {"off": [], "on": []}
    for rep in range(args.repeats + 1):  # the first round warms both up
        for name in ("off", "on") if rep % 2 else ("on", "off"):
            prompts = [[rng.randrange(1000, 30000) for _ in range(prompt_len)] for _ in range(n)]
            rate = decode_rate(engines[name], prompts, max_tokens)
            if rep:
                rates[name].append(rate)
    written = engines["on"].get_stats().disk.bytes_written
    for engine in engines.values():
        engine.close()
    ratios = [on / off for on, off in zip(rates["on"], rates["off"], strict=True)]
    summary = {
        "seqs": n,
        "prompt_tokens": prompt_len,
        "max_tokens": max_tokens,
        "off_tok_s": statistics.median(rates["off"]),
        "on_tok_s": statistics.median(rates["on"]),
        "on_over_off": statistics.median(ratios),
        "on_over_off_min": min(ratios),
        "on_over_off_max": max(ratios),
        "bytes_written": written,
    }
    print(
        f"decode with background writes: {n} sequences x {max_tokens} tokens after "
        f"{prompt_len}-token prompts, {args.repeats} alternated rounds"
    )
    print(
        f"off {summary['off_tok_s']:.1f} tok/s, on {summary['on_tok_s']:.1f} tok/s, on/off "
        f"{summary['on_over_off']:.3f} (min {min(ratios):.3f}, max {max(ratios):.3f}); "
        f"{written / 2**20:.0f} MiB written"
    )
    return summary


# ---------------------------------------------------------------- trace


def load_trace(path: Path, limit: int | None) -> list[list[int]]:
    requests = []
    with open(path) as handle:
        for line in handle:
            if line.strip():
                requests.append(json.loads(line)["hash_ids"])
                if limit is not None and len(requests) >= limit:
                    break
    return requests


def simulate_trace(requests: list[list[int]], pool_blocks: int, disk_blocks: int) -> dict:
    """Replay block-hash lists (one id = one block) through the manager and the disk
    tier, one request at a time; block counts by where they were found."""
    from pagedllm.core.kv_cache_manager import KVCacheManager
    from pagedllm.core.request import Request
    from pagedllm.core.tiers import DiskTier

    disk = DiskTier(disk_blocks) if disk_blocks else None
    kv = KVCacheManager(pool_blocks, 1, disk=disk, watermark=0.0)
    total = ram = from_disk = too_long = 0
    for i, hash_ids in enumerate(requests):
        if len(hash_ids) + 1 > pool_blocks:
            too_long += 1
            continue
        request = Request(f"t{i}", [*hash_ids, -1])  # one token past the blocks: all may hit
        hit = kv.get_computed_blocks(request)
        allocation = kv.allocate_slots(request, request.num_tokens - hit.num_tokens, hit)
        assert allocation is not None, "one request at a time always fits"
        request.num_computed_tokens = request.num_tokens
        kv.cache_full_blocks(request)
        kv.take_disk_ops()
        kv.free(request)
        total += len(hash_ids)
        ram += len(hit.block_ids)
        from_disk += hit.num_disk_blocks
    return {
        "pool_blocks": pool_blocks,
        "disk_blocks": disk_blocks,
        "blocks": total,
        "ram_hit": ram / total,
        "disk_hit": from_disk / total,
        "miss": (total - ram - from_disk) / total,
        "skipped_too_long": too_long,
    }


def trace(args: argparse.Namespace) -> dict:
    requests = load_trace(Path(args.trace), args.trace_limit)
    pools = [int(x) for x in args.trace_pool_blocks.split(",")]
    disks = [int(x) for x in args.trace_disk_blocks.split(",")]
    rows = [simulate_trace(requests, p, d) for p in pools for d in disks]
    print(f"trace: {len(requests)} requests, one block = 512 tokens (the trace's hash_ids)")
    print(f"{'pool':>7} {'disk':>8} {'RAM hit':>8} {'disk hit':>9} {'miss':>7}")
    for row in rows:
        print(
            f"{row['pool_blocks']:>7} {row['disk_blocks']:>8} {row['ram_hit']:8.1%} "
            f"{row['disk_hit']:9.1%} {row['miss']:7.1%}"
        )
    return {"requests": len(requests), "rows": rows}


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--system-len", type=int, default=512)
    parser.add_argument("--message-len", default="32:256", help="lo:hi tokens, log-uniform")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--think-time", type=float, default=10.0, help="mean seconds")
    parser.add_argument("--pool-conversations", type=float, default=2.0)
    parser.add_argument("--runs", default="off,on,big", help="off, on (disk tier), big")
    parser.add_argument("--restart-after-round", type=int, default=None)
    parser.add_argument("--offload-dir", default=None, help="where the tier's stores go")
    parser.add_argument("--kv-offload-space", type=float, default=8.0, help="GiB")
    parser.add_argument("--resume-at", default=None, help="prompt lengths, e.g. 2048,8192")
    parser.add_argument("--cold", action="store_true", help="--resume-at: a cold-disk way too")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--decode-cost", action="store_true", help="decode tok/s with the tier on vs off"
    )
    parser.add_argument("--decode-seqs", type=int, default=32)
    parser.add_argument("--decode-prompt", type=int, default=128)
    parser.add_argument("--trace", default=None, help="Mooncake-format JSONL")
    parser.add_argument("--trace-limit", type=int, default=None)
    parser.add_argument("--trace-pool-blocks", default="256,1024,4096")
    parser.add_argument("--trace-disk-blocks", default="0,1024,8192,65536")
    args = parser.parse_args(argv)
    if args.trace:
        result = {"mode": "trace", **trace(args)}
    elif args.decode_cost:
        result = {"mode": "decode_cost", **decode_cost(args)}
    elif args.resume_at:
        result = {"mode": "resume", **resume_at(args)}
    else:
        result = {"mode": "multi_turn", **multi_turn(args)}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
