"""Paged attention vs the same attention on contiguous tensors of the same lengths.

Decode (one query token per sequence), prefill after a cached prefix and whole-prompt prefill,
for several batch sizes and context lengths, on model (a)'s attention shape (8 heads, 2 KV
heads, head_dim 64).
"paged" is a pagedllm backend reading K/V through shuffled block tables (the step's K/V
write included); "contiguous" is what an engine without paging would run: write the new K/V
into per-sequence contiguous tensors, then ``scaled_dot_product_attention`` on them.
Goal: paged <= 10% over contiguous. Last line: one JSON object.

``--prompts``: long prompt steps instead, on SmolLM2-135M's heads (9 heads, 3 KV heads,
head_dim 64, block size 16): the cpu backend's routes for the same step, each call timed on
its own, routes alternating, median (min-max) of ``--runs`` calls: "sdpa" (per-sequence SDPA,
the route past the kernel's context limit) against "kernel" (every query to the C++ kernel).

    .venv/bin/python benchmarks/attention.py [--backend cpu] [--dtype bfloat16] [--quick]
    .venv/bin/python benchmarks/attention.py --prompts [--dtype float32] [--runs 7]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from unittest import mock

import torch
import torch.nn.functional as F

from pagedllm.attention import AttentionMetadata, cpu
from pagedllm.attention.select import get_backend

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 8, 2, 64, 16


@dataclass(frozen=True, slots=True)
class Heads:
    num_heads: int = NUM_HEADS
    num_kv_heads: int = NUM_KV_HEADS
    head_dim: int = HEAD_DIM


SMOLLM2_HEADS = Heads(9, 3, 64)


def timeit(fn: Callable[[], object], *, min_time: float = 0.2, repeats: int = 5) -> float:
    """Median seconds per call over `repeats` rounds of enough calls to last `min_time`."""
    fn()
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-6)
    calls = max(1, int(min_time / once))
    rounds = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - start) / calls)
    return statistics.median(rounds)


def paged_case(
    batch: int,
    context: int,
    query_len: int,
    dtype: torch.dtype,
    seed: int = 0,
    heads: Heads = Heads(),
):
    """Shuffled blocks, caches holding each sequence's prefix, a step of `query_len` tokens."""
    num_heads, num_kv_heads, head_dim = heads.num_heads, heads.num_kv_heads, heads.head_dim
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq + 1
    ids = list(range(1, num_blocks))
    random.Random(seed).shuffle(ids)
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    tables = torch.tensor(ids, dtype=torch.int32).view(batch, blocks_per_seq)
    positions = torch.arange(context - query_len, context)
    slots = (tables[:, positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE).view(
        -1
    )
    tokens = batch * query_len
    query = torch.randn(tokens, num_heads, head_dim, generator=gen).to(dtype)
    key = torch.randn(tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    meta = AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=torch.arange(0, tokens + 1, query_len, dtype=torch.int32),
        seq_lens=torch.full((batch,), context, dtype=torch.int32),
        block_tables=tables,
        query_lens_list=[query_len] * batch,
        seq_lens_list=[context] * batch,
        max_query_len=query_len,
        max_seq_len=context,
    )
    return query, key, value, k_cache, v_cache, meta


def contiguous_fn(batch: int, context: int, query_len: int, dtype: torch.dtype):
    """The same step on contiguous [batch, kv_heads, context, head_dim] caches."""
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(batch, NUM_KV_HEADS, context, HEAD_DIM, generator=gen).to(dtype)
    v = torch.randn(batch, NUM_KV_HEADS, context, HEAD_DIM, generator=gen).to(dtype)
    query = torch.randn(batch * query_len, NUM_HEADS, HEAD_DIM, generator=gen).to(dtype)
    key = torch.randn(batch * query_len, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    value = torch.randn(batch * query_len, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    mask = None
    whole_prompt = query_len == context > 1  # causal without a mask, as an engine would run it
    if query_len > 1 and not whole_prompt:
        q_pos = torch.arange(context - query_len, context)
        mask = torch.arange(context)[None, :] <= q_pos[:, None]

    def run() -> torch.Tensor:
        new_k = key.view(batch, query_len, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2)
        new_v = value.view(batch, query_len, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2)
        k[:, :, context - query_len :] = new_k
        v[:, :, context - query_len :] = new_v
        q = query.view(batch, query_len, NUM_HEADS, HEAD_DIM).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=whole_prompt, scale=HEAD_DIM**-0.5, enable_gqa=True
        )
        return out.transpose(1, 2).reshape(batch * query_len, NUM_HEADS, HEAD_DIM)

    return run


def measure(backend, kind: str, batch: int, context: int, query_len: int, dtype) -> dict:
    query, key, value, k_cache, v_cache, meta = paged_case(batch, context, query_len, dtype)
    scale = HEAD_DIM**-0.5
    paged = timeit(lambda: backend.forward(query, key, value, k_cache, v_cache, meta, scale))
    contiguous = timeit(contiguous_fn(batch, context, query_len, dtype))
    return {
        "kind": kind,
        "batch": batch,
        "context": context,
        "query_len": query_len,
        "paged_ms": round(paged * 1e3, 4),
        "contiguous_ms": round(contiguous * 1e3, 4),
        "overhead": round(paged / contiguous - 1.0, 4),
    }


def cases(quick: bool) -> list[tuple[str, int, int, int]]:
    if quick:
        return [("decode", 8, 512, 1), ("decode", 64, 512, 1), ("prefill_prefix", 2, 1024, 128)]
    decode = [("decode", b, c, 1) for b in (1, 8, 32, 64) for c in (128, 512, 2048)]
    prefill = [
        ("prefill_prefix", b, c, q)
        for b in (1, 4)
        for c, q in ((512, 128), (1024, 512), (2048, 256))
    ]
    # Whole prompts (no cached prefix): the step's own K/V only.
    prompt = [("prefill", 1, 1024, 1024), ("prefill", 1, 2048, 2048), ("prefill", 4, 512, 512)]
    return decode + prefill + prompt


# Prompt steps (query_len, context): whole prompts, and a 4096-token prompt's second chunk
# under the default 2048-token step budget (chunked prefill).
PROMPT_CASES = [(1024, 1024), (2048, 2048), (2048, 4096), (4096, 4096)]
# The cpu backend's context limit for long queries, per route: SDPA past 0 tokens, or none.
PROMPT_ROUTES = {"sdpa": 0, "kernel": 1 << 30}
LONG_LIMITS = (
    "LONG_QUERY_MAX_SEQ_LEN",
    "DOT_LONG_QUERY_MAX_SEQ_LEN",
    "AVX2_LONG_QUERY_MAX_SEQ_LEN",
)


def time_once(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def routed(limit: int, fn: Callable[[], object]) -> Callable[[], object]:
    """fn with the cpu backend's long-query context limits set to `limit`."""

    def run() -> object:
        with contextlib.ExitStack() as stack:
            for name in LONG_LIMITS:
                stack.enter_context(mock.patch.object(cpu, name, limit))
            return fn()

    return run


def measure_prompt(query_len: int, context: int, dtype: torch.dtype, runs: int) -> dict:
    """One prompt step on each route of the cpu backend, calls alternating between routes."""
    query, key, value, k_cache, v_cache, meta = paged_case(
        1, context, query_len, dtype, heads=SMOLLM2_HEADS
    )
    scale = SMOLLM2_HEADS.head_dim**-0.5
    backend = get_backend("cpu")
    fns = {
        route: routed(
            limit, lambda: backend.forward(query, key, value, k_cache, v_cache, meta, scale)
        )
        for route, limit in PROMPT_ROUTES.items()
    }
    for fn in fns.values():  # warm-up: first-touch of scratch, caches
        fn()
    times: dict[str, list[float]] = {route: [] for route in fns}
    for _ in range(runs):
        for route, fn in fns.items():
            times[route].append(time_once(fn) * 1e3)
    row: dict = {"query_len": query_len, "context": context}
    for route, ms in times.items():
        row[route] = {
            "median_ms": round(statistics.median(ms), 2),
            "min_ms": round(min(ms), 2),
            "max_ms": round(max(ms), 2),
        }
    row["kernel_over_sdpa"] = round(row["kernel"]["median_ms"] / row["sdpa"]["median_ms"], 3)
    return row


def prompts_main(dtype: torch.dtype, runs: int) -> int:
    backend = get_backend("cpu")
    print(
        f"prompt steps, SmolLM2 heads {SMOLLM2_HEADS}, block {BLOCK_SIZE}, dtype={dtype}, "
        f"threads={torch.get_num_threads()}, route: {backend.route(dtype)}"
    )
    print(
        f"{'query':>6}{'context':>8}{'sdpa ms (min-max)':>26}{'kernel ms (min-max)':>26}{'ratio':>7}"
    )
    rows = []
    for query_len, context in PROMPT_CASES:
        row = measure_prompt(query_len, context, dtype, runs)
        rows.append(row)
        cells = [
            f"{row[r]['median_ms']:.1f} ({row[r]['min_ms']:.1f}-{row[r]['max_ms']:.1f})"
            for r in PROMPT_ROUTES
        ]
        print(
            f"{query_len:>6}{context:>8}{cells[0]:>26}{cells[1]:>26}{row['kernel_over_sdpa']:>7.2f}"
        )
    print(json.dumps({"mode": "prompts", "dtype": str(dtype), "runs": runs, "cases": rows}))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="cpu", help="attention backend (cpu|reference|auto)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--quick", action="store_true", help="three cases only")
    parser.add_argument("--prompts", action="store_true", help="long prompt steps: SDPA vs kernel")
    parser.add_argument("--runs", type=int, default=7, help="calls per route (--prompts)")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    if args.prompts:
        return prompts_main(dtype, args.runs)
    backend = get_backend(args.backend)
    extension = getattr(backend, "uses_extension", False)
    print(
        f"backend={backend.name} extension={extension} dtype={args.dtype} threads={torch.get_num_threads()}"
    )
    print(
        f"{'kind':<15}{'batch':>6}{'context':>8}{'query':>6}{'paged ms':>11}{'contig ms':>11}{'overhead':>10}"
    )
    rows = []
    for kind, batch, context, query_len in cases(args.quick):
        row = measure(backend, kind, batch, context, query_len, dtype)
        rows.append(row)
        print(
            f"{kind:<15}{batch:>6}{context:>8}{query_len:>6}{row['paged_ms']:>11.3f}"
            f"{row['contiguous_ms']:>11.3f}{row['overhead']:>+10.1%}"
        )
    worst = max(r["overhead"] for r in rows)
    print(f"worst overhead {worst:+.1%} (goal <= +10%)")
    print(
        json.dumps(
            {
                "backend": backend.name,
                "extension": extension,
                "dtype": args.dtype,
                "worst_overhead": worst,
                "cases": rows,
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
