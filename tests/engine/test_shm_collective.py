"""The shared-memory all-gather alone: 2 and 3 ranks (processes) exchanging pieces of
varying shapes and dtypes byte for byte, a buffer grown on demand, a stalled and a dead
peer raising within the timeout, and nothing left in /dev/shm afterwards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm.engine.executor.shm_collective import leftover_names
from pagedllm.util.net import free_port

RANK = Path(__file__).with_name("shm_gather_rank.py")
TIMEOUT_S = 60


def _run_group(world_size: int, mode: str, timeout_s: float) -> list[dict]:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ranks = [
        subprocess.Popen(
            [sys.executable, str(RANK), str(r), str(world_size), str(port), mode, str(timeout_s)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )  # fmt: skip
        for r in range(world_size)
    ]
    results = []
    try:
        for proc in ranks:
            out, err = proc.communicate(timeout=TIMEOUT_S)
            assert proc.returncode == 0, err[-3000:]
            lines = out.strip().splitlines()
            results.append(json.loads(lines[-1]) if lines else {})
    finally:
        for proc in ranks:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


@pytest.fixture
def no_leftovers():
    before = set(leftover_names())
    yield
    assert set(leftover_names()) - before == set()


@pytest.mark.parametrize("world_size", [2, 3])
def test_gathers_every_rank_byte_for_byte_in_rank_order(world_size: int, no_leftovers):
    results = _run_group(world_size, "gather", 30.0)
    assert [r["rank"] for r in results] == list(range(world_size))
    for r in results:
        assert r["calls"] == 153 and r["grown"]
    assert len({r["bytes"] for r in results}) == 1


def test_a_stalled_peer_raises_within_the_timeout(no_leftovers):
    rank0 = _run_group(2, "stall", 2.0)[0]
    assert "timed out" in rank0["error"] and "rank(s) [1]" in rank0["error"]
    assert 2.0 <= rank0["waited_s"] < 4.0


def test_a_dead_peer_is_noticed_before_the_timeout(no_leftovers):
    rank0 = _run_group(3, "die", 30.0)[0]
    assert "process exited" in rank0["error"]
    assert rank0["waited_s"] < 5.0
