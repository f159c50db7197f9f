"""Tool calls from real (tiny, random) models: Qwen2 with Qwen2.5's own template and
Llama with a Llama-3-style one, through the real model runner and sampler. A random
model writes no call on its own; held to the grammar (``tool_choice`` required or named)
it writes calls that parse and whose arguments validate, greedy and sampled, n=2."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from pagedllm.engine.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.server.app import create_app
from pagedllm.testing import make_tiny_checkpoint
from tests.tool_calls.templates import LLAMA3_STYLE, QWEN2_5

from .conftest import StreamingASGITransport, wait_pool_free

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["C", "F"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
NOW = {"type": "function", "function": {"name": "now"}}
SCHEMAS = {"get_weather": WEATHER["function"]["parameters"], "now": {"type": "object"}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def checkpoint(root: Path, arch: str, template: str) -> Path:
    from transformers import AutoTokenizer

    path = make_tiny_checkpoint(root / arch, arch, seed=7, max_position_embeddings=4096)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.parametrize(
    ("arch", "template", "fmt"),
    [("qwen2", QWEN2_5, "hermes"), ("llama", LLAMA3_STYLE, "llama3_json")],
)
def test_a_random_model_held_to_the_grammar_calls_validly(
    tmp_path: Path, arch: str, template: str, fmt: str
) -> None:
    path = checkpoint(tmp_path, arch, template)
    config = EngineConfig(model=str(path), dtype="float32", num_blocks=512, max_model_len=4096)
    engine = LLMEngine.from_config(config)
    app = create_app(engine, served_model_name="tiny")

    async def main() -> list[Any]:
        http = httpx.AsyncClient(transport=StreamingASGITransport(app), timeout=120)
        client = openai.AsyncOpenAI(
            base_url="http://test/v1", api_key="x", http_client=http, max_retries=0
        )
        named = {"type": "function", "function": {"name": "get_weather"}}
        choices = []
        try:
            for tool_choice, sampling in (
                ("required", {"temperature": 0}),
                (named, {"temperature": 1.0, "seed": 3, "n": 2}),
            ):
                raw = await client.chat.completions.with_raw_response.create(
                    model="tiny", messages=ASK, tools=[WEATHER, NOW], tool_choice=tool_choice,
                    max_tokens=400, parallel_tool_calls=False, **sampling,
                )  # fmt: skip
                assert raw.headers["x-pagedllm-tool-format"] == fmt
                choices += raw.parse().choices
            await wait_pool_free(app.state.engine, llm=engine)
            return choices
        finally:
            await http.aclose()
            await app.state.engine.shutdown()

    choices = asyncio.run(main())
    assert len(choices) == 3
    for choice in choices:
        assert choice.finish_reason == "tool_calls", choice
        [call] = choice.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert {c.message.tool_calls[0].function.name for c in choices[1:]} == {"get_weather"}


def test_a_user_grammar_that_spells_an_added_token_is_served(tmp_path: Path) -> None:
    """Qwen2.5's tokenizer holds ``<tool_call>`` as an added, non-special token. A user
    regex that spells it out once got that token offered by the mask and refused by the
    matcher: a 500. Now greedy and sampled requests follow the regex to the end."""
    from transformers import AutoTokenizer

    path = checkpoint(tmp_path, "qwen2", QWEN2_5)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_tokens(["<tool_call>", "</tool_call>"])
    tokenizer.save_pretrained(path)
    config = EngineConfig(model=str(path), dtype="float32", num_blocks=128, max_model_len=512)
    engine = LLMEngine.from_config(config)
    app = create_app(engine, served_model_name="tiny")
    pattern = "<tool_call>[a-z]{1,6}</tool_call>"

    async def main() -> list[httpx.Response]:
        client = httpx.AsyncClient(transport=StreamingASGITransport(app), base_url="http://t")
        try:
            answers = [
                await client.post(
                    "/v1/completions",
                    json={
                        "prompt": "call:",
                        "max_tokens": 40,
                        "structured_outputs": {"regex": pattern},
                        **sampling,
                    },
                )  # fmt: skip
                for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 5, "n": 4})
            ]
            await wait_pool_free(app.state.engine, llm=engine)
            return answers
        finally:
            await client.aclose()
            await app.state.engine.shutdown()

    texts = []
    for answer in asyncio.run(main()):
        assert answer.status_code == 200, answer.text
        texts += [(c["text"], c["finish_reason"]) for c in answer.json()["choices"]]
    assert len(texts) == 5
    for text, reason in texts:
        assert re.fullmatch(pattern, text) and reason == "stop", text
