"""Paged attention vs the same attention on contiguous tensors of the same lengths.

Decode (one query token per sequence), prefill after a cached prefix and whole-prompt prefill,
for several batch sizes and context lengths, on model (a)'s attention shape (8 heads, 2 KV
heads, head_dim 64).
"paged" is a pagedllm backend reading K/V through shuffled block tables (the step's K/V
write included); "contiguous" is what an engine without paging would run: write the new K/V
into per-sequence contiguous tensors, then ``scaled_dot_product_attention`` on them.
Goal: paged <= 10% over contiguous. Last line: one JSON object.

    .venv/bin/python benchmarks/attention.py [--backend cpu] [--dtype bfloat16] [--quick]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedllm.attention import AttentionMetadata
from pagedllm.attention.select import get_backend

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 8, 2, 64, 16


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


def paged_case(batch: int, context: int, query_len: int, dtype: torch.dtype, seed: int = 0):
    """Shuffled blocks, caches holding each sequence's prefix, a step of `query_len` tokens."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq + 1
    ids = list(range(1, num_blocks))
    random.Random(seed).shuffle(ids)
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    tables = torch.tensor(ids, dtype=torch.int32).view(batch, blocks_per_seq)
    positions = torch.arange(context - query_len, context)
    slots = (tables[:, positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE).view(
        -1
    )
    tokens = batch * query_len
    query = torch.randn(tokens, NUM_HEADS, HEAD_DIM, generator=gen).to(dtype)
    key = torch.randn(tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    value = torch.randn(tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="cpu", help="attention backend (cpu|reference|auto)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--quick", action="store_true", help="three cases only")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
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
