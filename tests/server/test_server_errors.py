"""Bad input, auth, the queue bound, engine failures, disconnects and shutdown."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from pagedllm.engine.async_engine import EngineClosedError

from .conftest import ASGIStream, hold_core, sse_events, wait_pool_free, wait_until

BAD_COMPLETIONS = [
    # (raw body, expected param or None, words the message must contain)
    ('{"prompt": "x"', None, ["malformed JSON"]),
    ("[1, 2]", None, ["object"]),
    ("{}", "prompt", ["required"]),
    ('{"prompt": 5}', "prompt", ["prompt must be"]),
    ('{"prompt": [1, "a"]}', "prompt", ["prompt must be"]),
    ('{"prompt": []}', "prompt", ["empty"]),
    ('{"prompt": [[]]}', "prompt", ["empty"]),
    ('{"prompt": "x", "max_tokens": "3"}', "max_tokens", ["integer"]),
    ('{"prompt": "x", "max_tokens": 0}', "max_tokens", ["greater than or equal to 1"]),
    ('{"prompt": "x", "temperature": 5}', "temperature", ["less than or equal to 2"]),
    ('{"prompt": "x", "temperature": true}', "temperature", ["number"]),
    ('{"prompt": "x", "top_p": 0}', "top_p", ["greater than 0"]),
    ('{"prompt": "x", "n": 0}', "n", []),
    ('{"prompt": "x", "logprobs": 21}', "logprobs", []),
    ('{"prompt": "x", "stop": [3]}', "stop", []),
    ('{"prompt": "x", "stream": "yes"}', "stream", ["boolean"]),
    ('{"prompt": "x", "stream_options": {"include_usage": 1}}', "stream_options.include_usage", []),
    ('{"prompt": "x", "min_tokens": 9, "max_tokens": 3}', "min_tokens", ["min_tokens"]),
    ('{"prompt": "x", "model": "gpt-4"}', "model", ["gpt-4", "does not exist"]),
    ('{"prompt": [1, 2, 99999]}', "prompt", ["99999", "vocabulary"]),
    ('{"prompt": "x", "logit_bias": {"abc": 1}}', "logit_bias", ["token ids"]),
    ('{"prompt": "x", "logit_bias": {"99999": 1}}', None, ["logit_bias", "99999", "vocabulary"]),
    ('{"prompt": "x", "stop_token_ids": [99999]}', None, ["stop_token_ids", "vocabulary"]),
    ('{"prompt": "x", "cache_salt": ""}', "cache_salt", []),
    ('{"prompt": "x", "best_of": 3}', "best_of", []),
    # numbers the engine core cannot take (msgpack and torch hold 64 bits; nan is no setting)
    ('{"prompt": "x", "n": 129}', "n", ["128"]),
    ('{"prompt": "x", "priority": 9223372036854775808}', "priority", ["less than or equal"]),
    ('{"prompt": "x", "seed": -9223372036854775809}', "seed", ["greater than or equal"]),
    ('{"prompt": "x", "top_k": 9223372036854775808}', "top_k", []),
    ('{"prompt": "x", "min_tokens": 9223372036854775808}', "min_tokens", []),
    ('{"prompt": "x", "stop_token_ids": [18446744073709551616]}', "stop_token_ids[0]", []),
    ('{"prompt": "x", "logit_bias": {"18446744073709551616": 1}}', "logit_bias", ["token ids"]),
    ('{"prompt": "x", "logit_bias": {"-5": 1}}', "logit_bias", ["token ids"]),
    ('{"prompt": "x", "logit_bias": {"5": NaN}}', "logit_bias.5", ["finite"]),
    ('{"prompt": "x", "repetition_penalty": Infinity}', "repetition_penalty", ["finite"]),
    ('{"prompt": [1, 9223372036854775808]}', "prompt", ["prompt must be"]),
    ('{"prompt": "x", "max_tokens": 9223372036854775807}', "max_tokens", ["context length"]),
]

BAD_CHATS = [
    ('{"messages": []}', "messages", []),
    ('{"messages": [{"role": "wizard", "content": "x"}]}', "messages[0].role", []),
    ('{"messages": [{"role": "user", "content": 3}]}', "messages[0].content", []),
    (
        '{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}',
        "messages[0].content",
        [],
    ),
    (
        '{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -1}',
        "max_completion_tokens",
        [],
    ),  # fmt: skip
    ('{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}', "top_logprobs", []),
    (
        '{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}',
        "tools[0].function",
        [],
    ),  # fmt: skip
    (
        '{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", '
        '"function": {"name": "f"}}], "tool_choice": {"type": "function", "function": '
        '{"name": "g"}}}',
        "tool_choice.function.name",
        ["'g'", "not among the tools"],
    ),
    (
        '{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", '
        '"function": {"name": "f", "parameters": {"type": "object", "properties": '
        '{"a": {"type": 5}}}}}]}',
        "tools[0].function.parameters",
        ["properties.a.type"],
    ),
    (
        '{"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}',
        "tool_choice",
        ["needs tools"],
    ),
    (
        '{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": '
        '[{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]}',
        "messages[1].tool_calls[0].function.arguments",
        ["object"],
    ),
]


def _check_error(response, status, param, words):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error
    return error


@pytest.mark.parametrize(("path", "cases"), [("/v1/completions", BAD_COMPLETIONS),
                                             ("/v1/chat/completions", BAD_CHATS)])  # fmt: skip
def test_bad_requests_never_reach_the_engine(make_harness, path, cases):
    h = make_harness()

    async def body(client):
        for raw, param, words in cases:
            r = await client.post(path, content=raw, headers={"content-type": "application/json"})
            error = _check_error(r, 400, param, words)
            assert error["type"] == "invalid_request_error"
        stats = await h.engine.get_stats()
        assert stats.num_prompt_tokens == 0 and h.runner.num_steps == 0
        # and the server still serves
        ok = await client.post("/v1/completions", json={"prompt": "fine", "max_tokens": 2})
        assert ok.status_code == 200

    h.run(body)


BAD_QUERIES = [
    # (path and query, the parameter named)
    ("/v1/cache/events?since=-4162009810236935719308230656", "since"),
    ("/v1/cache/events?since=9223372036854775808", "since"),
    ("/v1/cache/events?since=-1", "since"),
    ("/v1/cache/events?since=x", "since"),
    ("/v1/cache/events/stream?since=18446744073709551616", "since"),
    ("/v1/cache/events/stream?heartbeat=0", "heartbeat"),
    ("/v1/cache/events/stream?heartbeat=nan", "heartbeat"),
    ("/v1/cache/events/stream?heartbeat=inf", "heartbeat"),
    ("/v1/cache/events/stream?heartbeat=1e-300", "heartbeat"),  # would spin
    ("/v1/cache/advice?limit=0", "limit"),
    ("/v1/cache/advice?limit=99999999999999999999", "limit"),
]


def test_bad_query_parameters_are_400s_naming_them(make_harness):
    h = make_harness()

    async def body(client):
        for path, param in BAD_QUERIES:
            _check_error(await client.get(path), 400, param, [param])

    h.run(body)


def test_the_schema_documents_bad_requests_as_the_400s_they_are(make_harness):
    """No route answers 422: the OpenAPI document says 400 with the error body it sends."""
    from pagedllm.server.errors import ErrorResponse

    h = make_harness()

    async def body(client):
        schema = (await client.get("/openapi.json")).json()
        operations = [op for ops in schema["paths"].values() for op in ops.values()]
        assert not [op["operationId"] for op in operations if "422" in op["responses"]]
        stream = schema["paths"]["/v1/cache/events/stream"]["get"]["responses"]["400"]
        ref = stream["content"]["application/json"]["schema"]["$ref"]
        assert schema["components"]["schemas"][ref.rsplit("/", 1)[1]]["required"] == ["error"]
        answer = await client.get("/v1/cache/events/stream?heartbeat=0")
        ErrorResponse.model_validate(answer.json())

    h.run(body)


def test_too_long_prompts_name_both_numbers(make_harness):
    h = make_harness(max_model_len=64, num_blocks=32, block_size=4)

    async def body(client):
        r = await client.post("/v1/completions", json={"prompt": "y" * 70, "max_tokens": 2})
        error = _check_error(r, 400, "prompt", ["64", "72", "70"])
        assert error["code"] == "context_length_exceeded"
        r = await client.post("/v1/completions", json={"prompt": "y" * 30, "max_tokens": 40})
        _check_error(r, 400, "max_tokens", ["64", "30", "40"])
        r = await client.post("/v1/completions", json={"prompt": "y" * 64, "max_tokens": None})
        _check_error(r, 400, "prompt", ["64"])
        messages = [{"role": "user", "content": "z" * 80}]
        r = await client.post("/v1/chat/completions", json={"messages": messages})
        _check_error(r, 400, "messages", ["64"])
        assert h.runner.num_steps == 0

    h.run(body)


def test_unknown_route_and_method(make_harness):
    h = make_harness()

    async def body(client):
        r = await client.get("/v1/nothing")
        assert r.status_code == 404 and "error" in r.json()
        r = await client.get("/v1/completions")
        assert r.status_code == 405 and "error" in r.json()

    h.run(body)


def test_api_key(make_harness):
    h = make_harness(api_key="sekret")
    good = {"Authorization": "Bearer sekret"}

    async def body(client):
        assert (await client.get("/health")).status_code == 200
        for method, path in [("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/v1/cache"),
                             ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                             ("GET", "/nowhere")]:  # fmt: skip
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
                r = await client.request(method, path, headers=headers, json={})
                assert r.status_code == 401, (path, headers)
                assert r.json()["error"]["code"] == "invalid_api_key"
        assert (await client.get("/v1/models", headers=good)).status_code == 200
        r = await client.post(
            "/v1/completions", headers=good, json={"prompt": "a", "max_tokens": 2}
        )
        assert r.status_code == 200
        assert h.runner.num_steps > 0

    h.run(body)


def test_queue_bound_gives_429_with_retry_after(make_harness):
    h = make_harness(max_queued_requests=2)
    gate = threading.Event()

    async def body(client):
        # Hold the step thread so that accepted requests stay queued.
        h.engine.start()
        held = await hold_core(h.engine, h.llm, gate)
        payload = {"prompt": "queued", "max_tokens": 3}
        first = [asyncio.ensure_future(client.post("/v1/completions", json=payload))
                 for _ in range(2)]  # fmt: skip
        await wait_until(lambda: h.engine.num_queued == 2, what="two queued requests")
        r = await client.post("/v1/completions", json=payload)
        assert r.status_code == 429
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "queue_full"
        batch = await client.post("/v1/completions", json={**payload, "prompt": ["a", "b"]})
        assert batch.status_code == 429
        gate.set()
        await held
        for task in first:
            assert (await task).status_code == 200
        assert (await client.post("/v1/completions", json=payload)).status_code == 200

    h.run(body)


def test_failing_request_gets_500_and_server_continues(make_harness):
    h = make_harness()
    h.runner.fail_request_ids.update({"cmpl-boom-0", "chatcmpl-bang-0"})

    async def body(client):
        payload = {"prompt": "doomed", "max_tokens": 4}
        r = await client.post("/v1/completions", json=payload, headers={"X-Request-Id": "boom"})
        assert r.status_code == 500
        error = r.json()["error"]
        assert error["type"] == "internal_server_error" and "InjectedFailure" in error["message"]
        messages = [{"role": "user", "content": "doomed"}]
        r = await client.post(
            "/v1/chat/completions",
            json={"messages": messages, "stream": True},
            headers={"X-Request-Id": "bang"},
        )
        assert r.status_code == 200  # the stream had started: the error is an event
        parts = r.content.split(b"\n\n")
        assert parts[-2:] == [b"data: [DONE]", b""]
        error_event = json.loads(parts[-3][len(b"data: ") :])
        assert error_event["error"]["type"] == "internal_server_error"
        # the step loop kept going
        ok = await client.post("/v1/completions", json=payload)
        assert ok.status_code == 200
        assert ok.json()["choices"][0]["text"] == h.expected_text("doomed", 4)
        metrics = (await client.get("/metrics")).text
        assert 'pagedllm_requests_finished_total{finish_reason="error"} 2.0' in metrics

    h.run(body)


def test_failing_request_fails_alone_while_a_concurrent_one_succeeds(make_harness):
    """The culprit gets its 500 / error event; a request sharing its steps is untouched."""
    h = make_harness(runner_kw={"step_delay_s": 0.01})
    h.runner.fail_request_ids.update({"cmpl-boom-0", "chatcmpl-bang-0"})

    async def body(client):
        good = ASGIStream(
            h.app, "/v1/completions", {"prompt": "survivor", "max_tokens": 12, "stream": True}
        ).start()
        first = await good.next_chunk()
        assert first is not None and first.startswith(b"data: ")  # it is running now
        doomed = {"prompt": "doomed", "max_tokens": 4}
        messages = [{"role": "user", "content": "doomed"}]
        plain, streamed = await asyncio.gather(
            client.post("/v1/completions", json=doomed, headers={"X-Request-Id": "boom"}),
            client.post(
                "/v1/chat/completions",
                json={"messages": messages, "stream": True},
                headers={"X-Request-Id": "bang"},
            ),
        )
        assert plain.status_code == 500
        assert "InjectedFailure" in plain.json()["error"]["message"]
        assert streamed.status_code == 200
        error_event = streamed.content.split(b"\n\n")[-3]
        assert json.loads(error_event[len(b"data: ") :])["error"]["type"] == (
            "internal_server_error"
        )
        body_bytes = first
        while (chunk := await good.next_chunk()) is not None:
            body_bytes += chunk
        await good.task
        events = [e for e in sse_events(body_bytes) if e["choices"]]
        assert "".join(e["choices"][0]["text"] for e in events) == h.expected_text("survivor", 12)
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        stats = await h.engine.get_stats()
        assert stats.num_requests_failed == 2 and stats.num_requests_finished == 1

    h.run(body)


def test_step_exception_fails_in_flight_requests_only(make_harness):
    """If ``LLMEngine.step`` itself raises, in-flight requests fail; later ones work."""
    h = make_harness()
    llm = h.llm
    real_step = llm.step_deltas
    calls = {"n": 0}

    def flaky_step(on_scheduled=None):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom in step")
        return real_step(on_scheduled=on_scheduled)

    llm.step_deltas = flaky_step

    async def body(client):
        r = await client.post("/v1/completions", json={"prompt": "first", "max_tokens": 3})
        assert r.status_code == 500 and "boom in step" in r.json()["error"]["message"]
        r = await client.post("/v1/completions", json={"prompt": "second", "max_tokens": 3})
        assert r.status_code == 200
        assert h.engine.host.core.num_step_failures == 1

    h.run(body)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_disconnect_mid_stream_frees_blocks(make_harness, path):
    h = make_harness(runner_kw={"step_delay_s": 0.01})
    if path == "/v1/completions":
        payload = {"prompt": "a long story", "max_tokens": 100, "stream": True, "n": 2}
    else:
        messages = [{"role": "user", "content": "a long story"}]
        payload = {"messages": messages, "max_tokens": 90, "stream": True}

    async def body(client):
        stream = ASGIStream(h.app, path, payload).start()
        for _ in range(3):
            assert (await stream.next_chunk()).startswith(b"data: ")
        report = (await client.get("/v1/cache")).json()
        assert report["blocks_used"] > 0 and report["running"] >= 1
        await stream.disconnect()
        freed = await wait_pool_free(h.engine, timeout=2.0)
        assert freed["blocks_used"] == 0
        stats = await h.engine.get_stats()
        assert stats.num_requests_aborted == 1
        assert stats.num_generation_tokens < 90

    h.run(body)


def test_disconnect_while_waiting_for_non_streamed_answer(make_harness):
    h = make_harness(runner_kw={"step_delay_s": 0.01})

    async def body(client):
        stream = ASGIStream(
            h.app, "/v1/completions", {"prompt": "patience", "max_tokens": 100}
        ).start()

        async def running() -> bool:
            return (await h.engine.get_stats()).num_running == 1

        await wait_until(running, what="the request to run")
        await stream.disconnect()
        await wait_pool_free(h.engine, timeout=2.0)
        assert (await h.engine.get_stats()).num_requests_aborted == 1

    h.run(body)


def test_shutdown_ends_streams_and_refuses_new_requests(make_harness):
    h = make_harness(runner_kw={"step_delay_s": 0.01})

    async def body(client):
        stream = ASGIStream(
            h.app, "/v1/completions", {"prompt": "x", "max_tokens": 100, "stream": True}
        ).start()
        assert await stream.next_chunk()
        await h.engine.shutdown()
        rest = b""
        while (chunk := await stream.next_chunk()) is not None:
            rest += chunk
        assert rest.endswith(b"data: [DONE]\n\n")
        assert b'"code":"engine_unavailable"' in rest
        r = await client.post("/v1/completions", json={"prompt": "late"})
        assert r.status_code == 503
        assert (await client.get("/health")).status_code == 503
        with pytest.raises(EngineClosedError):  # the core has stopped
            await h.engine.get_stats()
        assert h.llm.get_stats().num_unfinished_requests == 0

    h.run(body)


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_before_any_output_aborts(make_harness, stream):
    """The client leaves while its request still waits to be added: it is aborted, and
    nothing (blocks, in-flight entries, latency bookkeeping) stays behind."""
    h = make_harness(runner_kw={"step_delay_s": 0.01})
    gate = threading.Event()

    async def body(client):
        h.engine.start()
        held = await hold_core(h.engine, h.llm, gate)
        payload = {"prompt": "bye", "max_tokens": 50, "stream": stream}
        asgi = ASGIStream(h.app, "/v1/completions", payload).start()
        await wait_until(lambda: h.engine.num_in_flight == 1, what="the add to be sent")
        asgi._disconnect.set()  # gone before the add went through
        gate.set()
        await held
        await asyncio.wait_for(asgi.task, 10)
        await wait_pool_free(h.engine, timeout=2.0)
        stats = await h.engine.get_stats()
        assert stats.num_requests_aborted == 1
        assert stats.num_generation_tokens < 50
        assert h.app.state.ctx.metrics._timings == {}

    h.run(body)
