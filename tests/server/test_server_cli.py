"""`pagedllm serve`: its flags, and a clean exit on SIGTERM with a stream in flight."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import httpx
import pytest

from pagedllm.engine.args import config_from_args
from pagedllm.engine.config import SERVE
from pagedllm.server import cli
from pagedllm.util.net import free_port

from .conftest import answers_health, sse_events, wait_until_sync


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


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ([], (512, 256, 0.128)),
        (["--max-prefill-tokens-while-decoding", "64"], (512, 64, None)),
        (["--max-prefill-time-while-decoding", "50ms"], (512, 256, 0.05)),
        (
            ["--max-num-batched-tokens", "2048"],
            (2048, 256, 0.128),
        ),
        (["--no-enable-chunked-prefill"], (None, None, None)),
    ],
)
def test_scheduling_defaults_set_the_prompt_slice_in_time_unless_a_cap_is_given(flags, expected):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    config = config_from_args(parser.parse_args(flags), SERVE)
    got = (config.max_num_batched_tokens, config.max_prefill_tokens_while_decoding,
           config.max_prefill_time_while_decoding_s)  # fmt: skip
    assert got == expected


@pytest.mark.slow
def test_sigterm_finishes_in_flight_stream_and_exits_cleanly(tiny_checkpoint: Any):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "pagedllm.cli", "serve", "--model", str(tiny_checkpoint),
               "--num-blocks", "64", "--block-size", "4", "--max-model-len", "200",
               "--port", str(port), "--log-level", "warning"]  # fmt: skip
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_until_sync(lambda: answers_health(base, proc), 90, what="the server to come up")

        body: dict[str, Any] = {}

        def stream() -> None:
            payload = {"prompt": "tell me", "max_tokens": 20, "stream": True,
                       "ignore_eos": True, "temperature": 0}  # fmt: skip
            with httpx.stream("POST", f"{base}/v1/completions", json=payload, timeout=60) as r:
                chunks = []
                for chunk in r.iter_bytes():
                    chunks.append(chunk)
                    body.setdefault("first", time.monotonic())
                body["content"] = b"".join(chunks)

        reader = threading.Thread(target=stream)
        reader.start()
        wait_until_sync(lambda: "first" in body or not reader.is_alive(), 60, what="a chunk")
        assert "first" in body
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


def test_shutdown_drains_then_ends_late_streams_with_an_event(make_harness):
    """The path SIGTERM takes (``should_exit``), in process: a short stream finishes, a
    long one is ended after the drain timeout with an error event and [DONE], not cut."""
    h = make_harness(runner_kw={"step_delay_s": 0.05})
    server = cli.server_for(h.app, host="127.0.0.1", port=0, drain_timeout=1.0,
                            log_level="warning")  # fmt: skip
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until_sync(lambda: server.started or not thread.is_alive(), 30, what="uvicorn")
    assert server.started
    base = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    bodies: dict[str, bytes] = {}
    streaming: set[str] = set()

    def stream(name: str, max_tokens: int) -> None:
        payload = {"prompt": name, "max_tokens": max_tokens, "stream": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=payload, timeout=30) as r:
            chunks = []
            for chunk in r.iter_bytes():
                chunks.append(chunk)
                streaming.add(name)
            bodies[name] = b"".join(chunks)

    readers = [threading.Thread(target=stream, args=a) for a in (("short", 8), ("long", 120))]
    for reader in readers:
        reader.start()
    wait_until_sync(lambda: len(streaming) == 2, 30, what="both streams' first chunks")
    server.should_exit = True
    for reader in readers:
        reader.join(30)
    thread.join(30)
    assert not thread.is_alive()
    short, long = (sse_events(bodies[k]) for k in ("short", "long"))
    assert short[-1]["choices"][0]["finish_reason"] == "length"
    assert long[-1]["error"]["code"] == "engine_unavailable"
    stats = h.llm.get_stats()
    assert stats.num_unfinished_requests == 0 and stats.cache.blocks_used == 0
    assert stats.num_requests_aborted == 1
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{base}/health", timeout=2)
