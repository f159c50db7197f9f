"""Tensor-parallel ``LLM``s one after another in one process, each ended a different way.

``python tp_lifecycle.py CHECKPOINT_A CHECKPOINT_B`` runs TP=2 LLMs on A and B in turn,
ended by: dropping the last reference while the LLM sits in a reference cycle (only a
collection frees it), ``close()``, a ``with`` block, dropping it and ``gc.collect()``,
dropping it. Each must start after the one before. It records what each left behind,
runs TP=1 on both for reference, and prints one JSON line; a last TP=2 LLM stays open
until exit, which must stop its ranks before multiprocessing's exit hook kills them. The
collector is off, so that the only collections are the script's and pagedllm's own.
``test_tensor_parallel.py`` runs it in a fresh process: the process group is per
process, so the rest of the suite cannot see or disturb it."""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

PROMPTS = [list(range(30, 42)), list(range(100, 107))]
ENDS = ("cycle", "close", "with", "collect", "drop")


def main(path_a: str, path_b: str) -> Any:
    """Returns one more TP=2 LLM, still open: the caller keeps it until exit."""
    # As a notebook that used tempfile before torch: weakref.finalize's exit hook is now
    # registered before multiprocessing's, and so runs after it.
    weakref.finalize(gc, lambda: None)
    from pagedllm.engine.llm import LLM

    gc.disable()
    baseline = snapshot([])
    paths = [path_a, path_b] * 3
    cycles = [run_cycle(end, path) for end, path in zip(ENDS, paths, strict=False)]
    reference = [tokens(LLM(path, **settings(1))) for path in (path_a, path_b)]
    print(json.dumps({"reference": reference, "baseline": baseline, "cycles": cycles}))
    left_open = LLM(path_b, **settings(2))
    tokens(left_open)
    return left_open


def run_cycle(end: str, path: str) -> dict[str, Any]:
    """Start a TP=2 LLM on ``path``, generate, end it the way ``end`` says; what it made
    and what it left."""
    from pagedllm.engine.llm import LLM

    if end == "with":
        with LLM(path, **settings(2)) as llm:
            workers, made = worker_pids(llm), tokens(llm)
        return {"end": end, "tokens": made, **snapshot(workers)}
    llm = LLM(path, **settings(2))
    workers, made = worker_pids(llm), tokens(llm)
    if end == "close":
        refused = error_of(lambda: LLM(path, **settings(2)))  # while this one is open
        error = close_twice_then_use(llm)
        return {
            "end": end,
            "tokens": made,
            "second_refused": refused,
            "error_after_close": error,
            **snapshot(workers),
        }
    if end == "cycle":
        keep: list[Any] = [llm]
        keep.append(keep)
        del keep
    del llm
    if end == "collect":
        gc.collect()
    return {"end": end, "tokens": made, **snapshot(workers)}


def settings(tp: int) -> dict[str, Any]:
    return {
        "dtype": "float32",
        "num_blocks": 16,
        "block_size": 4,
        "tensor_parallel_size": tp,
        "num_threads": 1,
        "distributed_timeout_s": 60,
    }


def tokens(llm: Any) -> list[list[int]]:
    from pagedllm.sampling_params import SamplingParams

    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]


def close_twice_then_use(llm: Any) -> str | None:
    """Close twice (the second is a no-op), then try the closed LLM: its error."""
    llm.close()
    llm.close()
    return error_of(lambda: tokens(llm))


def error_of(call: Callable[[], object]) -> str | None:
    try:
        call()
    except RuntimeError as exc:
        return str(exc)
    return None


def worker_pids(llm: Any) -> list[int]:
    return [process.pid for process in llm.engine.runner.processes]


def snapshot(workers: list[int]) -> dict[str, Any]:
    """What an ended LLM may have left: its ranks, the process group, shared memory
    (named or still mapped), threads."""
    import torch.distributed as dist

    from pagedllm.engine.shm_collective import PREFIX, leftover_names

    maps = Path("/proc/self/maps").read_text().splitlines()
    return {
        "workers_alive": [pid for pid in workers if Path(f"/proc/{pid}").exists()],
        "group_initialized": dist.is_initialized(),
        "shm_named": leftover_names(),
        "shm_mapped": sorted({line.split(maxsplit=5)[-1] for line in maps if PREFIX in line}),
        "threads": sorted(t.name for t in threading.enumerate()),
        "native_threads": len(os.listdir("/proc/self/task")),
    }


if __name__ == "__main__":
    left_open = main(*sys.argv[1:3])
