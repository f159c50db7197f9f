"""The engine core beside a server loads no tokenizer until a request needs one: the server
holds its own and does the text work (prompts as ids, outputs and stop strings built
there), so the core's plain requests run on the EOS id the server gave it; a
structured-output grammar loads the core's copy (``DeferredTokenizer``)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from pagedllm.engine.async_engine import AsyncEngine
from pagedllm.engine.config import EngineConfig
from pagedllm.engine.core import ConfigEngineFactory
from pagedllm.model.tokenizer import DeferredTokenizer
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams
from pagedllm.server.app import create_app

from .conftest import wait_pool_free

CHOICES = ("alpha", "beta")


class _Counted:
    """A stand-in tokenizer that counts how often it was built."""

    def __init__(self) -> None:
        self.loads = 0
        self.vocab = {"a": 0, "b": 1}

    def __call__(self) -> _Counted:
        self.loads += 1
        return self

    def encode(self, text: str) -> list[int]:
        return [self.vocab[c] for c in text]

    def __len__(self) -> int:
        return len(self.vocab)


def test_a_deferred_tokenizer_knows_its_eos_unloaded_and_loads_once():
    counted = _Counted()
    tokenizer = DeferredTokenizer(counted, eos_token_id=7)
    assert tokenizer.eos_token_id == 7 and not tokenizer.loaded and counted.loads == 0
    with pytest.raises(AttributeError):
        _ = tokenizer._anything  # a private name never loads it
    assert counted.loads == 0
    threads = [threading.Thread(target=lambda: tokenizer.encode("ab")) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert tokenizer.encode("ba") == [1, 0] and len(tokenizer.tokenizer()) == 2
    assert tokenizer.loaded and counted.loads == 1


def _config(model: Path) -> EngineConfig:
    return EngineConfig(model=str(model), num_blocks=64, block_size=4, max_model_len=128)


def _run(engine: Any, request_id: str, prompt: list[int], params: SamplingParams) -> list[int]:
    engine.add_request(request_id, prompt, params)
    tokens: list[int] = []
    for _ in range(200):
        for delta in engine.step_deltas():
            for sequence in delta.seqs:
                tokens += sequence.token_ids
        if not engine.has_unfinished_requests():
            return tokens
    raise AssertionError(f"{request_id} did not finish")


def test_a_core_beside_a_server_runs_plain_requests_without_its_tokenizer(tiny_checkpoint):
    factory = ConfigEngineFactory(_config(tiny_checkpoint))
    server_tokenizer = factory.load_tokenizer()
    beside = factory.beside(server_tokenizer)
    assert beside.deferred and beside.eos_token_id == server_tokenizer.eos_token_id
    assert factory.beside(None) is factory  # no tokenizer in the server: none deferred
    engine = beside.build_engine()
    try:
        assert isinstance(engine.tokenizer, DeferredTokenizer)
        assert engine.eos_token_id == server_tokenizer.eos_token_id
        prompt = server_tokenizer.encode("tell me a story")
        plain = SamplingParams(max_tokens=6, temperature=0.0, stop=["zzz"], ignore_eos=True)
        assert len(_run(engine, "plain", prompt, plain)) == 6
        assert not engine.tokenizer.loaded  # stop strings are the server's
        choice = StructuredOutputsParams(choice=CHOICES)
        constrained = SamplingParams(max_tokens=16, temperature=0.0, structured_outputs=choice)
        tokens = _run(engine, "choice", prompt, constrained)
        assert engine.tokenizer.loaded
        assert server_tokenizer.decode(tokens, skip_special_tokens=True) in CHOICES
    finally:
        engine.close()


def _maps_tokenizers(pid: int) -> bool:
    """Whether process ``pid`` has the ``tokenizers`` library mapped (loaded a tokenizer)."""
    return "/tokenizers/" in Path(f"/proc/{pid}/maps").read_text()


def test_serve_with_the_core_in_its_process_keeps_stops_and_grammars(tiny_checkpoint):
    engine = AsyncEngine.launch(ConfigEngineFactory(_config(tiny_checkpoint)))
    app = create_app(engine)

    async def main() -> tuple[dict, dict]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as c:
            try:
                letters = {str(ord(c)): 100 for c in "abc"}  # readable text from random weights
                base = {"prompt": "tell me", "max_tokens": 12, "temperature": 0,
                        "logit_bias": letters}  # fmt: skip
                free = (await c.post("/v1/completions", json={**base, "ignore_eos": True})).json()
                text = free["choices"][0]["text"]
                stop = text[3:5]  # a stop string the free run meets
                stopped = (await c.post("/v1/completions", json={**base, "stop": [stop]})).json()
                assert not _maps_tokenizers(engine.info.pid)  # the core loaded none
                body = {"prompt": "tell me", "max_tokens": 12, "temperature": 0,
                        "structured_outputs": {"choice": list(CHOICES)}}  # fmt: skip
                chose = (await c.post("/v1/completions", json=body)).json()
                assert _maps_tokenizers(engine.info.pid)  # the grammar loaded the core's
                await wait_pool_free(engine)
                return {"text": text, "stop": stop, "stopped": stopped}, chose
            finally:
                await engine.shutdown()

    free, chose = asyncio.run(main())
    assert "choices" in chose and "choices" in free["stopped"], (chose, free)
    stopped = free["stopped"]["choices"][0]
    assert stopped["finish_reason"] == "stop"
    assert free["text"].startswith(stopped["text"]) and free["stop"] not in stopped["text"]
    assert chose["choices"][0]["text"] in CHOICES
