"""Engine flags shared by ``pagedllm generate`` and ``pagedllm serve``."""

from __future__ import annotations

import argparse

from pagedllm.core.scheduler import PREEMPTION_MODES
from pagedllm.engine.config import (
    DEFAULT_KV_OFFLOAD_SPACE_GIB,
    DTYPES,
    TP_COLLECTIVES,
    EngineConfig,
)
from pagedllm.kv_dtypes import KV_CACHE_DTYPES
from pagedllm.planner.presets import parse_size as _parse_size


def parse_size(text: str | int) -> int:
    """Bytes from ``4GiB``, ``512MiB``, ``1.5G`` (binary), ``2GB`` (decimal) or ``1024``."""
    return _parse_size(text, bare_unit=1)


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_size_range(text: str | int) -> tuple[int, int | None]:
    """``4GiB`` -> (bytes, None); ``512MiB:4GiB`` -> (MIN, MAX), the elastic pool's range."""
    if isinstance(text, str) and ":" in text:
        low, high = text.split(":", 1)
        low_bytes, high_bytes = parse_size(low), parse_size(high)
        if low_bytes > high_bytes:
            raise ValueError(f"MIN ({low}) is larger than MAX ({high})")
        return low_bytes, high_bytes
    return parse_size(text), None


def _size_range_arg(text: str) -> tuple[int, int | None]:
    try:
        return parse_size_range(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the engine's flags (model, cache, batching, preemption) to ``parser``."""
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--model",
        default="default",
        help="HF directory, .gguf file, or 'default' (SmolLM2-135M-Instruct)",
    )
    group.add_argument("--dtype", default="auto", choices=DTYPES)
    group.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="KV cache format: auto (the model's dtype), a float type, or quantized: int8 "
        "(~1.9x the tokens of bf16), int4 (~3x), fp8_e4m3 / fp8_e5m2 (2x, scale 1)",
    )
    group.add_argument(
        "--kv-cache-unquantized-first-block",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a quantized KV cache keeps each sequence's first block (its first "
        "--block-size tokens, the attention sink) in the model's dtype: about half of "
        "int4's divergence, for one full-precision block per sequence and per cached "
        "first block (at most --max-num-seqs); default: on for int4, off otherwise",
    )
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    group.add_argument(
        "--kv-cache-memory",
        type=_size_range_arg,
        default=None,
        help="KV cache size, e.g. 4GiB (default 1GiB); MIN:MAX (512MiB:4GiB) for the "
        "automatic elastic pool: it grows under load up to MAX and compacts and shrinks "
        "toward MIN after --elastic-idle seconds without requests",
    )
    group.add_argument(
        "--elastic-idle",
        type=float,
        default=30.0,
        help="seconds without requests before the elastic pool shrinks (default 30)",
    )
    group.add_argument(
        "--memory-fraction",
        type=float,
        default=None,
        help="KV cache as a fraction of free memory (instead of --kv-cache-memory)",
    )
    group.add_argument("--num-blocks", type=int, default=None, help=argparse.SUPPRESS)
    group.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest prompt + output (default: the model's, capped by the cache)",
    )
    group.add_argument("--max-num-seqs", type=int, default=256, help="most sequences in one step")
    group.add_argument(
        "--num-scheduler-steps",
        type=int,
        default=1,
        help="greedy decode steps run per schedule when every running request decodes "
        "(multi-step decoding: less per-token Python, tokens arrive in bursts; default 1)",
    )
    group.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="most tokens in one step (default 2048; pagedllm serve: 512)",
    )
    group.add_argument(
        "--max-prefill-tokens-while-decoding",
        type=int,
        default=None,
        help="most prompt tokens in a step that also decodes: shorter gaps between a "
        "stream's tokens while prompts arrive (default: the step's budget; pagedllm serve: "
        "set from --max-prefill-ms-while-decoding, at most 256)",
    )
    group.add_argument(
        "--max-prefill-ms-while-decoding",
        type=float,
        default=None,
        metavar="MS",
        help="the same cap in time: the engine keeps it at the power of two of prompt tokens "
        "nearest to MS milliseconds of prompt work, from the steps it times, at most "
        "--max-prefill-tokens-while-decoding where both are given (pagedllm serve: 128 ms, at "
        "most 256 tokens, unless --max-prefill-tokens-while-decoding alone is given)",
    )
    group.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse cached KV blocks of identical prefixes",
    )
    group.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="split long prompts across steps",
    )
    group.add_argument(
        "--enable-inflight-sharing",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="requests arriving together compute a shared prefix once (the others wait a "
        "step for its blocks)",
    )
    group.add_argument(
        "--pin-waiting-prefixes",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a waiting request keeps its cached prefix from eviction until it runs (a pin "
        "gives way to any allocation that needs the room)",
    )
    group.add_argument("--preemption-mode", default="auto", choices=PREEMPTION_MODES)
    group.add_argument(
        "--swap-space",
        type=float,
        default=0.0,
        help="host swap tier in GiB (for preemption by swap)",
    )
    group.add_argument(
        "--kv-offload-dir",
        default=None,
        help="disk tier under the prefix cache: full KV blocks are kept in this directory "
        "(one of its own; kept across restarts) and loaded instead of recomputed",
    )
    group.add_argument(
        "--kv-offload-space",
        type=float,
        default=DEFAULT_KV_OFFLOAD_SPACE_GIB,
        help=f"most GiB the disk tier holds, least recently used dropped first "
        f"(default {DEFAULT_KV_OFFLOAD_SPACE_GIB:g})",
    )
    group.add_argument(
        "--watermark",
        type=float,
        default=0.01,
        help="fraction of blocks admission keeps free for running requests",
    )
    group.add_argument("--seed", type=int, default=0, help="seed of unseeded sampling")
    group.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "cpu", "reference"],
        help="auto: the fastest available (cpu); reference: the plain ground truth",
    )
    group.add_argument(
        "--num-threads",
        type=int,
        default=None,
        help="torch threads for the model step (default: one per core)",
    )
    group.add_argument("--device", default="cpu")
    group.add_argument(
        "--skip-tokenizer-init",
        action="store_true",
        help="load no tokenizer: requests give token ids and get token ids back",
    )
    dist = parser.add_argument_group("tensor parallelism (torch.distributed)")
    dist.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                      help="ranks sharing every layer (gloo on CPU, NCCL on CUDA); float32 "
                      "outputs are bit-identical to one rank")  # fmt: skip
    dist.add_argument("--nnodes", type=int, default=1, help="machines the ranks span")
    dist.add_argument("--node-rank", type=int, default=0,
                      help="this machine's index; > 0 only starts its ranks (no server)")  # fmt: skip
    dist.add_argument("--master-addr", default="127.0.0.1", help="machine 0's address")
    dist.add_argument("--master-port", type=int, default=None,
                      help="rendezvous port on machine 0 (default on one machine: any free)")  # fmt: skip
    dist.add_argument("--tp-collective", default="auto", choices=TP_COLLECTIVES,
                      help="how ranks gather activations: shm (shared memory, one CPU "
                      "machine), gloo, or auto (shm where it can run)")  # fmt: skip


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The ``EngineConfig`` described by parsed ``add_engine_arguments`` flags."""
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
        kv_cache_unquantized_first_block=getattr(args, "kv_cache_unquantized_first_block", None),
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory[0] if args.kv_cache_memory else None,
        kv_cache_memory_max=args.kv_cache_memory[1] if args.kv_cache_memory else None,
        elastic_idle_s=args.elastic_idle,
        memory_fraction=args.memory_fraction,
        num_blocks=args.num_blocks,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        num_scheduler_steps=args.num_scheduler_steps,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_prefill_tokens_while_decoding=getattr(args, "max_prefill_tokens_while_decoding", None),
        max_prefill_ms_while_decoding=getattr(args, "max_prefill_ms_while_decoding", None),
        enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill,
        enable_inflight_sharing=args.enable_inflight_sharing,
        pin_waiting_prefixes=args.pin_waiting_prefixes,
        preemption_mode=args.preemption_mode,
        swap_space=args.swap_space,
        kv_offload_dir=args.kv_offload_dir,
        kv_offload_space=args.kv_offload_space,
        watermark=args.watermark,
        seed=args.seed,
        attention_backend=args.attention_backend,
        tensor_parallel_size=args.tensor_parallel_size,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        tp_collective=getattr(args, "tp_collective", "auto"),
        device=args.device,
        num_threads=getattr(args, "num_threads", None),
        skip_tokenizer_init=getattr(args, "skip_tokenizer_init", False),
    )
