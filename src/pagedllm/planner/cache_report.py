"""`pagedllm cache-report LOG.jsonl`: why prompts are not cached, and what it costs."""

from __future__ import annotations

import argparse
import json
from typing import Any

from pagedllm.planner import capacity as cap
from pagedllm.planner import divergence as dv
from pagedllm.planner.cache_advisor import analyze, build_report, render_report
from pagedllm.planner.cachelog import MOONCAKE_BLOCK_SIZE, CacheLog, Tokenizer, read_log
from pagedllm.planner.presets import GIB, dtype_bytes, parse_size, resolve_model
from pagedllm.planner.prices import PriceProfile, load_profiles

ENGINE_BLOCK_SIZE = 16  # EngineConfig's default block size
ENGINE_KV_CACHE_MEMORY = GIB  # EngineConfig's default KV budget


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``pagedllm cache-report``."""
    parser.add_argument(
        "log",
        help="JSONL: {messages | prompt | prompt_token_ids | token_ids, cache_salt?, timestamp?} "
        "or Mooncake {timestamp, input_length, output_length, hash_ids}",
    )
    parser.add_argument(
        "--model",
        default="default",
        help="'default' or a Hugging Face model directory: tokenizer, chat template and KV size",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        help=f"tokens per block (default: the engine's, {ENGINE_BLOCK_SIZE}; "
        f"{MOONCAKE_BLOCK_SIZE} for hash traces)",
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--num-blocks", type=int, help="blocks of the configured cache")
    size.add_argument(
        "--kv-cache-memory",
        help="KV budget of the configured cache, e.g. 4GiB (default: the engine's 1GiB; "
        "hash traces: no replay unless given)",
    )
    parser.add_argument("--kv-dtype", default="auto", help="cache dtype for --kv-cache-memory")
    parser.add_argument(
        "--prices", metavar="FILE", help="JSON price profiles replacing or adding to the built-in"
    )
    parser.add_argument(
        "--profile",
        action="append",
        metavar="NAME",
        help="price profile(s) to report (default: all)",
    )
    parser.add_argument(
        "--min-run",
        type=int,
        default=dv.DEFAULT_MIN_RUN,
        help="tokens that must match again after a field for it to count (default %(default)s)",
    )
    parser.add_argument(
        "--max-gap",
        type=int,
        default=dv.DEFAULT_MAX_GAP,
        help="longest varying field, in tokens (default %(default)s)",
    )
    parser.add_argument("--top", type=int, default=10, help="rows shown per table (text)")
    parser.add_argument("--plot", metavar="FILE.png", help="hit rate by position, divergences")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")


def run(args: argparse.Namespace, tokenizer: Tokenizer | None = None) -> int:
    """Read, analyse, print (text or JSON), plot; 2 on bad input. ``tokenizer`` encodes
    text logs (the command line passes the model's; token-id logs need none)."""
    try:
        report = report_for_file(args, tokenizer)
    except ValueError as exc:
        print(f"pagedllm cache-report: {exc}")
        return 2
    if args.plot:
        from pagedllm.planner.plot import write_cache_plot

        write_cache_plot(report, args.plot)
    print(json.dumps(report, indent=2) if args.json else render_report(report, top=args.top))
    return 0


def report_for_file(args: argparse.Namespace, tokenizer: Tokenizer | None) -> dict[str, Any]:
    """The report ``run`` prints, as plain data."""
    log = read_log(args.log, tokenizer)
    profiles = _profiles(args.prices, args.profile)
    block_size = args.block_size
    if block_size is None:
        block_size = MOONCAKE_BLOCK_SIZE if log.is_hash_trace else ENGINE_BLOCK_SIZE
    num_blocks = args.num_blocks
    if num_blocks is None and (args.kv_cache_memory or not log.is_hash_trace):
        # A block-hash trace comes from another deployment: replayed only through a cache
        # sized on purpose; by default its unbounded hits are the answer.
        num_blocks = configured_num_blocks(
            args.model, block_size, args.kv_cache_memory, args.kv_dtype
        )
    analysis = analyze(
        log,
        tokenizer,
        block_size=block_size,
        num_blocks=num_blocks,
        min_run=args.min_run,
        max_gap=args.max_gap,
    )
    return build_report(analysis, profiles, source=args.log, model=args.model)


def _profiles(path: str | None, names: list[str] | None) -> dict[str, PriceProfile]:
    profiles = load_profiles(path)
    if not names:
        return profiles
    unknown = [n for n in names if n not in profiles]
    if unknown:
        raise ValueError(f"unknown price profile(s) {unknown}; known: {sorted(profiles)}")
    return {n: profiles[n] for n in names}


def configured_num_blocks(
    model: str, block_size: int, kv_cache_memory: str | None = None, kv_dtype: str = "auto"
) -> int:
    """Blocks the engine would allocate for ``model`` from a KV budget (default 1 GiB)."""
    spec = resolve_model(model)
    if kv_dtype == "auto":
        kv_dtype = spec.weight_dtype
    budget = ENGINE_KV_CACHE_MEMORY if kv_cache_memory is None else parse_size(kv_cache_memory, 1)
    kvpt = cap.kv_bytes_per_token(spec, dtype_bytes(kv_dtype))
    num_blocks = cap.cache_geometry(budget, kvpt, block_size).num_blocks
    if num_blocks < 1:
        raise ValueError(f"a KV budget of {budget:,} bytes holds no block of {block_size} tokens")
    return num_blocks


def advice_for_log(
    log: CacheLog,
    tokenizer: Tokenizer | None,
    *,
    block_size: int,
    num_blocks: int | None,
    model: str = "",
    source: str = "",
) -> dict[str, Any]:
    """The report over an already parsed log with the built-in price profiles (the server's
    ``GET /v1/cache/advice``)."""
    analysis = analyze(log, tokenizer, block_size=block_size, num_blocks=num_blocks)
    return build_report(analysis, load_profiles(), source=source, model=model)
