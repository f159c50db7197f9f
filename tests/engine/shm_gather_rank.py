"""One rank of a shared-memory all-gather group, for ``test_shm_collective.py``.

``python shm_gather_rank.py RANK WORLD_SIZE PORT MODE TIMEOUT_S`` joins a gloo group on
127.0.0.1:PORT, sets up a ``ShmCollective`` and runs MODE, printing one JSON line:

- ``gather``: many calls of varying shapes and dtypes, some larger than the initial
  buffer; every rank's piece is checked byte for byte against what that rank sent;
- ``stall``: rank 0 gathers while the others sleep (past the timeout), then exit;
- ``die``: the ranks but 0 exit right after set-up; rank 0 gathers.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from pagedllm.engine.executor.shm_collective import INITIAL_CAPACITY, ShmCollective

SHAPES = [
    ((3, 5), torch.float32),
    ((1, 7), torch.bfloat16),
    ((0, 4), torch.float32),
    ((2, 3, 4), torch.int64),
    ((1,), torch.float16),
    ((4, 9), torch.bool),
    ((6, 33), torch.float32),
]
LARGE = [((512, 1024), torch.float32), ((1024, 1024), torch.float32), ((3, 1000), torch.bfloat16)]


def piece(rank: int, call: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """What ``rank`` sends at ``call``: random bits, NaN payloads included."""
    g = torch.Generator().manual_seed(call * 1000 + rank)
    n = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def workload() -> list[tuple[tuple[int, ...], torch.dtype]]:
    small = [SHAPES[i % len(SHAPES)] for i in range(150)]
    return small[:20] + LARGE[:1] + small[20:80] + LARGE[1:] + small[80:]


def run_gather(comm: ShmCollective) -> dict:
    for call, (shape, dtype) in enumerate(workload()):
        parts = comm.all_gather(piece(comm.rank, call, shape, dtype))
        for rank, part in enumerate(parts):
            want = piece(rank, call, shape, dtype)
            if part.shape != want.shape or part.dtype != want.dtype:
                raise RuntimeError(f"call {call}, rank {rank}: {part.shape} {part.dtype}")
            if not torch.equal(part.view(torch.uint8), want.view(torch.uint8)):
                raise RuntimeError(f"call {call}, rank {rank}: bytes differ")
    grown = comm._mine.capacity > INITIAL_CAPACITY
    return {"calls": comm.num_calls, "bytes": comm.num_bytes, "grown": grown}


def run_waiting(comm: ShmCollective, sleep_s: float | None) -> dict:
    if comm.rank != 0:
        if sleep_s is not None:
            time.sleep(sleep_s)
        return {}
    start = time.perf_counter()
    try:
        comm.all_gather(torch.ones(4))
    except RuntimeError as exc:
        return {"error": str(exc), "waited_s": time.perf_counter() - start}
    return {"error": None}


def main(rank: int, world_size: int, port: int, mode: str, timeout_s: float) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
        timeout=timedelta(seconds=60),
    )  # fmt: skip
    comm = ShmCollective.setup(None, timeout_s)
    if mode == "die" and rank != 0:
        os._exit(0)  # no close: the names were unlinked at set-up
    if mode == "gather":
        result = run_gather(comm)
    else:
        result = run_waiting(comm, 2 * timeout_s if mode == "stall" else None)
    comm.close()
    print(json.dumps({"rank": rank, **result}), flush=True)
    os._exit(0)  # leave gloo's teardown out (a peer may be gone)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], float(sys.argv[5]))
