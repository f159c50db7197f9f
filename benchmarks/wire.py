"""Microseconds to encode and decode one step's messages between the server and the core.

    deltas_us          one ``Deltas`` frame of --num-seqs requests, one new token each:
                       the core encodes it, the server decodes it (every step)
    deltas_logprobs_us the same with 5 top logprobs per token
    add_us             one ``AddRequests`` frame of --num-seqs requests of 64 prompt tokens
                       (every request once)
    *_bytes            the frame's size

Best of --repeat passes of --iters round trips, CPU time of this process
(time.process_time), so a busy shared machine does not inflate it. Prints a table, then
one JSON line.

    .venv/bin/python benchmarks/wire.py [--quick] [--num-seqs 256]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable

from pagedllm.core.outputs import TokenLogprob
from pagedllm.engine.messages import AddRequests, Codec, Deltas, RequestSpec
from pagedllm.engine.outputs import RequestDelta, SequenceDelta
from pagedllm.sampling_params import SamplingParams


def deltas(num_seqs: int, num_logprobs: int) -> Deltas:
    logprobs = None
    if num_logprobs:
        top = tuple(range(5, 5 + num_logprobs))
        entry = TokenLogprob(5, -0.25, 1, top, tuple(-0.25 * i for i in range(num_logprobs)))
        logprobs = (entry,)
    return Deltas(
        tuple(
            RequestDelta(f"cmpl-{i:08x}-0", (SequenceDelta(0, (1000 + i,), logprobs),), False, 16)
            for i in range(num_seqs)
        )
    )


def add_requests(num_seqs: int) -> AddRequests:
    params = SamplingParams(max_tokens=128, temperature=0.7, top_p=0.9, stop=("\n\n",))
    return AddRequests(
        tuple(
            RequestSpec(f"cmpl-{i:08x}-0", list(range(i, i + 64)), params) for i in range(num_seqs)
        )
    )


def round_trip_us(codec: Codec, message: object, iters: int, repeat: int) -> tuple[float, int]:
    """Best microseconds per encode + decode of ``message``, and its frame's bytes."""

    frame = codec.encode(message, 1)
    if codec.decode(frame).message != message:
        raise SystemExit(f"{type(message).__name__} did not round-trip")
    return _best(lambda: codec.decode(codec.encode(message, 1)), iters, repeat), len(frame)


def _best(fn: Callable[[], object], iters: int, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.process_time()
        for _ in range(iters):
            fn()
        best = min(best, (time.process_time() - start) / iters)
    return best * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args(argv)
    if args.quick:
        args.iters, args.repeat = min(args.iters, 10), min(args.repeat, 2)
    codec = Codec()
    results: dict[str, float | int] = {"num_seqs": args.num_seqs}
    cases = {
        "deltas": deltas(args.num_seqs, 0),
        "deltas_logprobs": deltas(args.num_seqs, 5),
        "add": add_requests(args.num_seqs),
    }
    for name, message in cases.items():
        us, size = round_trip_us(codec, message, args.iters, args.repeat)
        results[f"{name}_us"] = round(us, 1)
        results[f"{name}_bytes"] = size
    print(f"{'message':<18}{'us':>10}{'bytes':>10}   ({args.num_seqs} requests)")
    for name in cases:
        print(f"{name:<18}{results[f'{name}_us']:>10}{results[f'{name}_bytes']:>10}")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
