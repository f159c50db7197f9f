"""Load check of the OpenAI server: nothing lost, nothing leaked, no 5xx.

N concurrent clients stream completions and chat completions over real loopback HTTP for
T seconds against a deliberately small KV cache (so that preemption happens). A share of
the clients hang up at a random point of their stream, a share send invalid requests.
At the end every accepted request must have finished or been dropped by its own client,
the pool must be back to no block held by a request (``/v1/cache``), and no answer may
be a 5xx. The server runs in this process on 127.0.0.1 (a random free port), over the
``FakeModelRunner`` by default (``--step-delay`` per step) or a real checkpoint
(``--model``).

Reports requests completed / rejected / aborted / failed, output tokens/s, TTFT and ITL
percentiles (client side), preemptions; a table, then one JSON line. Exit status 1 when
a check fails.

    .venv/bin/python benchmarks/serve_load.py --quick
    .venv/bin/python benchmarks/serve_load.py --clients 32 --duration 30 --num-blocks 48
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import httpx  # noqa: E402

MAX_CLIENTS = 256
MAX_DURATION_S = 600.0
SHARED_PREFIX = "You are a helpful assistant. Answer briefly. "
INVALID_BODIES = [
    b'{"prompt": "unterminated',
    b'{"prompt": "x", "temperature": 9}',
    b'{"prompt": "x", "max_tokens": "ten"}',
    b'{"prompt": "x", "model": "no-such-model"}',
    b'{"prompt": "' + b"z" * 400 + b'", "max_tokens": 4}',
]


@dataclass
class Tally:
    completed: int = 0
    aborted: int = 0  # dropped by their own client, on purpose
    rejected_invalid: int = 0  # invalid requests answered 400
    rejected_busy: int = 0  # 429 queue full
    failed: int = 0  # anything else: 5xx, error events, cut streams, wrong status
    http_5xx: int = 0
    output_tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def fail(self, why: str) -> None:
        self.failed += 1
        if len(self.failures) < 10:
            self.failures.append(why)


# ---------------------------------------------------------------- the server


def build_engine(args: argparse.Namespace) -> Any:
    """The engine the server runs: its core in a process of its own (``--engine-core
    process``, as ``pagedllm serve``) or in a thread of this one."""
    from pagedllm.engine.async_engine import AsyncEngine
    from pagedllm.engine.config import EngineConfig
    from pagedllm.engine.core import ConfigEngineFactory
    from pagedllm.testing import FakeEngineFactory, make_tiny_tokenizer

    engine_kw = {"max_num_seqs": args.max_num_seqs, "preemption_mode": args.preemption_mode}
    if args.model:
        config = EngineConfig(
            model=args.model, block_size=args.block_size, num_blocks=args.num_blocks,
            num_host_blocks=args.host_blocks, max_model_len=args.max_model_len, **engine_kw,
        )  # fmt: skip
        factory: Any = ConfigEngineFactory(config)
    else:
        tokenizer_dir = tempfile.mkdtemp(prefix="serve-load-")
        make_tiny_tokenizer(tokenizer_dir)
        runner_kw = {"num_host_blocks": args.host_blocks, "step_delay_s": args.step_delay}
        factory = FakeEngineFactory(
            tokenizer_dir, num_blocks=args.num_blocks, block_size=args.block_size,
            max_model_len=args.max_model_len, runner_kw=runner_kw, engine_kw=engine_kw,
        )  # fmt: skip
    if args.engine_core == "thread":
        return AsyncEngine.in_thread(
            factory.build_engine(), max_queued_requests=args.max_queued_requests
        )
    return AsyncEngine.launch(factory, max_queued_requests=args.max_queued_requests)


class ServerThread:
    """uvicorn on 127.0.0.1, port 0, in a thread of this process."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(60)


# ---------------------------------------------------------------- the clients


def random_request(rng: random.Random, args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    words = "".join(rng.choice("abcdefghij ") for _ in range(rng.randint(4, args.max_prompt)))
    prompt = (SHARED_PREFIX if rng.random() < 0.5 else "") + words
    common = {
        "max_tokens": rng.randint(4, args.max_output),
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "n": 2 if rng.random() < 0.1 else 1,
    }
    if rng.random() < 0.5:
        return "/v1/completions", {"prompt": prompt, **common}
    return "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}], **common}


async def stream_once(
    client: httpx.AsyncClient,
    path: str,
    body: dict[str, Any],
    tally: Tally,
    hang_up_after: int | None,
) -> None:
    """One streaming request; ``hang_up_after`` chunks, then close (None: read to the end)."""
    start = time.monotonic()
    content_times: list[float] = []
    events: list[Any] = []
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            record_status(tally, response, f"{path} -> {response.status_code}: {text[:200]}")
            return
        buffer = b""
        async for chunk in response.aiter_raw():
            buffer += chunk
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                events.append(parse_event(event))
                if has_content(events[-1]):
                    content_times.append(time.monotonic())
            if hang_up_after is not None and len(events) >= hang_up_after:
                tally.aborted += 1
                return  # leaving the block closes the connection mid-stream
    check_stream(tally, path, events, buffer)
    if content_times:
        tally.ttft.append(content_times[0] - start)
        tally.itl.extend(b - a for a, b in zip(content_times, content_times[1:], strict=False))


def parse_event(raw: bytes) -> Any:
    if not raw.startswith(b"data: "):
        return {"malformed": raw[:80].decode(errors="replace")}
    payload = raw[len(b"data: ") :]
    return "[DONE]" if payload == b"[DONE]" else json.loads(payload)


def has_content(event: Any) -> bool:
    if not isinstance(event, dict):
        return False
    for choice in event.get("choices") or ():
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            return True
    return False


def check_stream(tally: Tally, path: str, events: list[Any], rest: bytes) -> None:
    if rest or not events or events[-1] != "[DONE]":
        tally.fail(f"{path}: stream cut short ({len(events)} events)")
        return
    body = events[:-1]
    errors = [e for e in body if isinstance(e, dict) and ("error" in e or "malformed" in e)]
    if errors:
        tally.fail(f"{path}: error event {errors[0]}")
        return
    usage = body[-1].get("usage") if body else None
    finished = {c["index"] for e in body for c in e.get("choices", ()) if c.get("finish_reason")}
    if not usage or len(finished) == 0:
        tally.fail(f"{path}: no usage event or no finish_reason")
        return
    tally.completed += 1
    tally.output_tokens += usage["completion_tokens"]


def record_status(tally: Tally, response: httpx.Response, what: str) -> None:
    if response.status_code == 429:
        tally.rejected_busy += 1
        return
    if response.status_code >= 500:
        tally.http_5xx += 1
    tally.fail(what)


async def send_invalid(client: httpx.AsyncClient, rng: random.Random, tally: Tally) -> None:
    body = rng.choice(INVALID_BODIES)
    response = await client.post(
        "/v1/completions", content=body, headers={"content-type": "application/json"}
    )
    if response.status_code == 400 and "error" in response.json():
        tally.rejected_invalid += 1
    else:
        record_status(tally, response, f"invalid body got {response.status_code}")


async def client_loop(
    base: str, seed: int, deadline: float, args: argparse.Namespace, tally: Tally
) -> None:
    rng = random.Random(seed)
    timeout = httpx.Timeout(args.request_timeout)
    async with httpx.AsyncClient(base_url=base, timeout=timeout) as client:
        while time.monotonic() < deadline:
            roll = rng.random()
            busy = tally.rejected_busy
            try:
                if roll < args.invalid_share:
                    await send_invalid(client, rng, tally)
                    continue
                path, body = random_request(rng, args)
                hang_up = None
                if roll < args.invalid_share + args.disconnect_share:
                    hang_up = rng.randint(1, 8)
                await stream_once(client, path, body, tally, hang_up)
            except httpx.HTTPError as exc:
                tally.fail(f"transport error: {exc!r}")
            if tally.rejected_busy > busy:  # 429: back off a little, as Retry-After asks
                await asyncio.sleep(rng.uniform(0.05, 0.25))


async def wait_idle(base: str, timeout: float) -> dict[str, Any]:
    """The /v1/cache report once nothing runs (or the last one seen at the deadline)."""
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(base_url=base, timeout=10) as client:
        while True:
            report = (await client.get("/v1/cache")).json()
            idle = report["running"] + report["waiting"] + report["swapped"] == 0
            if (idle and report["server"]["in_flight"] == 0) or time.monotonic() > deadline:
                return report
            await asyncio.sleep(0.05)


async def drive(base: str, args: argparse.Namespace) -> tuple[Tally, dict[str, Any], float]:
    tally = Tally()
    start = time.monotonic()
    deadline = start + args.duration
    await asyncio.gather(
        *(client_loop(base, args.seed + i, deadline, args, tally) for i in range(args.clients))
    )
    elapsed = time.monotonic() - start
    return tally, await wait_idle(base, timeout=10), elapsed


# ---------------------------------------------------------------- report


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0}
    ordered = sorted(values)

    def at(q: float) -> float:
        return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99)}


def summarize(tally: Tally, report: dict[str, Any], elapsed: float) -> dict[str, Any]:
    lost = report["server"]["in_flight"] + report["running"] + report["waiting"]
    lost += report["swapped"]
    leaked = report["blocks_used"] + report["host_blocks_used"]
    result = {
        "completed": tally.completed,
        "rejected": tally.rejected_invalid + tally.rejected_busy,
        "rejected_invalid": tally.rejected_invalid,
        "rejected_busy": tally.rejected_busy,
        "aborted": tally.aborted,
        "failed": tally.failed,
        "http_5xx": tally.http_5xx,
        "lost": lost,
        "leaked_blocks": leaked,
        "output_tokens": tally.output_tokens,
        "elapsed_s": round(elapsed, 2),
        "tokens_per_s": round(tally.output_tokens / elapsed, 1) if elapsed else 0.0,
        "ttft_ms": percentiles(tally.ttft),
        "itl_ms": percentiles(tally.itl),
        "preemptions": report["preemptions"],
        "prefix_hit_rate": round(report["prefix_cache"]["hit_rate"], 3),
        "blocks_total": report["blocks_total"],
    }
    result["ok"] = lost == 0 and leaked == 0 and tally.http_5xx == 0 and tally.failed == 0
    return result


def print_table(result: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"serve_load: {args.clients} clients x {args.duration:.0f} s, "
          f"{args.num_blocks} blocks of {args.block_size}, "
          f"{args.disconnect_share:.0%} hang up, {args.invalid_share:.0%} invalid")  # fmt: skip
    rows = [
        ("completed", result["completed"]),
        ("rejected (invalid / queue full)",
         f"{result['rejected_invalid']} / {result['rejected_busy']}"),
        ("aborted by their client", result["aborted"]),
        ("failed", result["failed"]),
        ("HTTP 5xx", result["http_5xx"]),
        ("lost (accepted, never ended)", result["lost"]),
        ("leaked blocks", result["leaked_blocks"]),
        ("output tokens/s", result["tokens_per_s"]),
        ("TTFT ms p50/p90/p99", "/".join(str(v) for v in result["ttft_ms"].values())),
        ("ITL ms p50/p90/p99", "/".join(str(v) for v in result["itl_ms"].values())),
        ("preemptions (recompute/swap)",
         f"{result['preemptions']['recompute']}/{result['preemptions']['swap']}"),
        ("prefix-cache hit rate", result["prefix_hit_rate"]),
    ]  # fmt: skip
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of load")
    parser.add_argument("--quick", action="store_true", help="8 clients for 5 s")
    parser.add_argument("--model", default=None, help="a checkpoint (default: fake runner)")
    parser.add_argument("--num-blocks", type=int, default=40)
    parser.add_argument("--block-size", type=int, default=4)
    parser.add_argument("--host-blocks", type=int, default=0, help="swap tier (0: recompute)")
    parser.add_argument("--preemption-mode", default="auto")
    parser.add_argument("--max-model-len", type=int, default=160)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-queued-requests", type=int, default=64)
    parser.add_argument("--max-prompt", type=int, default=32, help="longest random prompt part")
    parser.add_argument("--max-output", type=int, default=40)
    parser.add_argument("--step-delay", type=float, default=0.002, help="fake runner s/step")
    parser.add_argument("--disconnect-share", type=float, default=0.2)
    parser.add_argument("--invalid-share", type=float, default=0.1)
    parser.add_argument("--request-timeout", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--engine-core", default="process", choices=("process", "thread"),
        help="where the engine core runs (default: its own process, as pagedllm serve)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.quick:
        args.clients, args.duration = 8, 5.0
    if not 1 <= args.clients <= MAX_CLIENTS:
        parser.error(f"--clients must be in 1..{MAX_CLIENTS}")
    if not 0 < args.duration <= MAX_DURATION_S:
        parser.error(f"--duration must be in (0, {MAX_DURATION_S:.0f}] seconds")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from pagedllm.server.app import create_app

    engine = build_engine(args)
    app = create_app(engine)
    with ServerThread(app) as base:
        tally, report, elapsed = asyncio.run(drive(base, args))
    result = summarize(tally, report, elapsed)
    print_table(result, args)
    for why in tally.failures:
        print(f"  failure: {why}")
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
