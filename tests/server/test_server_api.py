"""The OpenAI routes through httpx.ASGITransport, against the engine with the FakeModelRunner.

The fake runner's tokens are a function of the context read back through the block
tables, so ``Harness.expected_text`` says exactly what every completion must be.
"""

from __future__ import annotations

import json
import re
from typing import Any
from unittest.mock import ANY

from pagedllm.worker.fake_runner import MISS_LOGPROB

from .conftest import ASGIStream, sse_events


def _dumps(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _usage(prompt_tokens: int, completion_tokens: int, event_seq: Any = ANY) -> dict[str, Any]:
    """The usage object of a request with no cached prompt tokens (``event_seq``: where
    the cache's event log stood at its prefix lookup)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {
            "cached_tokens": 0,
            "cache_event_seq": event_seq,
            "arrival_event_seq": event_seq,  # nothing changed the index while it waited
        },
    }


def test_models_and_health(make_harness):
    h = make_harness(served_model_name="tiny")

    async def body(client):
        health = await client.get("/health")
        assert health.status_code == 200 and health.json() == {"status": "ok"}
        models = (await client.get("/v1/models")).json()
        assert models["object"] == "list"
        assert [m["id"] for m in models["data"]] == ["tiny"]
        assert models["data"][0]["max_model_len"] == 128
        ok = await client.post("/v1/completions", json={"model": "tiny", "prompt": "a"})
        assert ok.status_code == 200 and ok.json()["model"] == "tiny"

    h.run(body)


def test_openapi_describes_the_bodies_the_routes_read_themselves(make_harness):
    h = make_harness()

    async def body(client):
        schema = (await client.get("/openapi.json")).json()
        for path, model in [("/v1/completions", "CompletionRequest"),
                            ("/v1/chat/completions", "ChatCompletionRequest"),
                            ("/v1/cache/resize", "CacheResizeRequest")]:  # fmt: skip
            content = schema["paths"][path]["post"]["requestBody"]["content"]
            assert content["application/json"]["schema"] == {
                "$ref": f"#/components/schemas/{model}"
            }
        # every reference resolves (the bodies' own models, such as ChatMessage, too)
        refs = set(re.findall(r'"\$ref": "#/components/schemas/(\w+)"', json.dumps(schema)))
        assert refs and refs <= set(schema["components"]["schemas"])
        since = schema["paths"]["/v1/cache/events"]["get"]["parameters"][0]
        assert since["schema"]["maximum"] == 2**63 - 1

    h.run(body)


def test_completion_text_and_usage(make_harness):
    h = make_harness()
    prompt = "Hello paged world"

    async def body(client):
        r = await client.post(
            "/v1/completions", json={"prompt": prompt, "max_tokens": 7, "temperature": 0}
        )
        assert r.status_code == 200, r.text
        data = r.json()
        assert data["object"] == "text_completion" and data["id"].startswith("cmpl-")
        [choice] = data["choices"]
        assert choice["text"] == h.expected_text(prompt, 7)
        assert choice["finish_reason"] == "length" and choice["index"] == 0
        n_prompt = len(h.tokenizer.encode(prompt))
        assert data["usage"] == _usage(n_prompt, 7)

    h.run(body)


def test_completion_token_id_batch_with_n(make_harness):
    h = make_harness()
    prompts = [[104, 105, 106, 107, 108], [120, 121, 122]]

    async def body(client):
        r = await client.post("/v1/completions", json={"prompt": prompts, "max_tokens": 5, "n": 2})
        assert r.status_code == 200, r.text
        data = r.json()
        assert [c["index"] for c in data["choices"]] == [0, 1, 2, 3]
        for c in data["choices"]:
            prompt = prompts[c["index"] // 2]
            assert c["text"] == h.expected_text(prompt, 5, sample=c["index"] % 2)
        assert data["usage"]["prompt_tokens"] == 8
        assert data["usage"]["completion_tokens"] == 20
        # one token-id prompt (not a batch) is one choice
        single = await client.post("/v1/completions", json={"prompt": prompts[0], "max_tokens": 3})
        assert [c["text"] for c in single.json()["choices"]] == [h.expected_text(prompts[0], 3)]

    h.run(body)


def test_completion_echo_logprobs_and_stop(make_harness):
    h = make_harness()
    prompt = "echo me"
    full = h.expected_text(prompt, 12)
    stop = full[5:7]
    cut = full.find(stop)

    async def body(client):
        r = await client.post(
            "/v1/completions",
            json={"prompt": prompt, "max_tokens": 4, "echo": True, "logprobs": 1},
        )
        [c] = r.json()["choices"]
        assert c["text"] == prompt + full[:4]
        lp = c["logprobs"]
        n = len(prompt)  # one token a character; the echoed prompt's come first
        assert lp["tokens"] == list(prompt) + list(full[:4])
        assert lp["token_logprobs"][n:] == [0.0] * 4  # the fake runner is certain
        assert lp["text_offset"][n:] == [len(prompt) + i for i in range(4)]
        assert lp["top_logprobs"][n] == {full[0]: 0.0}
        r = await client.post(
            "/v1/completions", json={"prompt": prompt, "max_tokens": 12, "stop": [stop]}
        )
        [c] = r.json()["choices"]
        assert c["text"] == full[:cut]
        assert c["finish_reason"] == "stop" and c["stop_reason"] == stop

    h.run(body)


def test_completion_stream_bytes(make_harness):
    """The stream is exactly: one event per delta, a final usage event, [DONE]."""
    h = make_harness()
    prompt = "stream this"

    async def body(client):
        r = await client.post(
            "/v1/completions",
            json={
                "prompt": prompt,
                "max_tokens": 6,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.content)
        first = events[0]
        rid, created = first["id"], first["created"]
        assert rid.startswith("cmpl-")
        deltas = [e["choices"][0]["text"] for e in events[:-1]]
        assert "".join(deltas) == h.expected_text(prompt, 6)
        n_prompt = len(h.tokenizer.encode(prompt))
        expected = b""
        for i, text in enumerate(deltas):
            last = i == len(deltas) - 1
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": "length" if last else None,
                "stop_reason": None,
            }
            expected += _dumps(
                {"id": rid, "object": "text_completion", "created": created,
                 "model": "default", "choices": [choice], "usage": None}
            )  # fmt: skip
        expected += _dumps(
            {"id": rid, "object": "text_completion", "created": created,
             "model": "default", "choices": [], "usage": _usage(n_prompt, 6, 0)}
        )  # fmt: skip
        expected += b"data: [DONE]\n\n"
        assert r.content == expected

        # without include_usage: no usage key at all, no usage event
        r = await client.post(
            "/v1/completions", json={"prompt": prompt, "max_tokens": 3, "stream": True}
        )
        events = sse_events(r.content)
        assert all("usage" not in e and e["choices"] for e in events)
        assert events[-1]["choices"][0]["finish_reason"] == "length"

    h.run(body)


def _expected_prompt_logprobs(h, prompt: str) -> dict[str, list]:
    """The legacy lists of an echoed prompt under the fake runner: the first token null,
    each later one 0.0 when the runner would have generated it there, else MISS_LOGPROB;
    its top-1 the token the runner would have generated."""
    ids = h.tokenizer.encode(prompt)
    predicted = [h.runner.next_token(ids[: p + 1]) for p in range(len(ids) - 1)]
    return {
        "tokens": [h.tokenizer.decode([t]) for t in ids],
        "token_logprobs": [None]
        + [0.0 if t == ids[p + 1] else MISS_LOGPROB for p, t in enumerate(predicted)],
        "top_logprobs": [None] + [{h.tokenizer.decode([t]): 0.0} for t in predicted],
        "text_offset": list(range(len(ids))),
    }


def test_echo_with_logprobs_scores_the_prompt(make_harness):
    """``echo`` + ``logprobs``: the prompt's tokens with their log-probabilities (first
    null) before the completion's, whole and streamed (in each choice's first chunk)."""
    h = make_harness()
    # Two letters, then what the runner generates after them: tokens it predicts (0.0).
    prompt = "zz" + h.expected_text("zz", 6)
    n = len(prompt)
    expected = _expected_prompt_logprobs(h, prompt)
    assert 0.0 in expected["token_logprobs"] and MISS_LOGPROB in expected["token_logprobs"]
    payload = {"prompt": prompt, "max_tokens": 3, "echo": True, "logprobs": 1, "n": 2}

    async def body(client):
        whole = (await client.post("/v1/completions", json=payload)).json()
        for c in whole["choices"]:
            lp = c["logprobs"]
            assert {k: v[:n] for k, v in lp.items()} == expected
            assert len(lp["tokens"]) == n + 3 and lp["text_offset"][n] == n
        streamed = await client.post("/v1/completions", json={**payload, "stream": True})
        firsts = {}
        for event in sse_events(streamed.content):
            for c in event["choices"]:
                firsts.setdefault(c["index"], c["logprobs"])
        assert sorted(firsts) == [0, 1]
        for lp in firsts.values():
            assert {k: v[:n] for k, v in lp.items()} == expected
        plain = (await client.post("/v1/completions", json={**payload, "echo": False})).json()
        assert all(len(c["logprobs"]["tokens"]) == 3 for c in plain["choices"])

    h.run(body)


def test_completion_stream_batch_n_and_echo(make_harness):
    h = make_harness()
    prompts = ["ab", "cd"]

    async def body(client):
        r = await client.post(
            "/v1/completions",
            json={"prompt": prompts, "n": 2, "max_tokens": 4, "stream": True, "echo": True},
        )
        texts: dict[int, str] = {}
        finish: dict[int, str] = {}
        for event in sse_events(r.content):
            for c in event["choices"]:
                texts[c["index"]] = texts.get(c["index"], "") + c["text"]
                if c["finish_reason"]:
                    assert c["index"] not in finish
                    finish[c["index"]] = c["finish_reason"]
        assert finish == dict.fromkeys(range(4), "length")
        for index, text in texts.items():
            prompt = prompts[index // 2]
            assert text == prompt + h.expected_text(prompt, 4, sample=index % 2)

    h.run(body)


def test_chat_completion(make_harness):
    h = make_harness()
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    ]
    flat = [messages[0], {"role": "user", "content": "hi"}]
    prompt_ids = h.chat_ids(flat)

    async def body(client):
        r = await client.post(
            "/v1/chat/completions", json={"messages": messages, "max_tokens": 5, "n": 2}
        )
        assert r.status_code == 200, r.text
        data = r.json()
        assert data["object"] == "chat.completion" and data["id"].startswith("chatcmpl-")
        for choice in data["choices"]:
            expected = h.tokenizer.decode(h.expected_ids(prompt_ids, 5, choice["index"]))
            assert choice["message"] == {"role": "assistant", "content": expected}
            assert choice["finish_reason"] == "length"
        assert data["usage"]["prompt_tokens"] == len(prompt_ids)
        assert data["usage"]["completion_tokens"] == 10
        # max_completion_tokens wins over max_tokens
        r = await client.post(
            "/v1/chat/completions",
            json={"messages": flat, "max_tokens": 9, "max_completion_tokens": 3},
        )
        assert r.json()["usage"]["completion_tokens"] == 3

    h.run(body)


def test_chat_stream_role_first_and_finish_last(make_harness):
    h = make_harness()
    messages = [{"role": "user", "content": "stream please"}]
    prompt_ids = h.chat_ids(messages)

    async def body(client):
        r = await client.post(
            "/v1/chat/completions",
            json={
                "messages": messages,
                "max_completion_tokens": 6,
                "n": 2,
                "logprobs": True,
                "top_logprobs": 1,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
        events = sse_events(r.content)
        assert all(e["object"] == "chat.completion.chunk" for e in events)
        usage = events[-1]
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 12
        per_choice: dict[int, list[dict]] = {0: [], 1: []}
        for event in events[:-1]:
            assert event["usage"] is None
            [choice] = event["choices"]
            per_choice[choice["index"]].append(choice)
        for index, choices in per_choice.items():
            assert choices[0]["delta"] == {"role": "assistant", "content": ""}
            assert all("role" not in c["delta"] for c in choices[1:])
            assert [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + ["length"]
            text = "".join(c["delta"].get("content", "") for c in choices)
            assert text == h.tokenizer.decode(h.expected_ids(prompt_ids, 6, index))
            tokens = [
                t["token"] for c in choices if c["logprobs"] for t in c["logprobs"]["content"]
            ]
            assert "".join(tokens) == text

    h.run(body)


def test_cached_tokens_and_cache_salt(make_harness):
    h = make_harness(block_size=4)
    prompt = list(range(97, 117))  # 20 tokens: 4 full blocks can be reused (cap: 19 tokens)

    async def cached(client, **extra):
        r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, **extra})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    async def body(client):
        assert await cached(client) == 0
        assert await cached(client) == 16
        assert await cached(client, cache_salt="tenant-a") == 0  # isolated from the others
        assert await cached(client, cache_salt="tenant-a") == 16
        assert await cached(client, cache_salt="tenant-b") == 0

    h.run(body)


def test_cache_report_and_metrics(make_harness):
    h = make_harness()

    async def body(client):
        for _ in range(2):
            r = await client.post(
                "/v1/completions", json={"prompt": "metrics", "max_tokens": 4, "stream": True}
            )
            assert r.status_code == 200
        report = (await client.get("/v1/cache")).json()
        for key in ("block_size", "blocks_total", "blocks_used", "blocks_cached_free",
                    "blocks_free", "usage", "running", "waiting", "swapped"):  # fmt: skip
            assert key in report
        assert report["block_size"] == 4 and report["blocks_total"] == 64
        assert set(report["waste"]) == {"internal", "external", "duplication"}
        assert report["prefix_cache"]["queries_tokens"] > 0
        assert report["prefix_cache"]["hits_tokens"] > 0  # the second request hit the first
        assert report["blocks_used"] + report["blocks_cached_free"] + report["blocks_free"] == 64

        text = (await client.get("/metrics")).text
        for name in (
            "pagedllm_num_requests_running", "pagedllm_num_requests_waiting",
            "pagedllm_num_requests_swapped", "pagedllm_kv_blocks_used", "pagedllm_num_requests_queued",
            "pagedllm_kv_blocks_cached_free", "pagedllm_kv_blocks_free",
            "pagedllm_kv_cache_usage", 'pagedllm_kv_waste_fraction{kind="internal"}',
            'pagedllm_kv_waste_tokens{kind="duplication"}',
            "pagedllm_prefix_cache_queries_tokens_total",
            "pagedllm_prefix_cache_hits_tokens_total",
            'pagedllm_num_preemptions_total{mode="recompute"}',
            'pagedllm_num_preemptions_total{mode="swap"}',
        ):  # fmt: skip
            assert name in text, name
        values = _samples(text)
        assert values["pagedllm_generation_tokens_total"] == 8
        assert values["pagedllm_time_to_first_token_seconds_count"] == 2
        assert values["pagedllm_inter_token_latency_seconds_count"] >= 1
        assert values['pagedllm_requests_finished_total{finish_reason="length"}'] == 2
        assert values["pagedllm_kv_blocks_total"] == 64

    h.run(body)


def test_live_waste_while_running(make_harness):
    """While a request runs, internal waste is its partly filled last block."""
    h = make_harness(block_size=4, runner_kw={"step_delay_s": 0.02})

    async def body(client):
        stream = ASGIStream(
            h.app, "/v1/completions",
            {"prompt": [97, 98, 99, 100, 101], "max_tokens": 30, "stream": True},
        ).start()  # fmt: skip
        assert (await stream.next_chunk()).startswith(b"data: ")
        report = (await client.get("/v1/cache")).json()
        await stream.disconnect()
        # 5 prompt tokens (+ a few generated) in 4-token blocks: one partial block
        assert report["blocks_used"] >= 2 and report["running"] == 1
        internal = report["waste"]["internal"]
        assert 0 < internal["tokens"] < 4
        assert internal["fraction"] == internal["tokens"] / (report["blocks_used"] * 4)
        assert report["waste"]["external"]["tokens"] == 0
        assert report["waste"]["duplication"]["tokens"] == 0

    h.run(body)


def _samples(text: str) -> dict[str, float]:
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def test_duplication_waste_shows_when_prefix_caching_is_off(make_harness):
    """Two live requests with the same 12-token prompt: stored twice without the
    prefix cache, once (bar the partial tail block) with it."""
    measured = {}
    for caching in (False, True):
        h = make_harness(
            block_size=4,
            engine_kw={"enable_prefix_caching": caching},
            runner_kw={"step_delay_s": 0.02},
        )
        payload = {"prompt": list(range(97, 109)), "max_tokens": 40, "stream": True}

        async def body(client, h=h, payload=payload, caching=caching):
            first = ASGIStream(h.app, "/v1/completions", payload).start()
            await first.next_chunk()
            second = ASGIStream(h.app, "/v1/completions", payload).start()
            await second.next_chunk()
            report = (await client.get("/v1/cache")).json()
            await first.disconnect()
            await second.disconnect()
            measured[caching] = report["waste"]["duplication"]["tokens"]

        h.run(body)
    assert measured[False] >= 12
    assert measured[True] < 12


def test_chat_stream_bytes(make_harness):
    h = make_harness()
    messages = [{"role": "user", "content": "bytes"}]
    prompt_ids = h.chat_ids(messages)

    async def body(client):
        r = await client.post(
            "/v1/chat/completions",
            json={"messages": messages, "max_tokens": 5, "stream": True},
        )
        events = sse_events(r.content)
        rid, created = events[0]["id"], events[0]["created"]
        assert rid.startswith("chatcmpl-")
        deltas = [e["choices"][0]["delta"].get("content", "") for e in events[1:]]
        assert "".join(deltas) == h.tokenizer.decode(h.expected_ids(prompt_ids, 5))

        def chunk(delta, finish=None):
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish,
                      "stop_reason": None}  # fmt: skip
            return _dumps({"id": rid, "object": "chat.completion.chunk", "created": created,
                           "model": "default", "choices": [choice]})  # fmt: skip

        expected = chunk({"role": "assistant", "content": ""})
        for i, text in enumerate(deltas):
            last = i == len(deltas) - 1
            expected += chunk({"content": text} if text else {}, "length" if last else None)
        assert r.content == expected + b"data: [DONE]\n\n"

    h.run(body)


def test_disk_tier_in_usage_cache_report_and_metrics(make_harness, tmp_path):
    # A pool of 8 blocks (32 tokens): a second prompt evicts the first from RAM.
    h = make_harness(
        num_blocks=8, max_model_len=32, engine_kw={"kv_offload_dir": str(tmp_path / "kv")}
    )
    first, other = list(range(97, 117)), list(range(100, 120))

    async def cached(client, prompt):
        r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    async def body(client):
        assert await cached(client, first) == 0
        assert await cached(client, other) == 0
        await h.engine.flush_disk_tier()
        assert await h.engine.reset_prefix_cache()  # idle: RAM copies gone
        assert await cached(client, first) == 16  # all four full blocks, from disk
        report = (await client.get("/v1/cache")).json()
        disk = report["disk"]
        assert disk["hits_tokens_disk"] == 16 and disk["hits_tokens_ram"] == 0
        assert disk["blocks_read"] == 4 and disk["blocks_used"] >= 8
        assert disk["bytes_used"] == disk["blocks_used"] * (104 + 2 * 8 * 4)
        text = (await client.get("/metrics")).text
        values = _samples(text)
        assert values['pagedllm_prefix_cache_hits_tokens_by_tier_total{tier="disk"}'] == 16
        assert values["pagedllm_kv_disk_blocks_used"] == disk["blocks_used"]
        assert values["pagedllm_kv_disk_read_bytes_total"] == disk["bytes_read"]

    h.run(body)


def test_a_damaged_disk_store_is_set_aside_and_counted(make_harness, tmp_path):
    root = tmp_path / "kv"
    (root / "blocks" / "ab").mkdir(parents=True)
    (root / "store.json").write_text('{"format": 1, "mod')  # a torn write
    (root / "blocks" / "ab" / f"{'ab' * 32}.kv").write_bytes(b"PGLMKV\x00\x01 and the rest")
    h = make_harness(num_blocks=8, max_model_len=32, engine_kw={"kv_offload_dir": str(root)})

    async def body(client):
        r = await client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2})
        assert r.status_code == 200, r.text
        values = _samples((await client.get("/metrics")).text)
        assert values["pagedllm_kv_disk_stores_set_aside_total"] == 1
        assert (await client.get("/v1/cache")).json()["disk"]["stores_set_aside"] == 1

    h.run(body)
    assert len(list(tmp_path.glob("kv.damaged-*"))) == 1
