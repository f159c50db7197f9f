"""Replay one synthetic trace through four KV allocation schemes on one token budget.

    contiguous_max_len  one contiguous run of max_model_len slots per sequence
    contiguous_exact    one contiguous run of prompt + max_tokens slots per sequence
    paged               blocks on demand, no sharing (each sample has its own prompt)
    paged_shared        blocks on demand, prefix caching, parallel samples forked

A step is one decode iteration: every running sequence grows by one token, then
waiting requests are admitted first come, first served while there is room (the
paged schemes keep the KV cache manager's watermark free at admission, and
preempt the newest request by recompute when a running sequence cannot grow).

Prints a table, then as its last line one JSON object keyed by scheme with
mean_concurrency (running sequences, averaged over the steps up to the last
admission: while requests were still arriving or waiting, so the drain at the
end does not count), mean_concurrency_all_steps,
peak_concurrency, internal_waste / external_waste / duplication_waste (fractions
of allocated slots, summed over samples) and admission_failures (steps in which
the head of the queue did not fit).

    .venv/bin/python benchmarks/fragmentation.py            # ShareGPT-like, 1000 requests
    .venv/bin/python benchmarks/fragmentation.py --quick    # a few seconds
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections import deque
from dataclasses import dataclass, field

from pagedllm.core.accounting import waste
from pagedllm.core.contiguous import ContiguousAllocator
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.core.traces import TRACE_KINDS, TraceRequest, make_trace, trace_summary

SCHEMES = ("contiguous_max_len", "contiguous_exact", "paged", "paged_shared")


@dataclass(slots=True)
class Work:
    """A waiting request: fresh from the trace, or a preempted sequence to resume."""

    trace: TraceRequest
    tokens: list[int]  # what must be in the cache at admission
    remaining: int  # tokens still to generate after admission
    n: int  # sequences to start (parallel samples); 1 when resuming
    # Slots to reserve beyond the prompt under the contiguous "exact" policy: what
    # max_tokens allows (the last sampled token never needs a slot).
    reserve_remaining: int

    @property
    def total_len(self) -> int:
        return len(self.tokens) + self.reserve_remaining


@dataclass(slots=True, eq=False)
class Seq:
    request: Request  # holds the token ids (and num_computed_tokens for paged)
    remaining: int
    trace: TraceRequest
    group: int  # sequences admitted together are preempted together


@dataclass(slots=True)
class Totals:
    steps: int = 0
    last_admission_step: int = 0
    concurrency: list[int] = field(default_factory=list)  # running sequences per step
    peak_concurrency: int = 0
    admission_failures: int = 0
    preemptions: int = 0
    generated_tokens: int = 0
    allocated: int = 0
    internal: int = 0
    external: int = 0
    duplication: int = 0
    samples: int = 0
    wall_s: float = 0.0
    extra: dict = field(default_factory=dict)


class PagedScheme:
    def __init__(self, num_slots: int, block_size: int, shared: bool, watermark: float) -> None:
        self.shared = shared
        self.kv = KVCacheManager(
            num_slots // block_size, block_size, enable_prefix_caching=shared, watermark=watermark
        )

    def admit(self, work: Work, new_id) -> list[Request] | None:
        if self.shared:
            first = self._admit_one(work, new_id())
            if first is None:
                return None
            children = []
            for _ in range(work.n - 1):
                child = Request(new_id(), list(first.all_token_ids))
                child.num_computed_tokens = first.num_computed_tokens
                self.kv.fork(first, child)
                children.append(child)
            return [first, *children]
        admitted = []
        for _ in range(work.n):
            request = self._admit_one(work, new_id())
            if request is None:
                for r in admitted:
                    self.kv.free(r)
                return None
            admitted.append(request)
        return admitted

    def _admit_one(self, work: Work, request_id: str) -> Request | None:
        request = Request(request_id, list(work.tokens))
        hit = self.kv.get_computed_blocks(request)
        if (
            self.kv.allocate_slots(
                request, request.num_tokens - hit.num_tokens, hit, admission=True
            )
            is None
        ):
            self.kv.free(request)
            return None
        request.num_computed_tokens = request.num_tokens
        self.kv.cache_full_blocks(request)
        return request

    def grow(self, seq: Seq, token: int) -> bool:
        if self.kv.allocate_slots(seq.request, 1) is None:
            return False
        seq.request.append_output_token_ids(token)
        seq.request.num_computed_tokens += 1
        self.kv.cache_full_blocks(seq.request)
        return True

    def free(self, seq: Seq) -> None:
        self.kv.free(seq.request)

    def allocator(self):
        return self.kv


class ContiguousScheme:
    def __init__(self, num_slots: int, policy: str, max_model_len: int) -> None:
        self.alloc = ContiguousAllocator(num_slots, policy, max_model_len)

    def admit(self, work: Work, new_id) -> list[Request] | None:
        admitted = []
        for _ in range(work.n):
            request = Request(new_id(), list(work.tokens))
            if (
                self.alloc.allocate(request.request_id, request.num_tokens, work.reserve_remaining)
                is None
            ):
                for r in admitted:
                    self.alloc.free(r.request_id)
                return None
            admitted.append(request)
        return admitted

    def grow(self, seq: Seq, token: int) -> bool:
        if not self.alloc.grow(seq.request.request_id, seq.request.num_tokens + 1):
            return False
        seq.request.append_output_token_ids(token)
        return True

    def free(self, seq: Seq) -> None:
        self.alloc.free(seq.request.request_id)

    def allocator(self):
        return self.alloc


def make_scheme(name: str, args: argparse.Namespace):
    if name.startswith("contiguous"):
        policy = "max_len" if name == "contiguous_max_len" else "exact"
        return ContiguousScheme(args.num_slots, policy, args.max_model_len)
    return PagedScheme(args.num_slots, args.block_size, name == "paged_shared", args.watermark)


def simulate(name: str, trace: list[TraceRequest], args: argparse.Namespace) -> Totals:
    scheme = make_scheme(name, args)
    rng = random.Random(args.seed + 1)
    pending = deque(trace)
    waiting: deque[Work] = deque()
    running: list[Seq] = []  # admission order: the newest is preempted first
    totals = Totals()
    counter = iter(range(10**12))
    groups = iter(range(10**12))

    def new_id() -> str:
        return f"s{next(counter)}"

    def finish(seq: Seq) -> None:
        scheme.free(seq)
        running.remove(seq)

    def preempt_newest() -> int:
        group = running[-1].group
        victims = [s for s in running if s.group == group]
        for seq in reversed(victims):
            finish(seq)
            tokens = list(seq.request.all_token_ids)
            waiting.appendleft(Work(seq.trace, tokens, seq.remaining, 1, seq.remaining))
        totals.preemptions += 1
        return group

    start = time.perf_counter()
    while pending or waiting or running:
        now = totals.steps * args.step_time
        while pending and pending[0].arrival_time <= now:
            r = pending.popleft()
            waiting.append(
                Work(r, list(r.prompt_token_ids), r.output_len - 1, r.n, r.max_tokens - 1)
            )
        for seq in list(running):
            if seq not in running:
                continue  # preempted while an older sequence grew
            token = rng.randrange(args.vocab_size)
            lost = False
            while not scheme.grow(seq, token):
                if preempt_newest() == seq.group:
                    lost = True
                    break
            if lost:
                continue
            totals.generated_tokens += 1
            seq.remaining -= 1
            if seq.remaining <= 0:
                finish(seq)
        while waiting and len(running) + waiting[0].n <= args.max_num_seqs:
            work = waiting[0]
            if work.n > args.max_num_seqs:
                raise SystemExit(f"n={work.n} exceeds --max-num-seqs")
            admitted = scheme.admit(work, new_id)
            if admitted is None:
                if not running:
                    raise SystemExit(f"{name}: a request of {work.total_len} tokens never fits")
                totals.admission_failures += 1
                break
            waiting.popleft()
            totals.last_admission_step = totals.steps
            group = next(groups)
            for request in admitted:
                seq = Seq(request, work.remaining, work.trace, group)
                if seq.remaining > 0:
                    running.append(seq)
                else:
                    scheme.free(seq)
        totals.concurrency.append(len(running))
        totals.peak_concurrency = max(totals.peak_concurrency, len(running))
        if running and totals.steps % args.sample_every == 0:
            _sample(totals, scheme, running, waiting)
        totals.steps += 1
    totals.wall_s = time.perf_counter() - start
    return totals


def _sample(totals: Totals, scheme, running: list[Seq], waiting: deque[Work]) -> None:
    tokens = {s.request.request_id: s.request.all_token_ids for s in running}
    next_len = waiting[0].total_len if waiting else None
    report = waste(scheme.allocator(), tokens, next_len)
    totals.samples += 1
    totals.allocated += report.allocated_slots
    totals.internal += report.internal_tokens
    totals.external += report.external_tokens
    totals.duplication += report.duplication_tokens or 0


def summarize(t: Totals) -> dict:
    def frac(x: int) -> float:
        return round(x / t.allocated, 5) if t.allocated else 0.0

    loaded = t.concurrency[: t.last_admission_step + 1]
    mean_loaded = sum(loaded) / len(loaded) if loaded else 0.0
    mean_all = sum(t.concurrency) / t.steps if t.steps else 0.0
    return {
        "mean_concurrency": round(mean_loaded, 2),
        "mean_concurrency_all_steps": round(mean_all, 2),
        "peak_concurrency": t.peak_concurrency,
        "internal_waste": frac(t.internal),
        "external_waste": frac(t.external),
        "duplication_waste": frac(t.duplication),
        "admission_failures": t.admission_failures,
        "preemptions": t.preemptions,
        "steps": t.steps,
        "generated_tokens": t.generated_tokens,
        "wall_s": round(t.wall_s, 2),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="a small trace that runs in seconds")
    p.add_argument("--trace", choices=TRACE_KINDS, default="sharegpt")
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument(
        "--request-rate", type=float, default=math.inf, help="Poisson, req/s (inf: all at t=0)"
    )
    p.add_argument(
        "--step-time", type=float, default=0.05, help="seconds per decode step (for arrivals)"
    )
    p.add_argument("--input-range", type=int, nargs=2, default=(1, 1024), metavar=("MIN", "MAX"))
    p.add_argument("--output-range", type=int, nargs=2, default=(1, 1024), metavar=("MIN", "MAX"))
    p.add_argument("--shared-prefix-len", type=int, default=0)
    p.add_argument("--shared-prefix-fraction", type=float, default=0.0)
    p.add_argument("-n", type=int, default=1, help="parallel samples per request")
    p.add_argument("--max-tokens-slack", type=float, default=1.0, help="max_tokens / output_len")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument(
        "--num-slots", type=int, default=None, help="token budget (default 32 * max_model_len)"
    )
    p.add_argument("--max-num-seqs", type=int, default=1024)
    p.add_argument("--watermark", type=float, default=0.01)
    p.add_argument("--sample-every", type=int, default=10, help="steps between waste samples")
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--schemes", nargs="+", choices=SCHEMES, default=list(SCHEMES))
    args = p.parse_args(argv)
    if args.quick:
        args.num_requests = min(args.num_requests, 200)
        args.num_slots = args.num_slots or 8 * args.max_model_len
    args.num_slots = args.num_slots or 32 * args.max_model_len
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    trace = make_trace(
        args.trace,
        args.num_requests,
        args.seed,
        request_rate=args.request_rate,
        max_model_len=args.max_model_len,
        shared_prefix_len=args.shared_prefix_len,
        shared_prefix_fraction=args.shared_prefix_fraction,
        n=args.n,
        vocab_size=args.vocab_size,
        input_range=tuple(args.input_range),
        output_range=tuple(args.output_range),
        max_tokens_slack=args.max_tokens_slack,
    )
    summary = trace_summary(trace)
    print(
        f"trace={args.trace} requests={summary['num_requests']} "
        f"mean_in={summary['mean_input_len']:.1f} mean_out={summary['mean_output_len']:.1f} "
        f"n={args.n} shared_prefix={args.shared_prefix_len}x{args.shared_prefix_fraction} "
        f"budget={args.num_slots} slots block_size={args.block_size} "
        f"max_model_len={args.max_model_len} max_num_seqs={args.max_num_seqs}"
    )
    results = {name: summarize(simulate(name, trace, args)) for name in args.schemes}
    header = (
        "scheme",
        "mean_conc",
        "peak",
        "internal",
        "external",
        "dup",
        "adm_fail",
        "preempt",
        "steps",
    )
    print("{:<20}{:>10}{:>7}{:>10}{:>10}{:>8}{:>10}{:>9}{:>7}".format(*header))
    for name, r in results.items():
        print(
            f"{name:<20}{r['mean_concurrency']:>10.1f}{r['peak_concurrency']:>7}"
            f"{r['internal_waste']:>10.2%}{r['external_waste']:>10.2%}{r['duplication_waste']:>8.2%}"
            f"{r['admission_failures']:>10}{r['preemptions']:>9}{r['steps']:>7}"
        )
    if "contiguous_max_len" in results and "paged" in results:
        base = results["contiguous_max_len"]["mean_concurrency"]
        ratio = results["paged"]["mean_concurrency"] / base if base else float("inf")
        print(f"paged / contiguous_max_len mean concurrency: {ratio:.2f}x")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
