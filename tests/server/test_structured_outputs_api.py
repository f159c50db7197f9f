"""``response_format`` and ``structured_outputs`` on /v1/chat/completions and /v1/completions:
outputs that match, streamed or not; bad specs are 400s naming the field (and the JSON-Schema
feature and its path) that never reach the engine; a compile that takes too long is refused
while the server keeps serving."""

from __future__ import annotations

import json

import pytest

from .conftest import sse_events

jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 6},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "units": {"enum": ["C", "F"]},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "weather?"}]
JSON_SCHEMA_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True},
}


def _chat(**extra):
    return {"messages": MESSAGES, "max_tokens": 600} | extra


def test_chat_json_schema_is_followed_streamed_or_not(make_harness) -> None:
    h = make_harness(num_blocks=400, max_model_len=1024)

    async def body(client):
        r = await client.post(
            "/v1/chat/completions", json=_chat(response_format=JSON_SCHEMA_FORMAT)
        )
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
        r = await client.post(
            "/v1/chat/completions", json=_chat(response_format=JSON_SCHEMA_FORMAT, stream=True)
        )
        events = sse_events(r.content)
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
        assert text == choice["message"]["content"]
        assert events[-1]["choices"][0]["finish_reason"] == "stop"
        r = await client.post(
            "/v1/chat/completions", json=_chat(response_format={"type": "json_object"})
        )
        assert isinstance(json.loads(r.json()["choices"][0]["message"]["content"]), dict)

    h.run(body)


@pytest.mark.parametrize(
    ("structured", "check"),
    [
        ({"choice": ["north", "south"]}, lambda t: t in ("north", "south")),
        ({"regex": "[0-9]{3}-[a-z]{2}"}, lambda t: len(t) == 6 and t[3] == "-"),
        ({"json": SCHEMA, "disable_any_whitespace": True},
         lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None and " " not in t[:2]),
        ({"grammar": 'start: "go " dir\ndir: "left" | "right"'}, lambda t: t in ("go left", "go right")),
    ],
)  # fmt: skip
def test_completions_take_vllm_structured_outputs(make_harness, structured, check) -> None:
    h = make_harness(max_model_len=256)

    async def body(client):
        r = await client.post(
            "/v1/completions",
            json={"prompt": "x", "max_tokens": 100, "n": 2, "structured_outputs": structured},
        )
        assert r.status_code == 200, r.text
        for choice in r.json()["choices"]:
            assert choice["finish_reason"] == "stop" and check(choice["text"]), choice

    h.run(body)


BAD = [
    # (extra fields, param, words in the message)
    ({"response_format": {"type": "xml"}}, "response_format.type", ["'xml'", "json_schema"]),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", []),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", []),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": 1}}},
     "response_format.json_schema.strict", []),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {
        "type": "object", "properties": {"a": {"type": "array", "items": {"not": {}}}}}}}},
     "response_format.json_schema.schema", ['"not"', "/properties/a/items"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {
        "properties": {"when": {"type": "string", "format": "stardate"}}}}}},
     "response_format.json_schema.schema", ['"format": "stardate"', "/properties/when"]),
    ({"structured_outputs": {"json": {"type": "strng"}}}, "structured_outputs.json",
     ['"type": "strng"']),
    ({"structured_outputs": {"regex": "(open"}}, "structured_outputs.regex", ["unclosed"]),
    ({"structured_outputs": {"grammar": "start: nowhere"}}, "structured_outputs.grammar", []),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     ["exactly one"]),
    ({"structured_outputs": {"guided_json": {}}}, "structured_outputs", ["guided_json"]),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", ["choice"]),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
     "structured_outputs", ["response_format, not both"]),
]  # fmt: skip


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_bad_specs_are_400s_naming_the_field(make_harness, path) -> None:
    h = make_harness()
    base = _chat(max_tokens=4) if "chat" in path else {"prompt": "x", "max_tokens": 4}

    async def body(client):
        for extra, param, words in BAD:
            r = await client.post(path, json={**base, **extra})
            assert r.status_code == 400, (extra, r.text)
            error = r.json()["error"]
            assert error["param"] == param, (extra, error)
            assert error["message"].startswith(param.split(".")[0]), error
            for word in words:
                assert word in error["message"], (word, error)
        assert h.runner.num_steps == 0  # none reached the engine
        ok = await client.post(path, json={**base, "response_format": {"type": "text"}})
        assert ok.status_code == 200

    h.run(body)


def test_a_slow_compile_is_refused_while_the_server_serves(make_harness) -> None:
    """``--grammar-compile-limit`` (the engine's config) reaches the API process's compiler."""
    h = make_harness(engine_kw={"grammar_compile_limit_s": 0.01})
    ctx = h.app.state.ctx
    wide = {
        "type": "object",
        "properties": {
            f"p{i}": {"type": "string", "pattern": f"^[a-z]{{1,{i % 50 + 2}}}[0-9]+x{i}$"}
            for i in range(3000)
        },
    }
    fmt = {"type": "json_schema", "json_schema": {"schema": wide}}

    async def body(client):
        import asyncio

        slow = asyncio.create_task(
            client.post("/v1/chat/completions", json=_chat(response_format=fmt))
        )
        ok = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
        assert ok.status_code == 200
        r = await slow
        assert r.status_code == 400
        assert "did not compile within 0.01 s" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "response_format.json_schema.schema"

    try:
        h.run(body)
    finally:
        if ctx.grammars is not None:
            ctx.grammars.close()


def test_aborted_constrained_streams_leave_no_matcher(make_harness) -> None:
    """A client that leaves mid-stream: its blocks (the harness checks) and matchers go."""
    from .conftest import ASGIStream, wait_until

    h = make_harness(max_model_len=256, runner_kw={"step_delay_s": 0.01})
    structured = {"regex": "[a-z]{200}"}

    async def body(client):
        streams = [
            ASGIStream(h.app, "/v1/completions", {
                "prompt": "x", "max_tokens": 200, "stream": True, "structured_outputs": structured,
            }).start()
            for _ in range(3)
        ]  # fmt: skip
        for stream in streams:
            assert await stream.next_chunk() is not None
        await wait_until(lambda: len(h.llm.structured.matchers) == 3, what="three matchers")
        for stream in streams:
            await stream.disconnect()
        await wait_until(lambda: len(h.llm.structured.matchers) == 0, what="the matchers to go")

    h.run(body)
