"""The advisor replays the server's own traffic: its predicted ``cached_tokens`` must equal
what the server reported (``GET /v1/cache/advice``, and ``--request-log`` + cache-report)."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import httpx
import pytest

from pagedllm.cli import main
from pagedllm.engine.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.server.app import create_app
from pagedllm.server.request_log import RecentRequests

NUM_BLOCKS, BLOCK_SIZE = 48, 4  # 192 slots: the traffic below evicts
HEADS = [
    "You are a terse assistant. Answer: ",
    "Translate to French, keep it short: ",
    "Summarise in one line the text: ",
    "Date 2025-01-0{} | You are a terse assistant. Answer: ",
]


def _bodies(seed: int, count: int) -> list[tuple[str, dict[str, Any]]]:
    rng = random.Random(seed)
    words = ["cat", "dog", "sun", "moon", "tree", "rain", "wind", "fire"]
    out = []
    for i in range(count):
        head = rng.choice(HEADS).format(rng.randint(1, 9))
        tail = " ".join(rng.choice(words) for _ in range(rng.randint(1, 4)))
        max_tokens = rng.randint(1, 6)
        kind = i % 4
        if kind == 3:
            messages = [{"role": "system", "content": head}, {"role": "user", "content": tail}]
            out.append(("/v1/chat/completions", {"messages": messages, "max_tokens": max_tokens}))
            continue
        body: dict[str, Any] = {"prompt": head + tail, "max_tokens": max_tokens}
        if kind == 2:
            body["cache_salt"] = rng.choice(["tenant-a", "tenant-b"])
        out.append(("/v1/completions", body))
    return out


async def _send(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> int:
    body = {"model": "tiny", "temperature": 0.0, "ignore_eos": True, **body}
    response = await client.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture
def app_factory(tiny_checkpoint: Any, tmp_path: Any):
    def make() -> tuple[Any, Any]:
        engine = LLMEngine.from_config(
            EngineConfig(
                model=str(tiny_checkpoint),
                num_blocks=NUM_BLOCKS,
                block_size=BLOCK_SIZE,
                max_model_len=128,
            )
        )
        log = tmp_path / "requests.jsonl"
        return create_app(engine, served_model_name="tiny", request_log=str(log)), log

    return make


def test_replay_of_the_servers_traffic_predicts_what_it_reported(
    app_factory: Any, tiny_checkpoint: Any, capsys: Any
) -> None:
    app, log_path = app_factory()
    bodies = _bodies(seed=4, count=160)

    async def body() -> tuple[list[int], dict[str, Any], int]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as c:
            try:
                assert (await c.get("/v1/cache/advice")).status_code == 400  # nothing yet
                reported = [await _send(c, path, b) for path, b in bodies[:120]]
                # Two tenants at once: their salts keep them apart, so order cannot matter.
                salted = [dict(b[1], cache_salt=f"burst-{i}") for i, b in enumerate(bodies[120:])]
                reported += await asyncio.gather(
                    *(_send(c, "/v1/completions", b) for b in salted if "prompt" in b)
                )
                advice = (await c.get("/v1/cache/advice")).json()
                bad_limit = (await c.get("/v1/cache/advice", params={"limit": 0})).status_code
                return reported, advice, bad_limit
            finally:
                await app.state.engine.shutdown()

    reported, advice, bad_limit = asyncio.run(body())
    assert bad_limit == 400
    assert advice["requests"] == len(reported) and advice["block_size"] == BLOCK_SIZE
    assert advice["num_blocks"] == NUM_BLOCKS
    agreement = advice["reported"]
    assert agreement["requests"] == len(reported)
    assert agreement["reported_cached_tokens"] == sum(reported)
    assert sum(reported) > 0  # the heads are shared, so the server did find blocks
    # The cache evicted: only the replay through the configured KVCacheManager can be exact.
    assert advice["unbounded"]["cached_tokens"] > advice["cached_tokens"]
    assert agreement["exact_fraction"] >= 0.99, agreement
    assert agreement["total_error_fraction"] <= 0.01, agreement
    assert any(d["kind"] == "date" for d in advice["divergences"]), advice["divergences"]

    # The same log from the file, through the command (the server's block geometry).
    lines = log_path.read_text().splitlines()
    assert len(lines) == len(reported)
    first = json.loads(lines[0])
    assert {"prompt_token_ids", "cached_tokens", "output_token_ids", "timestamp"} <= set(first)
    argv = ["cache-report", str(log_path), "--model", str(tiny_checkpoint)]
    argv += ["--block-size", str(BLOCK_SIZE), "--num-blocks", str(NUM_BLOCKS), "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["reported"] == agreement
    assert report["cached_tokens"] == advice["cached_tokens"]


def test_recent_requests_bound_order_and_file(tmp_path: Any) -> None:
    path = tmp_path / "log.jsonl"
    recent = RecentRequests(max_records=2, path=path)
    for i in range(3):
        recent.started(f"r{i}", "salt" if i == 1 else None)
    recent.finished("r2", [1, 2, 3], 0, [7])  # finishes first, arrived last
    recent.finished("r1", [1, 2], 1)
    recent.discard("r0")  # failed: never recorded
    recent.finished("r0", [9], 0)
    log = recent.to_log()
    assert [r.token_ids for r in log.requests] == [(1, 2), (1, 2, 3)]  # arrival order
    assert log.requests[0].cache_salt == "salt" and log.requests[0].reported_cached_tokens == 1
    assert log.requests[1].output_token_ids == (7,)
    assert len(recent.records(1)) == 1 and recent.records(0) == []
    recent.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["request_id"] for line in lines] == ["r2", "r1"]
    assert lines[0]["timestamp"] > lines[1]["timestamp"]
    with pytest.raises(ValueError):
        RecentRequests(0)
