"""Tool calling through /v1/chat/completions with the real ``openai`` client, in process.

The engine runs a scripted fake runner: each assistant turn (after the template's
``<|im_start|>assistant\\n``) it writes the next scripted reply, token by token (the tiny
tokenizer has one token per byte), then EOS. So the server's reading of calls is tested
on exactly the text a model would write, streamed token by token, and every test ends
with no KV block held (nothing leaks)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from pagedllm.engine.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.server.app import create_app
from pagedllm.testing import CHATML_TEMPLATE
from tests.tool_calls.scripted_runner import ScriptedRunner
from tests.tool_calls.templates import MISTRAL_STYLE, QWEN2_5, tiny_tokenizer

from .conftest import StreamingASGITransport, wait_pool_free

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city"],
        },
    },
}
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    },
}
TOOLS = [WEATHER, CALCULATOR]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
NESTED = '{"city": "Zürich ☃", "unit": "C", "extra": {"list": [1, {"deep": []}], "empty": {}}}'


def hermes(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def serve(
    tmp_path: Path,
    replies: Sequence[str],
    body: Callable[[openai.AsyncOpenAI], Awaitable[Any]],
    template: str = QWEN2_5,
    special: tuple[str, ...] = (),
    turn: str = "<|im_start|>assistant\n",
    **engine_kw: Any,
) -> Any:
    """Run ``body(client)`` against an app whose model writes ``replies``; then check no
    block leaked and shut the engine down."""
    tokenizer = tiny_tokenizer(tmp_path / "tokenizer", template, special)
    config = EngineConfig(block_size=16, max_model_len=4096, **engine_kw)
    engine = LLMEngine(config, ScriptedRunner(tokenizer, replies, turn), tokenizer)
    app = create_app(engine, served_model_name="tiny")

    async def main() -> Any:
        http = httpx.AsyncClient(transport=StreamingASGITransport(app), timeout=30)
        client = openai.AsyncOpenAI(
            base_url="http://test/v1", api_key="x", http_client=http, max_retries=0
        )
        try:
            result = await body(client)
            await wait_pool_free(app.state.engine, llm=engine)
            return result
        finally:
            await http.aclose()
            await app.state.engine.shutdown()

    return asyncio.run(main())


async def streamed(client: openai.AsyncOpenAI, **kw: Any) -> dict[str, Any]:
    """A streamed chat assembled as a client does, checking the deltas' order: each
    call's id and name in its first delta, only arguments after."""
    content, calls, finish = "", {}, None
    stream = await client.chat.completions.create(model="tiny", stream=True, **kw)
    async for chunk in stream:
        [choice] = chunk.choices
        delta = choice.delta
        content += delta.content or ""
        for call in delta.tool_calls or ():
            if call.index not in calls:
                assert call.id and call.function.name and call.type == "function"
                calls[call.index] = {"id": call.id, "name": call.function.name, "arguments": ""}
            else:
                assert call.id is None and call.function.name is None
            calls[call.index]["arguments"] += call.function.arguments or ""
        if choice.finish_reason is not None:
            finish = choice.finish_reason
    return {"content": content, "calls": [calls[i] for i in sorted(calls)], "finish": finish}


def plain_calls(message: Any) -> list[dict[str, str]]:
    return [
        {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
        for c in message.tool_calls or ()
    ]


def without_ids(calls: list[dict[str, str]]) -> list[tuple[str, str]]:
    return [(c["name"], c["arguments"]) for c in calls]


def test_auto_reads_the_call_whole_and_streamed(tmp_path: Path) -> None:
    reply = hermes("get_weather", NESTED)

    async def body(client: openai.AsyncOpenAI) -> None:
        raw = await client.chat.completions.with_raw_response.create(
            model="tiny", messages=ASK, tools=TOOLS
        )
        assert raw.headers["x-pagedllm-tool-format"] == "hermes"
        whole = raw.parse()
        [choice] = whole.choices
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        [call] = plain_calls(choice.message)
        assert call["id"].startswith("call_") and call["name"] == "get_weather"
        assert call["arguments"] == NESTED
        assert json.loads(call["arguments"])["extra"]["empty"] == {}
        stream = await streamed(client, messages=ASK, tools=TOOLS)
        assert stream["content"] == ""
        assert without_ids(stream["calls"]) == without_ids([call])
        assert stream["finish"] == "tool_calls"

    serve(tmp_path, [reply] * 2, body)


def test_content_before_calls_streams_as_content(tmp_path: Path) -> None:
    reply = "Let me check both.\n" + hermes("get_weather", '{"city": "Oslo"}') + "\n"
    reply += hermes("calculator", "{}")

    async def body(client: openai.AsyncOpenAI) -> None:
        whole = await client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS)
        message = whole.choices[0].message
        assert message.content == "Let me check both."
        calls = without_ids(plain_calls(message))
        assert calls == [("get_weather", '{"city": "Oslo"}'), ("calculator", "{}")]
        stream = await streamed(client, messages=ASK, tools=TOOLS)
        assert stream["content"] == "Let me check both." and without_ids(stream["calls"]) == calls
        # parallel_tool_calls=false: the first call only, whole and streamed
        one = await client.chat.completions.create(
            model="tiny", messages=ASK, tools=TOOLS, parallel_tool_calls=False
        )
        assert without_ids(plain_calls(one.choices[0].message)) == calls[:1]
        stream = await streamed(client, messages=ASK, tools=TOOLS, parallel_tool_calls=False)
        assert without_ids(stream["calls"]) == calls[:1] and stream["finish"] == "tool_calls"

    serve(tmp_path, [reply] * 4, body)


def test_a_plain_answer_and_tool_choice_none_stay_content(tmp_path: Path) -> None:
    call = hermes("get_weather", '{"city": "Oslo"}')

    async def body(client: openai.AsyncOpenAI) -> None:
        plain = await client.chat.completions.create(
            model="tiny", messages=[*ASK, {"role": "assistant", "content": "x"}, *ASK], tools=TOOLS
        )
        assert plain.choices[0].message.content == "It is sunny.\n"
        assert not plain.choices[0].message.tool_calls
        assert plain.choices[0].finish_reason == "stop"
        none = await client.chat.completions.create(
            model="tiny", messages=ASK, tools=TOOLS, tool_choice="none"
        )
        assert none.choices[0].message.content == call
        assert none.choices[0].finish_reason == "stop"

    # The history's assistant turn counts: the first request is the script's second turn.
    serve(tmp_path, [call, "It is sunny.\n"], body)


def test_an_agent_loop_sends_history_calls_and_results_back(tmp_path: Path) -> None:
    replies = [
        hermes("get_weather", '{"city": "Paris"}'),
        hermes("calculator", '{"expression": "21 * 9 / 5 + 32"}'),
        "It is 21°C (69.8°F) in Paris.",
    ]
    results = {"get_weather": "21°C", "calculator": "69.8"}

    async def body(client: openai.AsyncOpenAI) -> list[str]:
        messages: list[Any] = list(ASK)
        for _ in range(3):
            response = await client.chat.completions.create(
                model="tiny", messages=messages, tools=TOOLS
            )
            message = response.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls or ():
                messages.append(
                    {
                        "role": "tool",
                        "tool_call_id": call.id,
                        "content": results[call.function.name],
                    }
                )
            if response.choices[0].finish_reason == "stop":
                return [m["role"] for m in messages]
        raise AssertionError("the loop did not end")

    roles = serve(tmp_path, replies, body)
    assert roles == ["user", "assistant", "tool", "assistant", "tool", "assistant"]


def test_a_template_without_tools_gets_the_generic_format(tmp_path: Path) -> None:
    reply = hermes("get_weather", '{"city": "Oslo"}')

    async def body(client: openai.AsyncOpenAI) -> None:
        raw = await client.chat.completions.with_raw_response.create(
            model="tiny", messages=ASK, tools=TOOLS
        )
        assert raw.headers["x-pagedllm-tool-format"] == "generic"
        message = raw.parse().choices[0].message
        assert without_ids(plain_calls(message)) == [("get_weather", '{"city": "Oslo"}')]
        stream = await client.chat.completions.with_raw_response.create(
            model="tiny", messages=ASK, tools=TOOLS, stream=True
        )
        assert stream.headers["x-pagedllm-tool-format"] == "generic"
        async for _ in stream.parse():
            pass

    serve(tmp_path, [reply] * 2, body, template=CHATML_TEMPLATE)


def test_a_forced_parser_needs_a_template_that_shows_tools(tmp_path: Path) -> None:
    async def body(client: openai.AsyncOpenAI) -> None:
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS)
        assert info.value.body["param"] == "tools"
        assert "does not render tools" in info.value.body["message"]
        # without tools the chat goes on as before
        plain = await client.chat.completions.create(model="tiny", messages=ASK)
        assert plain.choices[0].message.content == "hello"

    serve(tmp_path, ["hello"], body, template=CHATML_TEMPLATE, tool_call_parser="hermes")


def test_mistral_keeps_its_special_marker(tmp_path: Path) -> None:
    reply = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Nice"}}]'

    async def body(client: openai.AsyncOpenAI) -> None:
        raw = await client.chat.completions.with_raw_response.create(
            model="tiny", messages=ASK, tools=TOOLS
        )
        assert raw.headers["x-pagedllm-tool-format"] == "mistral"
        message = raw.parse().choices[0].message
        assert message.content is None
        assert without_ids(plain_calls(message)) == [("get_weather", '{"city": "Nice"}')]

    serve(tmp_path, [reply], body, MISTRAL_STYLE, ("[TOOL_CALLS]",), turn="[/INST]")


def test_required_and_named_replies_are_held_to_the_tools(tmp_path: Path) -> None:
    """The grammar lets a valid call through unchanged, and turns a call of the wrong
    tool into one of the named tool whose arguments validate (the fake runner takes the
    first token the grammar allows where its script is refused)."""
    weather = hermes("get_weather", '{"city": "Paris"}')
    calculator = {"type": "function", "function": {"name": "calculator"}}

    async def body(client: openai.AsyncOpenAI) -> None:
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            whole = await client.chat.completions.create(
                model="tiny", messages=ASK, tools=TOOLS, tool_choice=choice
            )
            assert without_ids(plain_calls(whole.choices[0].message)) == [
                ("get_weather", '{"city": "Paris"}')
            ]
            stream = await streamed(client, messages=ASK, tools=TOOLS, tool_choice=choice)
            assert without_ids(stream["calls"]) == [("get_weather", '{"city": "Paris"}')]
        forced = await client.chat.completions.create(
            model="tiny", messages=ASK, tools=TOOLS, tool_choice=calculator
        )
        [call] = plain_calls(forced.choices[0].message)
        assert call["name"] == "calculator" and forced.choices[0].finish_reason == "tool_calls"
        jsonschema.validate(json.loads(call["arguments"]), CALCULATOR["function"]["parameters"])
        stream = await streamed(client, messages=ASK, tools=TOOLS, tool_choice=calculator)
        assert without_ids(stream["calls"]) == without_ids([call])

    serve(tmp_path, [weather] * 5, body)


def test_constrained_calls_refuse_what_the_grammar_cannot_take(tmp_path: Path) -> None:
    odd = {
        "type": "function",
        "function": {
            "name": "dial",
            "parameters": {
                "type": "object",
                "properties": {"number": {"type": "string", "format": "phone-number"}},
            },
        },
    }

    async def body(client: openai.AsyncOpenAI) -> None:
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(
                model="tiny", messages=ASK, tools=[WEATHER, odd], tool_choice="required"
            )
        assert info.value.body["param"] == "tools[1].function.parameters"
        assert '"format": "phone-number"' in info.value.body["message"]
        assert "/properties/number" in info.value.body["message"]
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(
                model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                response_format={"type": "json_object"},
            )  # fmt: skip
        assert info.value.body["param"] == "tool_choice"
        # auto compiles nothing: the model's own format is read, whatever the schema
        auto = await client.chat.completions.create(model="tiny", messages=ASK, tools=[odd])
        assert auto.choices[0].message.content == "fine"

    serve(tmp_path, ["fine"], body)
