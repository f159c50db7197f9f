"""Token ids without a tokenizer: ``skip_tokenizer_init`` / ``--skip-tokenizer-init``.

A checkpoint directory with no tokenizer files loads only with the flag (a clear message
otherwise); the engine, ``LLM`` and the server then take token ids and give token ids
back, and refuse text (prompts, chat, stop strings) with a message naming the flag."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import httpx
import pytest

from pagedllm.engine.args import add_engine_arguments, config_from_args
from pagedllm.engine.llm import LLM
from pagedllm.model import load_model
from pagedllm.model.loader import TOKENIZER_FILES
from pagedllm.sampling_params import SamplingParams
from pagedllm.server.app import create_app


@pytest.fixture(scope="module")
def bare_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama directory with its tokenizer files removed."""
    from pagedllm.testing import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path_factory.mktemp("bare"), "llama", seed=3)
    for name in (*TOKENIZER_FILES, "special_tokens_map.json", "chat_template.jinja"):
        (path / name).unlink(missing_ok=True)
    return path


def test_missing_tokenizer_names_the_flag(bare_checkpoint: Path) -> None:
    with pytest.raises(ValueError, match="skip-tokenizer-init"):
        load_model(bare_checkpoint)


def test_llm_takes_and_gives_token_ids(bare_checkpoint: Path, tmp_path: Path) -> None:
    llm = LLM(str(bare_checkpoint), skip_tokenizer_init=True, num_blocks=32, block_size=4)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    [out] = llm.generate([[5, 17, 42, 9]], params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].text == ""
    # The same weights with a tokenizer give the same ids.
    shutil.copytree(bare_checkpoint, tmp_path / "full")
    from pagedllm.testing import make_tiny_tokenizer

    make_tiny_tokenizer(tmp_path / "full")
    [ref] = LLM(str(tmp_path / "full"), num_blocks=32, block_size=4).generate(
        [[5, 17, 42, 9]], params, use_tqdm=False
    )
    assert ref.outputs[0].token_ids == out.outputs[0].token_ids
    with pytest.raises(ValueError, match="no tokenizer.*token ids"):
        llm.generate(["hello"], params, use_tqdm=False)
    with pytest.raises(ValueError, match="stop strings"):
        llm.generate([[5, 6]], SamplingParams(max_tokens=2, stop=["x"]), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_flag_reaches_the_engine_config() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert config_from_args(parser.parse_args(["--skip-tokenizer-init"])).skip_tokenizer_init
    assert not config_from_args(parser.parse_args([])).skip_tokenizer_init


def test_server_serves_ids_and_refuses_text(bare_checkpoint: Path) -> None:
    llm = LLM(str(bare_checkpoint), skip_tokenizer_init=True, num_blocks=32, block_size=4)
    app = create_app(llm.engine)

    async def main() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            body = {
                "model": bare_checkpoint.name,
                "prompt": [5, 17, 42],
                "max_tokens": 3,
                "logprobs": 1,
            }
            reply = await client.post("/v1/completions", json=body)
            assert reply.status_code == 200, reply.text
            choice = reply.json()["choices"][0]
            assert len(choice["token_ids"]) == 3 and choice["text"] == ""
            assert choice["logprobs"]["tokens"][0] == f"token_id:{choice['token_ids'][0]}"
            stream = await client.post("/v1/completions", json={**body, "stream": True})
            assert stream.status_code == 200
            assert '"token_ids":[' in stream.text
            text = await client.post("/v1/completions", json={**body, "prompt": "hi"})
            assert text.status_code == 400 and "skip-tokenizer-init" in text.text
            chat = {"model": bare_checkpoint.name, "messages": [{"role": "user", "content": "hi"}]}
            reply = await client.post("/v1/chat/completions", json=chat)
            assert reply.status_code == 400 and "skip-tokenizer-init" in reply.text
        await app.state.engine.shutdown()

    asyncio.run(main())
