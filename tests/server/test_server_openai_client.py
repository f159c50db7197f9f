"""A real uvicorn on 127.0.0.1 (random free port) serving a tiny random checkpoint,
driven by the real ``openai`` client: completions, chat, streaming, n>1, errors."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import uvicorn

from pagedllm.engine.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.server.app import create_app

from .conftest import wait_until_sync

API_KEY = "test-key"
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Any) -> Iterator[str]:
    engine = LLMEngine.from_config(
        EngineConfig(model=str(tiny_checkpoint), num_blocks=128, block_size=4, max_model_len=256)
    )
    app = create_app(engine, api_key=API_KEY, served_model_name="tiny")
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning")
    uv = uvicorn.Server(config)
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    wait_until_sync(lambda: uv.started or not thread.is_alive(), 30, what="uvicorn to start")
    assert uv.started, "uvicorn did not start"
    port = uv.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}"
    uv.should_exit = True
    thread.join(30)
    assert not thread.is_alive()


@pytest.fixture
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def _cache(server: str) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    return httpx.get(f"{server}/v1/cache", headers=headers, timeout=10).json()


def test_completions_plain_and_streamed_agree(client: openai.OpenAI, server: str) -> None:
    assert [m.id for m in client.models.list().data] == ["tiny"]
    plain = client.completions.create(model="tiny", prompt="Once upon", max_tokens=8, **GREEDY)
    [choice] = plain.choices
    assert choice.finish_reason == "length"
    assert plain.usage.completion_tokens == 8
    assert plain.usage.prompt_tokens == len("Once upon")
    assert plain.usage.prompt_tokens_details.cached_tokens == 0

    chunks = list(
        client.completions.create(
            model="tiny", prompt="Once upon", max_tokens=8, stream=True,
            stream_options={"include_usage": True}, **GREEDY,
        )
    )  # fmt: skip
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    # the second identical prompt hit the prefix cache (2 full blocks of 4 of 9 tokens)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 8
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_completions_n_and_batch(client: openai.OpenAI) -> None:
    result = client.completions.create(
        model="tiny", prompt=["alpha", "beta"], n=2, max_tokens=4, temperature=1.0, seed=7
    )
    assert sorted(c.index for c in result.choices) == [0, 1, 2, 3]
    assert result.usage.prompt_tokens == len("alpha") + len("beta")


def test_chat_plain_and_streamed_with_n(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "What is paged attention?"}]
    plain = client.chat.completions.create(
        model="tiny", messages=messages, max_completion_tokens=6, n=2, **GREEDY
    )
    assert len(plain.choices) == 2
    assert all(c.message.role == "assistant" for c in plain.choices)
    assert plain.choices[0].message.content == plain.choices[1].message.content  # greedy
    assert plain.usage.completion_tokens == 12

    texts: dict[int, str] = {0: "", 1: ""}
    roles: dict[int, str | None] = {}
    finish: dict[int, str] = {}
    for chunk in client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, n=2, stream=True, **GREEDY
    ):
        for c in chunk.choices:
            roles.setdefault(c.index, c.delta.role)
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert roles == {0: "assistant", 1: "assistant"}
    assert finish == {0: "length", 1: "length"}
    assert texts[0] == texts[1] == plain.choices[0].message.content


def test_errors_through_the_client(client: openai.OpenAI, server: str) -> None:
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="x", max_tokens=5, temperature=7.0)
    assert "temperature" in str(info.value)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="other-model", prompt="x", max_tokens=2)
    assert httpx.get(f"{server}/health").status_code == 200  # no key needed
    report = _cache(server)
    assert report["blocks_used"] == 0 and report["running"] == 0


def test_logprobs_through_the_client(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_completion_tokens=4,
        logprobs=True,
        top_logprobs=3,
        **GREEDY,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert entry.logprob <= 0.0 and len(entry.top_logprobs) == 3
        # greedy: the chosen token is the most likely one
        assert entry.logprob == max(t.logprob for t in entry.top_logprobs)
    text = client.completions.create(model="tiny", prompt="hi", max_tokens=3, logprobs=2, **GREEDY)
    lp = text.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3


EDGE_VALUES = [
    {"top_k": 100000},
    {"top_k": -1, "top_p": 0.01},
    {"seed": 2**63 - 1, "temperature": 1.5},
    {"seed": -(2**63)},
    {"min_p": 1.0},
    {"temperature": 1e-9},
    {"repetition_penalty": 100.0, "presence_penalty": 2.0, "frequency_penalty": -2.0},
    {"logprobs": 20},
    {"stop_token_ids": [99999]},
    {"stop": ["a", "b", "c", "d", "e", "f"]},
    {"logit_bias": {"5": 100, "7": -100}},
    {"logit_bias": {"999999": 1}},
    {"min_tokens": 3, "max_tokens": 3},
    {"n": 16, "max_tokens": 2},
    {"prompt": [0]},
    {"prompt": [319] * 200, "max_tokens": 56},
]


def test_edge_values_answer_200_or_400_never_5xx(server: str) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    for extra in EDGE_VALUES:
        body = {"model": "tiny", "prompt": "edge", "max_tokens": 3, **extra}
        r = httpx.post(f"{server}/v1/completions", json=body, headers=headers, timeout=60)
        assert r.status_code in (200, 400), (extra, r.status_code, r.text)
    assert _cache(server)["blocks_used"] == 0


def test_structured_outputs_through_the_client(client: openai.OpenAI) -> None:
    """response_format json_schema (streamed and not) and vLLM's structured_outputs in
    extra_body, on the tiny random model: its answers match all the same."""
    import json

    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 5}, "n": {"enum": [1, 2, 3]}},
        "required": ["name", "n"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    messages = [{"role": "user", "content": "json please"}]
    plain = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=200, temperature=0.0, response_format=fmt
    )
    value = json.loads(plain.choices[0].message.content)
    assert set(value) == {"name", "n"} and value["n"] in (1, 2, 3) and len(value["name"]) <= 5
    assert plain.choices[0].finish_reason == "stop"
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=200, temperature=0.0,
            response_format=fmt, stream=True,
        )
        if c.choices
    )  # fmt: skip
    assert streamed == plain.choices[0].message.content
    picked = client.completions.create(
        model="tiny", prompt="x", max_tokens=20, temperature=1.0,
        extra_body={"structured_outputs": {"choice": ["red", "blue"]}},
    )  # fmt: skip
    assert picked.choices[0].text in ("red", "blue")
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=5, response_format={"type": "yaml"}
        )
    assert "response_format.type" in str(info.value)
