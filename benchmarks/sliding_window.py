"""Blocks a long generation holds on a sliding-window model, measured from block tables.

A tiny random model generates ``--tokens`` tokens greedily through the engine; after every
step each KV cache group's block table is read and its real blocks counted (entries
released out of the window point at the manager's placeholder). ``--family mistral``: every
layer slides (window ``--window``), one table. ``--family gemma3``: five local layers (window
``--window``) and one global layer, as Gemma 3 interleaves them: one full group and five
sliding groups, each with its own table. A sliding group's bound is ceil(window /
block_size) + 1; the full group (and any table without the release) holds ceil(tokens /
block_size). Prints a table and one JSON line.

    python benchmarks/sliding_window.py --tokens 32768 --window 512 --block-size 16
    python benchmarks/sliding_window.py --family gemma3 --tokens 32768 --window 512
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

# Gemma 3's pattern: five local layers, then a global one.
GEMMA3_LAYERS = ["sliding_attention"] * 5 + ["full_attention"]


def tiny_model(path: Path, family: str, window: int, max_len: int) -> Path:
    from pagedllm.testing import make_tiny_checkpoint

    if family == "mistral":
        return make_tiny_checkpoint(
            path, "mistral", sliding_window=window, max_position_embeddings=max_len
        )
    return make_tiny_checkpoint(
        path,
        "gemma3_text",
        sliding_window=window,
        num_hidden_layers=len(GEMMA3_LAYERS),
        layer_types=GEMMA3_LAYERS,
        max_position_embeddings=max_len,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=("mistral", "gemma3"), default="mistral")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=256, help="max_num_batched_tokens")
    args = parser.parse_args()

    import torch

    from pagedllm.engine.config import EngineConfig
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.sampling_params import SamplingParams

    torch.set_num_threads(1)
    bs, window = args.block_size, args.window
    with tempfile.TemporaryDirectory() as tmp:
        path = tiny_model(Path(tmp) / args.family, args.family, window, args.tokens + 64)
        sliding = -(-(window - 1 + args.chunk) // bs) + 1
        num_sliding = 1 if args.family == "mistral" else GEMMA3_LAYERS.count("sliding_attention")
        full = 0 if args.family == "mistral" else -(-args.tokens // bs)
        config = EngineConfig(
            model=str(path),
            dtype="float32",
            block_size=bs,
            num_blocks=full + num_sliding * sliding + 2,
            max_num_batched_tokens=args.chunk,
            enable_prefix_caching=False,
        )
        engine = LLMEngine.from_config(config)
        prompt = [5, 17, 42, 7, 3, 99]
        params = SamplingParams(
            max_tokens=args.tokens - len(prompt), temperature=0, ignore_eos=True
        )
        engine.add_request("long", prompt, params)
        windows = engine.kv.windows
        peaks = [0] * len(windows)
        steps = 0
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
            for group, tables in enumerate(engine.kv.live_group_block_tables()):
                for table in tables.values():
                    real = sum(b != engine.kv.null_block for b in table)
                    peaks[group] = max(peaks[group], real)
        seconds = time.perf_counter() - start
        stats = engine.get_stats()
    bound = -(-window // bs) + 1
    without = -(-args.tokens // bs)
    sliding_peaks = [p for p, w in zip(peaks, windows, strict=True) if w is not None]
    full_peaks = [p for p, w in zip(peaks, windows, strict=True) if w is None]
    rows = [
        ("model", f"{args.family}, {len(windows)} KV cache group(s)"),
        ("tokens generated (with prompt)", args.tokens),
        ("window / block size", f"{window} / {bs}"),
        ("pool blocks (incl. placeholder)", config.num_blocks),
        ("peak real blocks, each sliding group", sliding_peaks),
        ("peak real blocks, full group", full_peaks or "-"),
        ("bound ceil(W/bs)+1 (sliding)", bound),
        ("blocks without release", without),
        ("blocks released out of the window", stats.cache.window_freed_blocks),
        ("preemptions", stats.num_preemptions),
        ("engine steps", steps),
        ("seconds (AMD EPYC, 1 thread, no AMX)", f"{seconds:.1f}"),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    result = {
        "benchmark": "sliding_window",
        "family": args.family,
        "tokens": args.tokens,
        "window": window,
        "block_size": bs,
        "peak_blocks": max(sliding_peaks),
        "sliding_group_peaks": sliding_peaks,
        "full_group_peaks": full_peaks,
        "bound": bound,
        "blocks_without_release": without,
        "released": stats.cache.window_freed_blocks,
        "within_bound": max(sliding_peaks) <= bound,
        "seconds": round(seconds, 1),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
