"""Gemma 3 chat end to end: Gemma's turn template (the one ``--model gemma-3-270m`` gets)
renders the messages, the engine runs the model with its sliding-window layers, and the
answer stops at ``<end_of_turn>`` — through ``pagedllm generate --chat`` and the server's
/v1/chat/completions (in process, httpx), on a tiny random Gemma 3 checkpoint whose greedy
tokens are checked against transformers'. The real model's run is marked slow and skips
unless it has been fetched."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from pagedllm.cli import main
from pagedllm.engine.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.model import gemma_model
from pagedllm.model.gguf_loader import GEMMA_CHAT_TEMPLATE
from pagedllm.server.app import create_app
from pagedllm.testing import make_tiny_checkpoint

from .conftest import sse_events

MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Gemma 3 (local, local, global layers; window 4) whose tokenizer has
    Gemma's turn tokens and template, and ``<end_of_turn>`` as a stop id."""
    from transformers import AutoTokenizer

    path = make_tiny_checkpoint(
        tmp_path_factory.mktemp("gemma3-chat"),
        "gemma3_text",
        num_hidden_layers=3,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        seed=3,
    )
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_tokens(["<start_of_turn>", "<end_of_turn>"], special_tokens=True)
    tokenizer.chat_template = GEMMA_CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    end_of_turn = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    assert end_of_turn < config["vocab_size"]
    config["eos_token_id"] = [tokenizer.eos_token_id, end_of_turn]
    (path / "config.json").write_text(json.dumps(config))
    return path


def chat_prompt_ids(path: Path, messages: list[dict[str, str]]) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def transformers_answer(path: Path, prompt: list[int], max_tokens: int) -> str:
    """transformers' greedy answer to ``prompt`` (stopping at either stop id), as text."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    stops = json.loads((path / "config.json").read_text())["eos_token_id"]
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=stops,
            pad_token_id=stops[0],
        )[0, len(prompt) :].tolist()
    if out and out[-1] in stops:
        out = out[:-1]
    assert out, "the model stopped at once: nothing to compare"
    return tokenizer.decode(out, skip_special_tokens=True)


def test_gemma_turn_template_renders_the_messages(gemma_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gemma_dir)
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert text == (
        f"{tokenizer.bos_token}<start_of_turn>user\nTell me about the sea.<end_of_turn>\n"
        "<start_of_turn>model\n"
    )


def test_generate_chat_answers_as_transformers(gemma_dir: Path, capsys) -> None:
    expected = transformers_answer(gemma_dir, chat_prompt_ids(gemma_dir, MESSAGES), MAX_TOKENS)
    args = ["generate", "--model", str(gemma_dir), "--dtype", "float32", "--chat"]
    args += ["--prompt", MESSAGES[0]["content"], "--max-tokens", str(MAX_TOKENS)]
    args += ["--temperature", "0", "--quiet"]
    assert main(args) == 0
    assert capsys.readouterr().out.rstrip("\n") == expected


def test_server_chat_completions_answer_as_transformers(gemma_dir: Path) -> None:
    prompt = chat_prompt_ids(gemma_dir, MESSAGES)
    expected = transformers_answer(gemma_dir, prompt, MAX_TOKENS)
    config = EngineConfig(
        model=str(gemma_dir), dtype="float32", block_size=4, num_blocks=64, max_model_len=128
    )
    app = create_app(LLMEngine.from_config(config), served_model_name="gemma")
    body = {"model": "gemma", "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0}

    async def run() -> tuple[dict[str, Any], list[Any]]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://test", timeout=60
        ) as client:
            try:
                whole = await client.post("/v1/chat/completions", json=body)
                assert whole.status_code == 200, whole.text
                streamed = await client.post("/v1/chat/completions", json={**body, "stream": True})
                assert streamed.status_code == 200, streamed.text
                return whole.json(), sse_events(streamed.content)
            finally:
                await app.state.engine.shutdown()

    whole, events = asyncio.run(run())
    [choice] = whole["choices"]
    assert choice["message"] == {"role": "assistant", "content": expected}
    assert whole["usage"]["prompt_tokens"] == len(prompt)
    deltas = [e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]]
    assert "".join(deltas) == expected


@pytest.mark.slow
def test_gemma_270m_chat_through_generate_and_the_server(capsys) -> None:
    """The real model (fetched once by ``--model gemma-3-270m``): the chat answer of
    ``generate --chat`` and of /v1/chat/completions equal transformers' greedy answer on
    the converted checkpoint."""
    directory = gemma_model.gemma_model_dir()
    if not (directory / "model.safetensors").is_file():
        pytest.skip("gemma-3-270m not fetched here (run pagedllm generate --model gemma-3-270m)")
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    expected = transformers_answer(directory, chat_prompt_ids(directory, messages), 24)
    args = ["generate", "--model", "gemma-3-270m", "--dtype", "float32", "--chat", "--quiet"]
    args += ["--prompt", messages[0]["content"], "--max-tokens", "24", "--temperature", "0"]
    assert main(args) == 0
    assert capsys.readouterr().out.rstrip("\n") == expected
    config = EngineConfig(model="gemma-3-270m", dtype="float32", kv_cache_memory=1 << 28)
    app = create_app(LLMEngine.from_config(config), served_model_name="gemma")
    body = {"model": "gemma", "messages": messages, "max_tokens": 24, "temperature": 0}

    async def run() -> dict[str, Any]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://test", timeout=300
        ) as client:
            try:
                response = await client.post("/v1/chat/completions", json=body)
                assert response.status_code == 200, response.text
                return response.json()
            finally:
                await app.state.engine.shutdown()

    assert asyncio.run(run())["choices"][0]["message"]["content"] == expected
