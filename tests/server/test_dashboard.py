"""``GET /dashboard`` and ``GET /v1/cache/blocks`` through httpx.ASGITransport."""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from typing import Any

from pagedllm.engine.messages import Codec
from pagedllm.engine.reports import blocks_report
from pagedllm.sampling_params import SamplingParams

from .conftest import LETTERS

F, C, U = 0, 1, 2  # indices into state_names


def _letters(n: int, start: int = 0) -> list[int]:
    return [LETTERS[(start + i) % len(LETTERS)] for i in range(n)]


def _check_consistent(report: dict[str, Any]) -> None:
    """States, ref counts and block tables describe one moment of the pool."""
    assert report["state_names"] == ["free", "cached_free", "used", "retired"]
    for tier, state_key, ref_key, table_key in (
        ("device", "state", "ref_count", "block_table"),
        ("host", "host_state", "host_ref_count", "host_block_table"),
    ):
        total = report["blocks_total" if tier == "device" else "host_blocks_total"]
        states, refs = report[state_key], report[ref_key]
        assert len(states) == len(refs) == total
        held = Counter(b for row in report["requests"] for b in row[table_key])
        if tier == "device":  # waiting requests' pins hold references too
            held.update(b for row in report["requests"] for b in row.get("pinned_blocks", []))
        for block_id in range(total):
            assert refs[block_id] == held[block_id], (tier, block_id, refs[block_id])
            assert (states[block_id] == U) == (refs[block_id] > 0), (tier, block_id)


def _report(llm: Any) -> dict[str, Any]:
    """The block report as the route sends it, for tests that step the engine by hand
    (the app's core thread idles meanwhile: nothing was sent to it)."""
    codec = Codec()
    return codec.decode_value(codec.encode_value(blocks_report(llm)))


def test_blocks_show_a_shared_prefix_with_exact_ids_and_ref_counts(make_harness):
    h = make_harness(num_blocks=16, block_size=4, max_model_len=64)
    llm = h.llm
    params = SamplingParams(max_tokens=50, temperature=0.0)
    prefix = _letters(8)  # two full blocks

    async def body(client):
        llm.add_request("a", prefix + _letters(1, 10), params)  # 9 tokens: blocks 0, 1, 2
        llm.step()  # prefill a; its two full blocks join the prefix index
        llm.add_request("b", prefix + _letters(3, 20), params)  # 11 tokens
        llm.step()  # a decodes (its table already covers token 10); b hits blocks 0, 1
        report = _report(llm)
        _check_consistent(report)
        assert report["blocks_total"] == 16 and report["block_size"] == 4
        assert report["state"] == [U, U, U, U] + [F] * 12
        assert report["ref_count"] == [2, 2, 1, 1] + [0] * 12
        rows = {row["request_id"]: row for row in report["requests"]}
        assert set(rows) == {"a", "b"}
        assert rows["a"]["block_table"] == [0, 1, 2]
        assert rows["b"]["block_table"] == [0, 1, 3]
        assert rows["b"]["num_cached_tokens"] == 8
        assert rows["a"]["num_cached_tokens"] == 0
        assert rows["b"]["status"] == rows["a"]["status"] == "running"
        assert rows["b"]["num_tokens"] == 12 and rows["b"]["num_computed_tokens"] == 11
        assert rows["a"]["num_preemptions"] == 0
        assert report["host_blocks_total"] == 0 and report["host_state"] == []

        llm.abort_request(["a"])
        report = _report(llm)
        _check_consistent(report)
        # a's private block 2 held a partial block: plain free; the prefix stays held by b.
        assert report["state"] == [U, U, F, U] + [F] * 12
        assert report["ref_count"] == [1, 1, 0, 1] + [0] * 12
        llm.abort_request(["b"])
        report = _report(llm)
        assert report["state"] == [C, C] + [F] * 14  # the prefix is findable, not held
        assert report["requests"] == []

    h.run(body)


def test_blocks_after_api_requests_and_consistent_while_busy(make_harness):
    # Slow steps keep the four requests alive together long enough for the polls to see them.
    h = make_harness(num_blocks=64, block_size=4, runner_kw={"step_delay_s": 0.01})
    prompt = "abcdefgh"  # 8 tokens: two full blocks

    async def body(client):
        first = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
        assert first.status_code == 200
        report = (await client.get("/v1/cache/blocks")).json()
        assert report["state"] == [C, C] + [F] * 62  # the tail block was partial
        assert report["ref_count"] == [0] * 64

        # While several requests run, every snapshot is taken between two steps.
        body = {"prompt": prompt + "xyz", "max_tokens": 30}
        tasks = [asyncio.create_task(client.post("/v1/completions", json=body)) for _ in range(4)]
        seen_shared = False
        polls = 0
        while not all(t.done() for t in tasks) and polls < 500:
            report = (await client.get("/v1/cache/blocks")).json()
            _check_consistent(report)
            seen_shared |= max(report["ref_count"]) >= 2
            polls += 1
        assert [(await t).status_code for t in tasks] == [200] * 4
        assert seen_shared, "the shared prefix blocks were never seen held twice"
        cache = (await client.get("/v1/cache")).json()
        assert cache["prefix_cache"]["hits_tokens"] >= 8 * 4

    h.run(body)


def test_blocks_show_the_host_tier_after_a_swap_preemption(make_harness):
    h = make_harness(
        num_blocks=8, block_size=4, max_model_len=32, num_host_blocks=8,
        engine_kw={"preemption_mode": "swap"},
    )  # fmt: skip
    llm = h.llm
    params = SamplingParams(max_tokens=16, temperature=0.0)

    async def body(client):
        llm.add_request("a", _letters(8), params)
        llm.add_request("b", _letters(8, 5), params)  # no shared prefix
        for _ in range(40):  # both grow until 8 blocks are not enough: one is swapped
            llm.step()
            if llm.get_stats().num_swapped:
                break
        report = _report(llm)
        _check_consistent(report)
        swapped = [row for row in report["requests"] if row["status"] == "swapped"]
        assert len(swapped) == 1
        (row,) = swapped
        assert row["block_table"] == [] and row["num_preemptions"] == 1
        host = row["host_block_table"]
        assert len(host) == -(-row["num_computed_tokens"] // 4) > 0
        assert [report["host_state"][b] for b in host] == [U] * len(host)
        assert sum(report["host_ref_count"]) == len(host)
        assert report["requests"][0]["status"] == "running"  # running rows come first
        llm.abort_request(["a", "b"])

    h.run(body)


def test_auth_guards_the_json_but_not_the_page(make_harness):
    h = make_harness(api_key="s3cret")

    async def body(client):
        page = await client.get("/dashboard")
        assert page.status_code == 200
        blocked = await client.get("/v1/cache/blocks")
        assert blocked.status_code == 401
        assert blocked.json()["error"]["code"] == "invalid_api_key"
        wrong = await client.get("/v1/cache/blocks", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        ok = await client.get("/v1/cache/blocks", headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200 and len(ok.json()["state"]) == 64

    h.run(body)


def test_dashboard_page_is_self_contained_and_polls_the_json(make_harness):
    h = make_harness()

    async def body(client):
        page = await client.get("/dashboard")
        assert page.status_code == 200
        assert page.headers["content-type"].startswith("text/html")
        assert "connect-src 'self'" in page.headers["content-security-policy"]
        html = page.text
        assert "/v1/cache/blocks" in html and '"/v1/cache"' in html
        assert "<canvas" in html  # the block map is drawn, not one element per block
        assert "#key=" in html and "Bearer " in html
        # Nothing is fetched from anywhere else: no external script, style, font or image.
        assert not re.search(r"<script[^>]+src=|<link[^>]|@import|url\(", html)
        assert not re.search(r"https?://", html)

    h.run(body)
