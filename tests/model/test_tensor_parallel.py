"""Tensor parallelism: TP=2 (gathers over shared memory or gloo) gives TP=1's tokens and
float32 logits bit for bit.

Each engine runs in its own process with a timeout (the two ranks talk over shared memory
or gloo on loopback), so a broken collective fails the test instead of hanging it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedllm.engine.executor.shm_collective import leftover_names
from pagedllm.model.tensor_parallel import shard_range
from pagedllm.testing import make_tiny_checkpoint

PARITY = Path(__file__).with_name("tp_parity.py")
LIFECYCLE = Path(__file__).with_name("tp_lifecycle.py")
TIMEOUT_S = 240


def _run(path: Path, tp: int, *extra: str) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, str(PARITY), str(path), str(tp), *extra],
        capture_output=True, text=True, timeout=TIMEOUT_S, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    ("arch", "collective"),
    [("llama", "shm"), ("qwen2", "auto"), ("qwen3", "auto"), ("llama", "gloo")],
)
def test_tp2_tokens_and_logits_equal_tp1(tmp_path: Path, arch: str, collective: str):
    before = set(leftover_names())
    path = make_tiny_checkpoint(tmp_path / arch, arch)
    one, two = _run(path, 1), _run(path, 2, "--tp-collective", collective)
    kind = "gloo" if collective == "gloo" else "shared memory"  # auto: one machine, CPU
    assert two["collective"] == kind and f"gathers over {kind}" in two["decode_route"]
    assert set(leftover_names()) - before == set()  # every name unlinked
    # the workload covers what it claims to: prefix hits, preemption, n=2
    assert one["cached_tokens"] > 0 and one["preemptions"] > 0
    assert len(one["tokens"][-1]) == 2
    assert two["tokens"] == one["tokens"]
    assert len(two["logits"]) == len(one["logits"]) > 10
    assert two["logits"] == one["logits"]  # sha256 of every logits tensor, in order
    assert (two["cached_tokens"], two["preemptions"]) == (one["cached_tokens"], one["preemptions"])
    assert one["resized"][:2] == [48, 24] and one["resized"][2] > 0  # compaction moved blocks
    assert two["resized"] == one["resized"]


def test_tp2_over_a_quantized_cache_equals_tp1(tmp_path: Path):
    """Every rank's cache has rank 0's planned layout: the worker ranks once built theirs
    in the model's dtype whatever kv_cache_dtype said, so only rank 0's heads were int8."""
    path = make_tiny_checkpoint(tmp_path / "llama", "llama")
    one = _run(path, 1, "--kv-cache-dtype", "int8")
    two = _run(path, 2, "--kv-cache-dtype", "int8")
    assert two["tokens"] == one["tokens"]
    assert two["logits"] == one["logits"]


def test_two_machines_launched_apart_equal_one_rank(tmp_path: Path):
    """The torchrun-style rendezvous with two launch commands, as on two machines: node 0
    (the engine, rank 0) and ``pagedllm serve --node-rank 1`` (rank 1 only), meeting at
    127.0.0.1. Node 1 gets no model settings but the checkpoint: it takes dtype, block
    size and the rest from rank 0."""
    path = make_tiny_checkpoint(tmp_path / "llama", "llama")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    node1 = subprocess.Popen(
        [sys.executable, "-m", "pagedllm.cli", "serve", "--model", str(path), "-tp", "2",
         "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1",
         "--master-port", str(port), "--log-level", "warning"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        two = _run(path, 2, str(port))
        assert node1.wait(60) == 0, node1.stderr.read()[-3000:]
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()
    one = _run(path, 1)
    assert two["collective"] == "gloo"  # auto across machines
    assert one["cached_tokens"] > 0 and one["preemptions"] > 0
    assert two["tokens"] == one["tokens"]
    assert two["logits"] == one["logits"]
    assert two["resized"] == one["resized"]


def test_kv_heads_that_do_not_divide_are_refused_naming_both(tmp_path: Path):
    from pagedllm.engine.llm import LLM

    path = make_tiny_checkpoint(tmp_path / "m", num_attention_heads=6, num_key_value_heads=3,
                                hidden_size=96)  # fmt: skip
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 .*num_key_value_heads \(3\)"):
        LLM(model=str(path), dtype="float32", num_blocks=8, tensor_parallel_size=2)


def test_planner_and_engine_agree_on_kv_bytes_per_rank(tmp_path: Path):
    from pagedllm.engine.executor.collectives import LocalCollective
    from pagedllm.model.loader import load_model
    from pagedllm.model.tensor_parallel import TensorParallelModel
    from pagedllm.planner.capacity import kv_bytes_per_token
    from pagedllm.worker.kv_cache import KVCacheSpec

    path = make_tiny_checkpoint(tmp_path / "m")
    raw = json.loads((path / "config.json").read_text())
    loaded = load_model(str(path), "float32", load_tokenizer=False)

    class Half(LocalCollective):  # rank 0 of 2, sharding only (no collective runs)
        world_size = 2

    model = TensorParallelModel(loaded.model, Half())
    spec = KVCacheSpec.from_model_config(model.config, 16, torch.float32)
    assert spec.bytes_per_token == kv_bytes_per_token(raw, 4, tp=2)
    assert spec.bytes_per_token * 2 == kv_bytes_per_token(raw, 4, tp=1)


def test_shard_ranges_cover_the_vocabulary_on_tile_boundaries():
    ranges = [shard_range(320 + 3, 2, r, 16) for r in range(2)]
    assert ranges == [(0, 176), (176, 323)]
    assert [shard_range(64, 4, r) for r in range(4)] == [(0, 16), (16, 32), (32, 48), (48, 64)]


def test_tp_collective_is_checked_against_the_machines():
    from pagedllm.engine.config import EngineConfig
    from pagedllm.engine.executor.collectives import uses_shared_memory

    with pytest.raises(ValueError, match="tp_collective must be one of"):
        EngineConfig(model="m", tp_collective="mpi")
    with pytest.raises(ValueError, match="'shm' needs every rank on one CPU machine"):
        EngineConfig(model="m", tensor_parallel_size=2, nnodes=2, master_port=29500,
                     tp_collective="shm")  # fmt: skip
    across = EngineConfig(model="m", tensor_parallel_size=2, nnodes=2, master_port=29500)
    assert not uses_shared_memory(across)  # auto keeps gloo across machines
    assert uses_shared_memory(EngineConfig(model="m", tensor_parallel_size=2))
    assert not uses_shared_memory(EngineConfig(model="m", tp_collective="gloo"))


def test_tp_llms_in_sequence_release_everything_however_they_end(tmp_path: Path):
    """Issue 47: a second TP=2 ``LLM`` in one process used to fail ("trying to initialize
    the default process group twice"). One ended by ``close()``, by a ``with`` block or by
    dropping it (collected at once, or by ``gc.collect()``) leaves nothing behind; one
    dropped inside a reference cycle is collected when the next one starts."""
    path_a = make_tiny_checkpoint(tmp_path / "a", "llama", seed=1)
    path_b = make_tiny_checkpoint(tmp_path / "b", "qwen2", seed=2)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, str(LIFECYCLE), str(path_a), str(path_b)],
        capture_output=True, text=True, timeout=TIMEOUT_S, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tensor-parallel shutdown" not in done.stderr  # the one left open: ranks told
    report = json.loads(done.stdout.strip().splitlines()[-1])
    cycles, baseline, (tokens_a, tokens_b) = (
        report["cycles"],
        report["baseline"],
        report["reference"],
    )
    assert [c["end"] for c in cycles] == ["cycle", "close", "with", "collect", "drop"]
    assert [c["tokens"] for c in cycles] == [tokens_a, tokens_b, tokens_a, tokens_b, tokens_a]
    held = cycles[0]  # uncollected: the next start had to collect it
    assert held["group_initialized"] and len(held["workers_alive"]) == 1
    for cycle in cycles[1:]:
        assert cycle["workers_alive"] == [], cycle["end"]
        assert not cycle["group_initialized"], cycle["end"]
        assert cycle["shm_named"] == cycle["shm_mapped"] == [], cycle["end"]
        assert cycle["threads"] == baseline["threads"], cycle["end"]
        assert cycle["native_threads"] == baseline["native_threads"], cycle["end"]
    assert "closed" in cycles[1]["error_after_close"]
    assert "close() the other" in cycles[1]["second_refused"]  # one group per process
