"""What one all-gather costs alone: gloo over loopback against shared memory, two ranks.

Two processes (one thread each) gather the same tensor over and over, both collectives
in turn, with nothing else between calls: the time per call is the collective's own cost
(copies, signalling, the wake-up of the other rank), without the waits for a slower rank
that a model step adds. Sizes: a decode step's pieces (8 rows of 384 and 1024 float32
columns: half of hidden 768 and of intermediate 2048), the LM head's logits (8 x 16,000)
and a prefill piece (1024 x 384). Medians over ``--rounds`` rounds of ``--calls`` calls.

    .venv/bin/python benchmarks/gather_latency.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = {"decode 8x384": (8, 384), "decode 8x1024": (8, 1024), "logits 8x16000": (8, 16000),
         "prefill 1024x384": (1024, 384)}  # fmt: skip


def per_call_us(gather, x: torch.Tensor, calls: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        gather(x)
    return 1e6 * (time.perf_counter() - start) / calls


def rank_main(rank: int, port: int, args: argparse.Namespace, queue) -> None:
    from pagedllm.engine.executor.collectives import TorchCollective
    from pagedllm.engine.executor.shm_collective import ShmCollective

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=120))  # fmt: skip
    collectives = {"gloo": TorchCollective(), "shm": ShmCollective.setup(None, 120.0)}
    results: dict[str, dict[str, list[float]]] = {s: {c: [] for c in collectives} for s in SIZES}
    for _ in range(args.rounds):
        for size, shape in SIZES.items():
            x = torch.randn(shape)
            calls = max(20, args.calls * 8 * 384 // x.numel())
            for name, comm in collectives.items():
                comm.all_gather(x)  # warm: buffers grown
                results[size][name].append(per_call_us(comm.all_gather, x, calls))
    collectives["shm"].close()
    if rank == 0:
        queue.put(results)
    dist.barrier()
    os._exit(0)  # leave gloo's teardown out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=2000, help="calls at the smallest size")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    ranks = [ctx.Process(target=rank_main, args=(r, port, args, queue)) for r in range(2)]
    for p in ranks:
        p.start()
    results = queue.get(timeout=1200)
    for p in ranks:
        p.join(60)
    from pagedllm.kernels.probe import cpu_info

    cpu = cpu_info()
    print(f"{cpu.model}, {cpu.num_cpus} CPUs; 2 ranks, 1 thread each; float32; "
          f"medians of {args.rounds} rounds (min-max), microseconds per all-gather")  # fmt: skip
    print(f"{'piece':<18} {'KiB':>6} {'gloo us':>22} {'shm us':>22} {'gloo/shm':>9}")
    summary = {}
    for size, by in results.items():
        kib = SIZES[size][0] * SIZES[size][1] * 4 / 1024
        g, m = by["gloo"], by["shm"]
        line = f"{size:<18} {kib:>6.0f}"
        for v in (g, m):
            line += f" {statistics.median(v):>9.1f} ({min(v):.1f}-{max(v):.1f})"
        line += f" {statistics.median(g) / statistics.median(m):>9.1f}"
        print(line)
        summary[size] = {"gloo_us": statistics.median(g), "shm_us": statistics.median(m)}
    print(json.dumps({"bench": "gather_latency", "args": vars(args), "results": summary}))
    sys.exit(0)


if __name__ == "__main__":
    main()
