"""The router across real process boundaries: two ``pagedllm serve`` replicas and
``pagedllm router`` in their own processes, the replicas' cache events pushed to it
(engine core -> API process -> SSE -> router); a replica killed mid-stream fails only its
stream, and the router sends it nothing more. ``serve --data-parallel-size 2`` comes up
as a router over two replicas and takes them down with it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from pagedllm.util.net import free_port

from .conftest import answers_health, free_port_run, sse_events, wait_until_sync

ENGINE_FLAGS = ["--num-blocks", "256", "--block-size", "4", "--max-model-len", "1024",
                "--num-threads", "1", "--log-level", "warning"]  # fmt: skip


def _start(args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "pagedllm.cli", *args]
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    wait_until_sync(lambda: answers_health(url, proc), timeout, what=f"{url} to come up")


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _complete(base: str, tenant: int, i: int, headers: dict | None = None) -> dict[str, Any]:
    prompt = f"tenant {tenant} system prompt, long enough for blocks. question {i}"
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0}
    response = httpx.post(f"{base}/v1/completions", json=body, headers=headers, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def _stream(base: str, chunks: list[bytes], first_chunk: threading.Event) -> None:
    body = {"prompt": "a long story", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as response:
        for chunk in response.iter_raw():
            chunks.append(chunk)
            first_chunk.set()
    first_chunk.set()


def _replicas(base: str) -> list[dict[str, Any]]:
    return httpx.get(f"{base}/v1/router").json()["replicas"]


def _wait_in_flight(base: str, timeout: float = 60) -> int:
    """The replica the router sent the one request in flight to."""

    def one_in_flight() -> bool:
        return sum(r["in_flight"] for r in _replicas(base)) == 1

    wait_until_sync(one_in_flight, timeout, what="one request in flight")
    return [r["in_flight"] for r in _replicas(base)].index(1)


def _wait_streaming(base: str, timeout: float = 30) -> None:
    """Until the router has every replica's cache event stream open."""

    def all_streaming() -> bool:
        return all(r["event_stream"] for r in _replicas(base))

    wait_until_sync(all_streaming, timeout, what="the router to open the event streams")


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def _all_gone(pids: list[int]) -> bool:
    """True when none of ``pids`` runs (a zombie counts as gone)."""
    states = []
    for pid in pids:
        stat = Path(f"/proc/{pid}/stat")
        try:
            states.append(stat.read_text().rsplit(")", 1)[1].split()[0])
        except (FileNotFoundError, ProcessLookupError):
            states.append("gone")
    return all(state in ("gone", "Z", "X") for state in states)


@pytest.mark.slow
def test_replica_killed_mid_stream(tiny_checkpoint: Path):
    ports = [free_port() for _ in range(3)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    replicas = [
        _start(["serve", "--model", str(tiny_checkpoint), "--port", str(p), *ENGINE_FLAGS])
        for p in ports[1:]
    ]
    router = _start(["router", "--tokenizer", str(tiny_checkpoint), "--port", str(ports[0]),
                     "--replica", urls[1], "--replica", urls[2], "--log-level", "warning"])  # fmt: skip
    procs = [*replicas, router]
    try:
        for url, proc in zip(urls, [router, *replicas], strict=True):
            _wait_healthy(url, proc)
        base = urls[0]
        _wait_streaming(base)
        for i in range(2):
            for tenant in range(2):
                _complete(base, tenant, i)
        report = httpx.get(f"{base}/v1/router").json()
        assert report["cache_events"] == "stream"
        assert all(r["event_stream"] for r in report["replicas"])
        served = [r["requests"] for r in report["replicas"]]
        assert sum(served) == 4
        assert [r["predicted_cached_tokens"] for r in report["replicas"]] == [
            r["reported_cached_tokens"] for r in report["replicas"]
        ]
        assert sum(r["reported_cached_tokens"] for r in report["replicas"]) > 0

        # The stream, made deterministic: both replicas stopped (SIGSTOP) while the router
        # picks one (in flight 1: the victim); the victim alone resumes until the client
        # has its first chunk, with 1,000 tokens still to go, and is then killed.
        for proc in replicas:
            proc.send_signal(signal.SIGSTOP)
        chunks: list[bytes] = []
        first_chunk = threading.Event()
        reader = threading.Thread(target=_stream, args=(base, chunks, first_chunk), daemon=True)
        reader.start()
        victim = _wait_in_flight(base)
        replicas[victim].send_signal(signal.SIGCONT)
        assert first_chunk.wait(60), "the victim never streamed"
        orphans = _children(replicas[victim].pid)  # its engine core, mid-generation
        replicas[victim].kill()
        replicas[1 - victim].send_signal(signal.SIGCONT)
        reader.join(60)
        assert not reader.is_alive()
        events = sse_events(b"".join(chunks))
        assert events[-1]["error"]["code"] == "replica_failed"
        assert not any(c["finish_reason"] for e in events[:-1] for c in e.get("choices", ()))
        survivor = 1 - victim
        for i in range(3):
            _complete(base, 0, 10 + i)
        report = httpx.get(f"{base}/v1/router").json()["replicas"]
        assert report[victim]["healthy"] is False and report[survivor]["healthy"] is True
        assert report[victim]["event_stream"] is False and report[survivor]["event_stream"]
        # the survivor's view, pushed across both boundaries, reaches its index exactly
        index = httpx.get(f"{urls[1 + survivor]}/v1/cache/events").json()["snapshot"]
        wait_until_sync(
            lambda: _replicas(base)[survivor]["cached_blocks"] == len(index),
            what=f"the router's view of the survivor to reach its {len(index)} blocks",
        )
        report = _replicas(base)
        assert len(index) > 0
        assert report[survivor]["requests"] == served[survivor] + 3
        metrics = httpx.get(f"{base}/metrics").text
        assert f'pagedllm_router_replica_healthy{{replica="{urls[1 + victim]}"}} 0.0' in metrics
        assert orphans
        wait_until_sync(lambda: _all_gone(orphans), 30, what="the dead server's core to end")
    finally:
        _stop(procs)


@pytest.mark.slow
def test_serve_data_parallel_starts_a_router_over_replicas(tiny_checkpoint: Path):
    port = free_port_run(3)  # the router and two replicas
    base = f"http://127.0.0.1:{port}"
    key = "dp-secret-4711"
    proc = _start(["serve", "--model", str(tiny_checkpoint), "--port", str(port),
                   "--data-parallel-size", "2", "--api-key", key, *ENGINE_FLAGS])  # fmt: skip
    try:
        # healthy: the router reads the replicas' events with their key
        _wait_healthy(base, proc, timeout=180)
        out = _complete(base, 0, 0, headers={"authorization": f"Bearer {key}"})
        assert out["choices"][0]["text"]
        keyless = httpx.post(f"{base}/v1/completions", json={"prompt": "x"}, timeout=60)
        assert keyless.status_code == 401
        replicas = _children(proc.pid)
        assert len(replicas) == 2
        assert not any(key in _cmdline(pid) for pid in replicas)  # passed by environment
        report = httpx.get(f"{base}/v1/router").json()
        assert [r["url"] for r in report["replicas"]] == [
            f"http://127.0.0.1:{port + 1}",
            f"http://127.0.0.1:{port + 2}",
        ]
        assert all(r["healthy"] for r in report["replicas"])
        replica_metrics = httpx.get(
            f"http://127.0.0.1:{port + 1}/metrics", headers={"authorization": f"Bearer {key}"}
        ).text
        assert "pagedllm" in replica_metrics
    finally:
        _stop([proc])
    with pytest.raises(httpx.HTTPError):  # the replicas went down with the router
        httpx.get(f"http://127.0.0.1:{port + 1}/health", timeout=2)
    assert json.dumps(report)
