"""`pagedllm serve`: its flags, and a clean exit on SIGTERM with a stream in flight."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import httpx
import pytest

from pagedllm.server import cli


def test_flags_and_defaults():
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args([])
    assert (args.host, args.port, args.api_key) == ("127.0.0.1", 8000, None)
    assert args.max_queued_requests > 0 and args.served_model_name is None
    args = parser.parse_args(
        ["--model", "m", "--port", "9", "--api-key", "k", "--max-queued-requests", "3",
         "--served-model-name", "x", "--block-size", "8"]
    )  # fmt: skip
    assert (args.model, args.port, args.api_key, args.max_queued_requests) == ("m", 9, "k", 3)
    assert args.served_model_name == "x" and args.block_size == 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_sigterm_finishes_in_flight_stream_and_exits_cleanly(tiny_checkpoint: Any):
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "pagedllm.cli", "serve", "--model", str(tiny_checkpoint),
               "--num-blocks", "64", "--block-size", "4", "--max-model-len", "200",
               "--port", str(port), "--log-level", "warning"]  # fmt: skip
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.2)

        body: dict[str, Any] = {}

        def stream() -> None:
            payload = {"prompt": "tell me", "max_tokens": 150, "stream": True,
                       "ignore_eos": True, "temperature": 0}  # fmt: skip
            with httpx.stream("POST", f"{base}/v1/completions", json=payload, timeout=60) as r:
                chunks = []
                for chunk in r.iter_bytes():
                    chunks.append(chunk)
                    body.setdefault("first", time.monotonic())
                body["content"] = b"".join(chunks)

        reader = threading.Thread(target=stream)
        reader.start()
        while "first" not in body:
            assert reader.is_alive()
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        reader.join(60)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # the in-flight stream was allowed to finish
    content = body["content"]
    assert content.endswith(b"data: [DONE]\n\n")
    last = json.loads(content.split(b"\n\n")[-3][len(b"data: ") :])
    assert last["choices"][0]["finish_reason"] == "length"
