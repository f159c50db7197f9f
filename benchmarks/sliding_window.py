"""Blocks a long generation holds on a sliding-window model, measured from block tables.

A tiny random Mistral (window ``--window``, every layer sliding) generates ``--tokens``
tokens greedily through the engine; after every step the sequence's block table is read and
its real blocks counted (entries released out of the window point at the manager's
placeholder). The bound is ceil(window / block_size) + 1; without the release the table
would hold ceil(tokens / block_size). Prints a table and one JSON line.

    python benchmarks/sliding_window.py --tokens 32768 --window 512 --block-size 16
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=256, help="max_num_batched_tokens")
    args = parser.parse_args()

    import torch

    from pagedllm.engine.config import EngineConfig
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.sampling_params import SamplingParams
    from pagedllm.testing import make_tiny_checkpoint

    torch.set_num_threads(1)
    bs, window = args.block_size, args.window
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_checkpoint(
            Path(tmp) / "mistral",
            "mistral",
            sliding_window=window,
            max_position_embeddings=args.tokens + 64,
        )
        needed = -(-(window - 1 + args.chunk) // bs) + 1
        config = EngineConfig(
            model=str(path),
            dtype="float32",
            block_size=bs,
            num_blocks=needed + 2,
            max_num_batched_tokens=args.chunk,
            enable_prefix_caching=False,
        )
        engine = LLMEngine.from_config(config)
        prompt = [5, 17, 42, 7, 3, 99]
        params = SamplingParams(
            max_tokens=args.tokens - len(prompt), temperature=0, ignore_eos=True
        )
        engine.add_request("long", prompt, params)
        peak = steps = 0
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
            for table in engine.kv.live_block_tables().values():
                peak = max(peak, sum(b != engine.kv.null_block for b in table))
        seconds = time.perf_counter() - start
        stats = engine.get_stats().cache
    bound = -(-window // bs) + 1
    without = -(-args.tokens // bs)
    rows = [
        ("tokens generated (with prompt)", args.tokens),
        ("window / block size", f"{window} / {bs}"),
        ("pool blocks (incl. placeholder)", config.num_blocks),
        ("peak real blocks in the table", peak),
        ("bound ceil(W/bs)+1", bound),
        ("blocks without release", without),
        ("blocks released out of the window", stats.window_freed_blocks),
        ("engine steps", steps),
        ("seconds", f"{seconds:.1f}"),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    result = {
        "benchmark": "sliding_window",
        "tokens": args.tokens,
        "window": window,
        "block_size": bs,
        "peak_blocks": peak,
        "bound": bound,
        "blocks_without_release": without,
        "released": stats.window_freed_blocks,
        "within_bound": peak <= bound,
        "seconds": round(seconds, 1),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
