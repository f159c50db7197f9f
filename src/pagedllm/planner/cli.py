"""`pagedllm plan`: how many concurrent sessions a model serves on given memory, and why."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from typing import Any

from pagedllm.kv_dtypes import QUANTIZED_KV_DTYPES, UNQUANTIZED_FIRST_BLOCK_DTYPES
from pagedllm.planner import capacity as cap
from pagedllm.planner.presets import (
    GIB,
    MIB,
    ModelSpec,
    dtype_bytes,
    kv_dtype_bytes,
    parse_size,
    resolve_memory,
    resolve_model,
)
from pagedllm.planner.workloads import (
    TraceEntry,
    describe,
    read_trace,
    sample_distribution,
    trace_workload,
)
from pagedllm.quant_layout import FORMATS

DEFAULT_TARGET = 16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``pagedllm plan``."""
    m = parser.add_argument_group("model and device")
    m.add_argument(
        "--model",
        default="default",
        help="preset name (Llama-3.1-8B, DeepSeek-V3, ...), 'default', an HF model "
        "directory, a config.json or a .gguf file (weights counted as stored)",
    )
    m.add_argument(
        "--memory",
        default="this machine",
        help="device memory in GiB, a device (H100-80GB, H200-141GB, A100-40GB, "
        "A100-80GB, L4-24GB) or 'this machine' (default)",
    )
    m.add_argument(
        "--memory-fraction",
        type=float,
        default=0.9,
        help="share of the memory for weights + activations + cache (default 0.9)",
    )
    m.add_argument(
        "--weight-dtype",
        default="auto",
        help="bf16, fp16, fp32, fp8, int8, int4; auto = the config's dtype (a .gguf: "
        "the dtype of the tensors it dequantises; those kept quantized count as stored)",
    )
    m.add_argument(
        "--kv-dtype",
        default="auto",
        help="cache dtype; auto = bf16 (fp32 for fp32 models); the engine's quantized "
        "formats int8, int4, fp8_e4m3, fp8_e5m2 count their scales",
    )
    m.add_argument(
        "--kv-cache-unquantized-first-block",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a quantized cache keeps each sequence's first block in the weights' dtype "
        "(as the engine's flag; default: on for int4): counted per sequence beside the pool",
    )
    m.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    m.add_argument(
        "--tp", type=int, default=1, help="tensor-parallel degree (memory is per device)"
    )
    m.add_argument("--max-model-len", type=int, help="default: the model's max_position_embeddings")
    m.add_argument(
        "--reserve", type=_size_arg, help="activation reserve, e.g. 2GiB (default: estimated)"
    )
    m.add_argument(
        "--kv-cache-memory",
        type=_size_arg,
        help="KV budget, e.g. 4GiB (a bare number is GiB), instead of deriving it from --memory",
    )
    w = parser.add_argument_group("lengths (one of)")
    source = w.add_mutually_exclusive_group()
    source.add_argument(
        "--context-len",
        type=int,
        nargs="+",
        metavar="N",
        help="fixed sequence lengths, prompt + output (default: a few up to max)",
    )
    source.add_argument(
        "--dist", choices=["sharegpt", "alpaca"], help="a named length distribution"
    )
    source.add_argument(
        "--trace", help="JSONL: prompt_tokens, output_tokens[, prefix_id, prefix_tokens]"
    )
    w.add_argument("--num-requests", type=int, default=1000, help="requests drawn for --dist")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument(
        "--shared-prefix",
        type=int,
        default=0,
        help="tokens of system prompt shared by all (or by each trace prefix_id)",
    )
    w.add_argument(
        "--block-size-tolerance",
        type=float,
        default=0.05,
        help="sessions one may give up for larger blocks (default 0.05 = 5%%)",
    )
    w.add_argument(
        "--target-concurrency",
        type=int,
        help=f"sessions that must fit at once (default {DEFAULT_TARGET})",
    )
    s = parser.add_argument_group("simulation and output")
    s.add_argument(
        "--simulate",
        action="store_true",
        help="replay the lengths through the real scheduler and block manager",
    )
    s.add_argument("--arrival-rate", type=float, default=4.0, help="requests per second (Poisson)")
    s.add_argument("--step-ms", type=float, default=10.0, help="cost model: fixed ms per step")
    s.add_argument(
        "--token-ms", type=float, default=0.05, help="cost model: ms per scheduled token"
    )
    s.add_argument("--sim-requests", type=int, default=200, help="requests replayed (default 200)")
    s.add_argument("--preemption-mode", choices=["recompute", "swap", "auto"], default="recompute")
    s.add_argument("--max-num-seqs", type=int, default=256, help="scheduler: sequences per step")
    s.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="scheduler: tokens per step (chunked prefill); also what a sliding-window "
        "layer holds beside its window while a prompt is computed",
    )
    h = parser.add_argument_group("the cost of holding context (shown when a price is given)")
    h.add_argument("--gpu-hour-price", type=float, help="price of one device for an hour")
    h.add_argument(
        "--gib-hour-price",
        type=float,
        help="device memory price per GiB-hour (default: --gpu-hour-price / device GiB)",
    )
    h.add_argument("--hold-tokens", type=int, help="tokens of context held (default: mean length)")
    h.add_argument(
        "--hold-seconds", type=float, default=300.0, help="time until its next use (default 300)"
    )
    h.add_argument(
        "--prefill-tokens-per-s", type=float, help="measured or given prefill speed (recompute)"
    )
    h.add_argument("--tier-gib-hour-price", type=float, help="slower tier (host RAM, disk) price")
    h.add_argument(
        "--tier-bandwidth",
        type=float,
        default=25.0,
        help="GiB/s from the slower tier back to the device (default 25)",
    )
    s.add_argument("--plot", metavar="FILE.png", help="write the plots (matplotlib)")
    s.add_argument("--json", action="store_true", help="print JSON instead of text")


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def run(args: argparse.Namespace) -> int:
    """Compute the plan, print it (text or JSON), write the plot; 2 on bad input."""
    try:
        plan, entries = _build(args)
        if args.simulate:
            from pagedllm.planner.simulate import simulate_from_plan

            plan["simulation"] = simulate_from_plan(plan, entries, args)
    except ValueError as exc:
        print(f"pagedllm plan: {exc}")
        return 2
    if args.plot:
        from pagedllm.planner.plot import write_plot

        write_plot(plan, args.plot)
    print(json.dumps(plan, indent=2) if args.json else render(plan))
    return 0


def _build(args: argparse.Namespace) -> tuple[dict[str, Any], list[TraceEntry]]:
    """Every figure of the plan, as plain data (what ``--json`` prints), and the trace."""
    if args.tp < 1 or args.block_size < 1:
        raise ValueError("--tp and --block-size must be >= 1")
    spec = resolve_model(args.model)
    max_model_len = args.max_model_len or spec.max_position_embeddings
    plan = _memory_figures(args, spec)
    geometry = cap.model_geometry(
        spec,
        plan["budget"]["kv_budget_bytes"],
        kv_dtype_bytes(plan["dtypes"]["kv"], spec.head_dim, args.block_size),
        args.block_size,
        args.tp,
        args.max_num_batched_tokens,
    )
    workloads, entries = _workloads(args, max_model_len)
    main = max(workloads, key=lambda w: w.mean_length)  # advice sizes for the worst case
    target = args.target_concurrency or DEFAULT_TARGET
    plan |= {
        "model": _model_figures(spec, max_model_len),
        "geometry": {
            **asdict(geometry),
            "num_tokens": geometry.num_tokens,
            "block_bytes": geometry.block_bytes,
        },
        "shared_prefix": args.shared_prefix,
        "workload_shares_prefix": _has_prefix(main),
        "workload": {
            "label": main.label,
            "summary": describe(entries) if entries else None,
            "num_sequences": len(main.lengths),
        },
        "concurrency": [_row(geometry, w, max_model_len) for w in workloads],
        "target_concurrency": target,
        "length_below_target": {
            s: cap.length_below_target(geometry, target, max_model_len, s, args.shared_prefix)
            for s in cap.SCHEMES
        },
        "verdicts": [_verdict(spec, plan, geometry, w, max_model_len) for w in workloads],
        "curve": cap.concurrency_curve(geometry, max_model_len, args.shared_prefix),
    }
    plan |= _advice(args, plan, main, max_model_len, target)
    if args.gpu_hour_price is not None or args.gib_hour_price is not None:
        plan["holding"] = _holding(args, plan, main)
    return plan, entries


def _holding(
    args: argparse.Namespace, plan: dict[str, Any], workload: cap.Workload
) -> dict[str, Any]:
    """The cost of holding one context, and the break-even intervals (planner/holding.py)."""
    from pagedllm.planner.holding import HoldingPrices, holding_cost

    memory = plan["device"]["memory_bytes"]
    device_hour = args.gpu_hour_price
    if device_hour is None:  # only a GiB-hour price: the device's hour from its memory
        device_hour = args.gib_hour_price * memory / GIB
    prices = HoldingPrices(
        device_hour=device_hour,
        device_memory_bytes=memory,
        prefill_tokens_per_s=args.prefill_tokens_per_s,
        tier_gib_hour=args.tier_gib_hour_price,
        tier_gib_per_s=args.tier_bandwidth,
        device_gib_hour=args.gib_hour_price,
    )
    tokens = args.hold_tokens or max(1, round(workload.mean_length))
    cost = holding_cost(plan["kv_bytes_per_token"], tokens, args.hold_seconds, prices)
    return asdict(cost) | {
        "resident_gib_hour": prices.resident_gib_hour,
        "tier_gib_hour": prices.tier_gib_hour,
        "device_hour": prices.device_hour,
    }


def _memory_figures(args: argparse.Namespace, spec: ModelSpec) -> dict[str, Any]:
    """Dtypes, bytes per token, weights and the KV budget on one device."""
    device = resolve_memory(args.memory)
    weight_dtype = spec.weight_dtype if args.weight_dtype == "auto" else args.weight_dtype
    kv_dtype = args.kv_dtype
    if kv_dtype == "auto":
        kv_dtype = "float32" if dtype_bytes(weight_dtype) == 4 else "bfloat16"
    weights = cap.weight_bytes(spec, dtype_bytes(weight_dtype), args.tp)
    kv_bytes = kv_dtype_bytes(kv_dtype, spec.head_dim, args.block_size)
    reserve = args.reserve
    if reserve is None:
        reserve = cap.reserve_bytes_estimate(spec, args.tp)
    budget = cap.kv_budget(device.memory_bytes, args.memory_fraction, weights, reserve)
    if args.kv_cache_memory is not None:
        budget = cap.Budget(
            device.memory_bytes, args.memory_fraction, weights, reserve, args.kv_cache_memory
        )
    return {
        "device": {"name": device.name, "memory_bytes": device.memory_bytes, "tp": args.tp},
        "dtypes": {"weights": _weights_label(spec, weight_dtype), "kv": kv_dtype},
        "kv_bytes_per_token": cap.kv_bytes_per_token(spec, kv_bytes, args.tp),
        "kv_formula": cap.kv_formula(spec, kv_bytes, args.tp),
        "first_block_bytes": _first_block_bytes(args, spec, kv_dtype, weight_dtype),
        "budget": asdict(budget),
        "budget_given": args.kv_cache_memory is not None,
    }


def _weights_label(spec: ModelSpec, weight_dtype: str) -> str:
    """The weights' dtype; a GGUF's formats as stored, the rest in ``weight_dtype``."""
    if spec.gguf is None:
        return weight_dtype
    formats = dict.fromkeys(t.type_name for t in spec.gguf.tensors if t.type_name in FORMATS)
    return f"{'/'.join(formats) or 'none'} as stored, the rest {weight_dtype}"


def _first_block_bytes(
    args: argparse.Namespace, spec: ModelSpec, kv_dtype: str, weight_dtype: str
) -> int | None:
    """Bytes a sequence's unquantized first block takes beside the pool (its pool block
    stays allocated), or None when the cache does not keep one: the engine's rule."""
    keep = getattr(args, "kv_cache_unquantized_first_block", None)
    if keep is None:
        keep = kv_dtype in UNQUANTIZED_FIRST_BLOCK_DTYPES
    if not keep or kv_dtype not in QUANTIZED_KV_DTYPES:
        return None
    element = 4 if dtype_bytes(weight_dtype) == 4 else 2  # staging: the compute dtype
    return cap.kv_bytes_per_token(spec, element, args.tp) * args.block_size


def _model_figures(spec: ModelSpec, max_model_len: int) -> dict[str, Any]:
    layout = cap.kv_cache_groups(spec)
    return {
        "name": spec.name,
        "attention": spec.attention,
        "num_layers": spec.num_layers,
        "params": cap.param_count(spec),
        "max_model_len": max_model_len,
        # How the engine groups the layers (one block table each; ``core/kv_groups.py``).
        "kv_cache_groups": [
            {"sliding_window": group.sliding_window, "layers": list(group.layers)}
            for group in layout.groups
        ],
    }


def _verdict(
    spec: ModelSpec,
    plan: dict[str, Any],
    geometry: cap.CacheGeometry,
    workload: cap.Workload,
    max_model_len: int,
) -> str:
    budget = cap.Budget(**plan["budget"])
    conc = cap.max_concurrency(geometry, workload, max_model_len)
    return cap.verdict(spec.name, budget, workload, conc, plan["kv_bytes_per_token"])


def _advice(
    args: argparse.Namespace,
    plan: dict[str, Any],
    workload: cap.Workload,
    max_model_len: int,
    target: int,
) -> dict[str, Any]:
    """Block size and memory fraction, tuned to the workload, with their reasons."""
    budget, kvpt = plan["budget"], plan["kv_bytes_per_token"]
    scheme = "paged_shared" if args.shared_prefix or _has_prefix(workload) else "paged"
    blocks = cap.recommend_block_size(
        budget["kv_budget_bytes"],
        kvpt,
        workload,
        max_model_len,
        tolerance=args.block_size_tolerance,
    )
    fraction = cap.recommend_memory_fraction(
        budget["memory_bytes"],
        budget["weight_bytes"],
        budget["reserve_bytes"],
        kvpt,
        args.block_size,
        workload,
        target,
        scheme,
    )
    return {
        "block_size_advice": {
            "block_size": blocks.block_size,
            "reasoning": blocks.reasoning,
            "rows": [asdict(r) for r in blocks.rows],
        },
        "memory_fraction_advice": asdict(fraction) | {"scheme": scheme},
    }


def _workloads(
    args: argparse.Namespace, max_model_len: int
) -> tuple[list[cap.Workload], list[TraceEntry]]:
    if args.trace:
        entries = read_trace(args.trace, args.shared_prefix)
        return [trace_workload(f"trace {args.trace}", entries)], entries
    if args.dist:
        entries = sample_distribution(
            args.dist, args.num_requests, max_model_len, args.seed, args.shared_prefix
        )
        return [trace_workload(f"{args.dist}-like lengths", entries)], entries
    lengths = args.context_len or sorted(
        {min(n, max_model_len) for n in (1024, 8192, 32768, max_model_len)}
    )
    for n in lengths:
        if not 1 <= n <= max_model_len:
            raise ValueError(
                f"--context-len {n}: must be between 1 and max_model_len {max_model_len}"
            )
    workloads = [cap.fixed_workload(n, args.shared_prefix) for n in lengths]
    if not args.simulate:
        return workloads, []
    # Fixed lengths, simulated: the lengths in turn, one request each.
    entries = [
        _fixed_entry(lengths[i % len(lengths)], args.shared_prefix)
        for i in range(args.sim_requests)
    ]
    return workloads, entries


def _fixed_entry(length: int, shared_prefix: int) -> TraceEntry:
    # A fixed-length session for the simulator: an eighth of it generated, the rest prompt.
    output = max(1, length // 8)
    prompt = max(1, length - output)
    prefix = min(shared_prefix, prompt)
    return TraceEntry(prompt, length - prompt, "system" if prefix else None, prefix)


def _has_prefix(workload: cap.Workload) -> bool:
    return any(workload.prefix_key(i) for i in range(len(workload.lengths)))


def _row(geometry: cap.CacheGeometry, workload: cap.Workload, max_model_len: int) -> dict[str, Any]:
    conc = cap.max_concurrency(geometry, workload, max_model_len)
    return {"label": workload.label, "mean_length": workload.mean_length, **asdict(conc)}


def _first_block_lines(plan: dict[str, Any]) -> list[str]:
    first = plan.get("first_block_bytes")
    if not first:
        return []
    return [
        f"            + {first:,} bytes a sequence: its first block unquantized, in the "
        "model's dtype beside the pool (and per cached first block)"
    ]


def render(plan: dict[str, Any]) -> str:
    """The plan as text: figures, formula, table, verdict, recommendations with reasons."""
    model, device, budget, geo = plan["model"], plan["device"], plan["budget"], plan["geometry"]
    mem = budget["memory_bytes"]
    lines = [
        f"pagedllm plan: {model['name']} on {device['name']} ({mem / GIB:.2f} GiB per device, "
        f"tp {device['tp']})",
        f"  model     {model['attention'].upper()}, {model['num_layers']} layers, "
        f"{model['params'] / 1e9:.2f}B parameters, max_model_len {model['max_model_len']:,}",
        f"  KV/token  {plan['kv_formula']}",
        *_first_block_lines(plan),
        f"  weights   {model['params'] / 1e9:.2f}B x {plan['dtypes']['weights']} / tp = "
        f"{budget['weight_bytes'] / GIB:.2f} GiB per device ({budget['weight_bytes'] / mem:.0%} of memory)",
    ]
    if plan["budget_given"]:
        lines.append(
            f"  KV budget {budget['kv_budget_bytes'] / GIB:.2f} GiB (given by --kv-cache-memory)"
        )
    else:
        lines.append(
            f"  KV budget {mem / GIB:.2f} GiB x {budget['memory_fraction']:.2f} - "
            f"{budget['weight_bytes'] / GIB:.2f} GiB weights - {budget['reserve_bytes'] / GIB:.2f} GiB "
            f"activation reserve = {budget['kv_budget_bytes'] / GIB:.2f} GiB"
        )
    lines.append(
        f"  blocks    {geo['num_blocks']:,} blocks x {geo['block_size']} tokens "
        f"({geo['block_bytes'] / MIB:.2f} MiB each) = {geo['num_tokens']:,} tokens"
    )
    lines += _window_lines(plan)
    if plan["workload"]["summary"]:
        lines.append(f"  lengths   {plan['workload']['label']}: {plan['workload']['summary']}")
    lines += [
        "",
        *_concurrency_table(plan),
        "",
        *_below_target(plan),
        "",
        *(f"verdict: {v}" for v in plan["verdicts"]),
    ]
    lines += ["", *_block_size_table(plan), "", *_fraction_lines(plan)]
    if plan.get("holding"):
        lines += ["", *_holding_lines(plan["holding"], plan["kv_bytes_per_token"])]
    if plan.get("simulation"):
        from pagedllm.planner.simulate import render_simulation

        lines += ["", *render_simulation(plan["simulation"])]
    return "\n".join(lines)


def _window_lines(plan: dict[str, Any]) -> list[str]:
    """How sliding-window layers are counted, for a model that has them."""
    groups, geo = plan["model"]["kv_cache_groups"], plan["geometry"]
    windows = sorted({g["sliding_window"] for g in groups if g["sliding_window"] is not None})
    if not windows:
        return []
    per_block = len(groups[0]["layers"])
    num_full = sum(len(g["layers"]) for g in groups if g["sliding_window"] is None)
    shape = (
        f"{len(groups)} KV cache groups of {per_block} layer{'s' * (per_block > 1)} "
        f"({num_full} full-attention), a block holding one group's"
        if len(groups) > 1
        else "every layer slides"
    )
    return [
        f"  windows   {', '.join(map(str, windows))} tokens: {shape}; a sliding group holds at "
        f"most ceil((W - 1 + step) / {geo['block_size']}) + 1 blocks of a sequence "
        f"(step 1 decoding, {geo['step_tokens']:,} computing a prompt), a full group every "
        "block; one block is the placeholder"
    ]


def _concurrency_table(plan: dict[str, Any]) -> list[str]:
    shared = plan["shared_prefix"]
    shared_head = f"paged+{shared}-token prompt" if shared else "paged+shared prompt"
    head = f"  {'length':<22} {'contig. max-len':>15} {'contig. exact':>14} {'paged':>9} {shared_head:>26}"
    lines = ["maximum concurrent sequences (per device = per TP group)", head]
    for row in plan["concurrency"]:
        lines.append(
            f"  {row['label']:<22} {row['contiguous_max']:>15,} {row['contiguous_exact']:>14,} "
            f"{row['paged']:>9,} {row['paged_shared']:>26,}"
        )
    if not plan["workload_shares_prefix"]:
        lines.append("  (no shared prompt given: --shared-prefix N or trace prefix_id)")
    return lines


def _below_target(plan: dict[str, Any]) -> list[str]:
    target = plan["target_concurrency"]
    lines = [f"context length at which concurrency drops below {target}:"]
    for scheme, length in plan["length_below_target"].items():
        label = cap.SCHEME_LABELS[scheme]
        if length is None:
            text = f"never up to max_model_len {plan['model']['max_model_len']:,}"
        elif scheme == "contiguous_max":
            text = f"at every length: each sequence reserves max_model_len, {plan['concurrency'][0]['contiguous_max']:,} fit"
        elif length == 1:
            text = "at every length (not even 1-token sequences fit)"
        else:
            text = f"{length:,} tokens ({target} fit up to {length - 1:,})"
        lines.append(f"  {label + ':':<38} {text}")
    return lines


def _block_size_table(plan: dict[str, Any]) -> list[str]:
    advice = plan["block_size_advice"]
    nothing = " nothing fits at any block size" if advice["block_size"] is None else ""
    lines = [
        f"block size for {plan['workload']['label']}:{nothing}",
        f"  {'size':>5} {'blocks':>10} {'blocks/seq':>11} {'last-block waste':>17} "
        f"{'prompt unshared':>16} {'concurrency':>12} {'block ops/1k tok':>17}",
    ]
    for r in advice["rows"]:
        lines.append(
            f"  {r['block_size']:>5} {r['num_blocks']:>10,} {r['blocks_per_seq']:>11.1f} "
            f"{r['internal_waste_tokens']:>8.1f} ({r['internal_waste_fraction']:>5.1%}) "
            f"{r['prefix_unshared_tokens']:>16} {r['concurrency']:>12,} {r['table_ops_per_1k_tokens']:>17.1f}"
        )
    if advice["block_size"] is None:
        lines.append(f"  no --block-size to recommend: {advice['reasoning']}")
    else:
        lines.append(f"  recommended --block-size {advice['block_size']}: {advice['reasoning']}")
    return lines


def _fraction_lines(plan: dict[str, Any]) -> list[str]:
    advice = plan["memory_fraction_advice"]
    target = plan["target_concurrency"]
    head = f"memory fraction for {target} concurrent sessions of {plan['workload']['label']}"
    if plan["budget_given"]:
        return [f"{head}: not applicable (--kv-cache-memory given)"]
    choice = (
        "cannot be met" if advice["memory_fraction"] is None else f"{advice['memory_fraction']:.2f}"
    )
    return [f"{head} ({advice['scheme']}): {choice}", f"  {advice['reasoning']}"]


def _holding_lines(h: dict[str, Any], kvpt: int) -> list[str]:
    when = _duration(h["seconds"])
    lines = [
        f"holding context: {h['num_tokens']:,} tokens x {kvpt:,} bytes/token = "
        f"{h['bytes'] / GIB:.3f} GiB, next used after {when}",
        f"  resident   {h['resident_gib_hour']:.4g}/GiB-hour (device {h['device_hour']:.4g}/hour "
        f"over its memory): {h['resident']:.6f}",
    ]
    if h["tier"] is not None:
        lines.append(
            f"  tier       {h['tier_gib_hour']:.4g}/GiB-hour + {h['tier_load_s']:.3f} s of device "
            f"time to load it back: {h['tier']:.6f}"
        )
    if h["recompute"] is None:
        lines.append("  recompute  give --prefill-tokens-per-s (measured) to compare")
    else:
        lines.append(f"  recompute  {h['recompute_s']:.3f} s of device time: {h['recompute']:.6f}")
    until = [f"keep it resident if reused within {_duration(h['resident_until_s'])}"]
    if h["tier_until_s"] is not None:
        until.append(f"on the tier within {_duration(h['tier_until_s'])}")
    if h["recompute"] is not None:
        until.append("else recompute it")
    lines += [f"  break-even: {'; '.join(until)}", f"  cheapest for this reuse: {h['cheapest']}"]
    return lines


def _duration(seconds: float) -> str:
    if seconds == float("inf"):
        return "any time"
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 7200:
        return f"{seconds / 60:.3g} min"
    return f"{seconds / 3600:.3g} h"
