"""The offline LLM API, the shared engine flags and ``pagedllm generate``."""

from __future__ import annotations

import argparse
import gc
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pagedllm.engine.args import add_engine_arguments, config_from_args, parse_size
from pagedllm.engine.config import EngineConfig
from pagedllm.engine.llm import LLM, OFFLINE_SCHEDULER_STEPS
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.fake_runner import FakeModelRunner


def test_generate_returns_outputs_in_input_order(fake_engine: Callable[..., LLMEngine]) -> None:
    llm = LLM.from_engine(fake_engine())
    prompts = ["a long prompt that finishes late", "short", {"prompt_token_ids": [104, 105]}]
    params = [
        SamplingParams(max_tokens=9),
        SamplingParams(max_tokens=2),
        SamplingParams(max_tokens=4),
    ]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [9, 2, 4]
    assert outputs[0].prompt == prompts[0] and outputs[2].prompt is None
    assert outputs[2].prompt_token_ids == (104, 105)
    assert all(o.finished for o in outputs)
    single = llm.generate("short", SamplingParams(max_tokens=2))  # with a progress bar
    assert single[0].outputs[0].token_ids == outputs[1].outputs[0].token_ids


def test_generate_rejects_bad_batches_without_leaking(
    fake_engine: Callable[..., LLMEngine],
) -> None:
    engine = fake_engine(max_model_len=32, num_blocks=8)
    llm = LLM.from_engine(engine)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(["fine", "x" * 40], SamplingParams(max_tokens=4), use_tqdm=False)
    assert not engine.has_unfinished_requests()  # "fine" was withdrawn again


def test_chat_uses_the_chat_template(fake_engine: Callable[..., LLMEngine], tokenizer: Any) -> None:
    llm = LLM.from_engine(fake_engine())
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    (output,) = llm.chat(messages, SamplingParams(max_tokens=3), use_tqdm=False)
    text = "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert list(output.prompt_token_ids) == tokenizer.encode(text)
    assert output.prompt == text  # the templated text, not None
    both = llm.chat([messages, messages[1:]], use_tqdm=False)
    assert [o.prompt for o in both] == [text, text[text.index("<|im_start|>user") :]]


def test_token_prompts_can_carry_their_text(fake_engine: Callable[..., LLMEngine]) -> None:
    engine = fake_engine()
    llm = LLM.from_engine(engine)
    ids = engine.tokenize("hello")
    params = SamplingParams(max_tokens=2)
    labelled, bare = llm.generate(
        [{"prompt": "hello", "prompt_token_ids": ids}, {"prompt_token_ids": ids}], params,
        use_tqdm=False,
    )  # fmt: skip
    assert labelled.prompt == "hello" and bare.prompt is None
    assert labelled.outputs[0].token_ids == bare.outputs[0].token_ids
    with pytest.raises(ValueError, match="prompt_text"):
        engine.add_request("x", "text prompt", params, prompt_text="other")
    with pytest.raises(TypeError, match="prompt_text"):
        engine.add_request("x", ids, params, prompt_text=5)  # type: ignore[arg-type]


def test_close_is_idempotent_and_a_closed_llm_says_so(
    fake_engine: Callable[..., LLMEngine],
) -> None:
    llm = LLM.from_engine(fake_engine())
    llm.generate("short", SamplingParams(max_tokens=2), use_tqdm=False)
    llm.close()
    llm.close()
    for use in (lambda: llm.generate("short", use_tqdm=False), llm.get_tokenizer):
        with pytest.raises(RuntimeError, match="this LLM is closed"):
            use()


def test_with_closes_the_llm_and_stops_its_disk_writer(
    fake_engine: Callable[..., LLMEngine], tmp_path: Path
) -> None:
    before = set(threading.enumerate())
    with LLM.from_engine(fake_engine(kv_offload_dir=str(tmp_path / "kv"))) as llm:
        writers = set(threading.enumerate()) - before
        (output,) = llm.generate("short", SamplingParams(max_tokens=2), use_tqdm=False)
    assert output.finished and writers
    assert not any(t.is_alive() for t in writers)
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate("short", use_tqdm=False)


def test_a_dropped_engine_stops_its_disk_writer(tokenizer: Any, tmp_path: Path) -> None:
    """No close(): collecting the engine releases what it started (its finalizer)."""
    before = set(threading.enumerate())
    engine = LLMEngine(
        EngineConfig(block_size=4, max_model_len=32, kv_offload_dir=str(tmp_path / "kv")),
        FakeModelRunner(16, 4, vocab_size=len(tokenizer)),
        tokenizer,
    )
    writers = set(threading.enumerate()) - before
    assert writers
    del engine
    gc.collect()
    assert not any(t.is_alive() for t in writers)


def test_llm_on_a_tiny_checkpoint(tiny_model_dir: Path, engines: list[LLMEngine]) -> None:
    import torch

    torch.set_num_threads(1)
    llm = LLM(model=str(tiny_model_dir), block_size=4, num_blocks=64, max_model_len=64)
    engines.append(llm.engine)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    a, b = llm.generate(["hello world", "hello world"], params, use_tqdm=False)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids and len(a.outputs[0].token_ids) == 6
    assert llm.engine.startup_report and "bytes per token" in llm.engine.startup_report
    # Offline batches decode several greedy steps per schedule unless told otherwise.
    assert llm.engine.scheduler.config.num_scheduler_steps == OFFLINE_SCHEDULER_STEPS > 1


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4GiB", 4 << 30),
        ("512MiB", 512 << 20),
        ("1.5G", 3 << 29),
        ("2GB", 2 * 10**9),
        ("1024", 1024),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


def test_bad_sizes_and_engine_flags() -> None:
    for bad in ("", "4XB", "-1G", "0"):
        with pytest.raises(ValueError):
            parse_size(bad)
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    config = config_from_args(
        parser.parse_args(["--kv-cache-memory", "4GiB", "--no-enable-prefix-caching"])
    )
    assert config.kv_cache_memory == 4 << 30 and not config.enable_prefix_caching
    assert config_from_args(parser.parse_args([])) == EngineConfig()
    assert EngineConfig().num_scheduler_steps == 1  # the server streams every step
    steps = config_from_args(parser.parse_args(["--num-scheduler-steps", "4"]))
    assert steps.num_scheduler_steps == 4
    with pytest.raises(ValueError, match="kv_cache_memory or memory_fraction"):
        config_from_args(parser.parse_args(["--kv-cache-memory", "1G", "--memory-fraction", "0.5"]))
    with pytest.raises(ValueError, match="preemption_mode"):
        EngineConfig(preemption_mode="never")


def test_pagedllm_generate_cli(tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from pagedllm.cli import main

    common = [
        "generate",
        "--model",
        str(tiny_model_dir),
        "--num-blocks",
        "64",
        "--block-size",
        "4",
        "--max-model-len",
        "64",
        "--max-tokens",
        "5",
        "--ignore-eos",
        "--quiet",
    ]
    assert main([*common, "--prompt", "hello"]) == 0
    streamed = capsys.readouterr().out
    assert (
        main(
            [
                *common,
                "--json",
                "--prompt",
                "hello",
                "--prompt",
                "bye",
                "--n",
                "2",
                "--temperature",
                "0.7",
                "--sample-seed",
                "1",
            ]
        )
        == 0
    )
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [len(line["outputs"]) for line in lines] == [2, 2]
    assert all(len(o["token_ids"]) == 5 for line in lines for o in line["outputs"])
    assert main([*common, "--chat", "--prompt", "hi", "--beam-width", "2"]) == 0
    assert capsys.readouterr().out.count("[beam ") == 2
    assert main([*common, "--prompt", "hi", "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err
    assert streamed.endswith("\n")
