"""The real Qwen2.5-Coder-0.5B with tools through the ``openai`` client: a weather /
calculator agent loop of three turns (opt-in: skips unless ``--model qwen2.5-coder-0.5b``
has been fetched; the tests never download it)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from pagedllm.engine.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.model import qwen_coder_model
from pagedllm.server.app import create_app
from tests.tool_calls.templates import QWEN2_5

from .conftest import StreamingASGITransport, wait_pool_free

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current temperature in a city, in degrees Celsius.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city"}},
            "required": ["city"],
        },
    },
}
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression such as 2 * (3 + 4).",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
TOOLS = [WEATHER, CALCULATOR]
QUESTION = (
    "What is the temperature in Paris in degrees Fahrenheit? First get the weather in "
    "Paris, then convert it with the calculator."
)


def qwen_dir() -> Path:
    directory = qwen_coder_model.qwen_coder_model_dir()
    if not (directory / "model.safetensors").is_file():
        pytest.skip(
            "qwen2.5-coder-0.5b not fetched here (run pagedllm generate --model qwen2.5-coder-0.5b)"
        )
    return directory


def run_tool(name: str, arguments: dict[str, Any]) -> str:
    if name == "get_weather":
        return json.dumps({"city": arguments["city"], "temperature_c": 21})
    return "69.8"  # what 21 * 9 / 5 + 32 comes to, whatever the model wrote


def named(tool: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": tool["function"]["name"]}}


@pytest.mark.slow
def test_the_gguf_template_is_the_one_the_tests_use() -> None:
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(qwen_dir()).chat_template == QWEN2_5


@pytest.mark.slow
def test_qwen_agent_loop_of_three_turns() -> None:
    """Turn 1 must call get_weather (streamed, and the same whole), turn 2 the
    calculator on the weather it got, turn 3 answers in text."""
    qwen_dir()
    config = EngineConfig(model="qwen2.5-coder-0.5b", kv_cache_memory=1 << 28, max_model_len=4096)
    engine = LLMEngine.from_config(config)
    app = create_app(engine, served_model_name="qwen")

    async def main() -> list[Any]:
        http = httpx.AsyncClient(transport=StreamingASGITransport(app), timeout=600)
        client = openai.AsyncOpenAI(
            base_url="http://test/v1", api_key="x", http_client=http, max_retries=0
        )
        greedy: dict[str, Any] = {"model": "qwen", "temperature": 0, "max_tokens": 120}
        messages: list[Any] = [{"role": "user", "content": QUESTION}]
        replies = []
        try:
            for choice in (named(WEATHER), named(CALCULATOR), "none"):
                ask = {**greedy, "messages": messages, "tools": TOOLS, "tool_choice": choice}
                response = await client.chat.completions.create(**ask)
                reply = response.choices[0]
                if choice == named(WEATHER):
                    await _check_streamed_equals(client, ask, reply.message)
                replies.append(reply)
                messages.append(reply.message.model_dump(exclude_none=True))
                for call in reply.message.tool_calls or ():
                    result = run_tool(call.function.name, json.loads(call.function.arguments))
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
            await wait_pool_free(app.state.engine, llm=engine)
            return replies
        finally:
            await http.aclose()
            await app.state.engine.shutdown()

    first, second, third = asyncio.run(main())
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for reply in (first, second):
        assert reply.finish_reason == "tool_calls"
        for call in reply.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    assert [c.function.name for c in first.message.tool_calls] == ["get_weather"]
    assert "paris" in json.loads(first.message.tool_calls[0].function.arguments)["city"].lower()
    assert [c.function.name for c in second.message.tool_calls] == ["calculator"]
    assert third.finish_reason == "stop" and not third.message.tool_calls
    assert third.message.content and third.message.content.strip()


async def _check_streamed_equals(
    client: openai.AsyncOpenAI, ask: dict[str, Any], whole: Any
) -> None:
    calls: dict[int, list[str]] = {}
    async for chunk in await client.chat.completions.create(**ask, stream=True):
        for call in chunk.choices[0].delta.tool_calls or () if chunk.choices else ():
            entry = calls.setdefault(call.index, [call.function.name or "", ""])
            entry[1] += call.function.arguments or ""
    expected = [[c.function.name, c.function.arguments] for c in whole.tool_calls]
    assert [calls[i] for i in sorted(calls)] == expected
