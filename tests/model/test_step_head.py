"""A quantized LM head inside the one-call decode loops (``forward_head``,
``kernels/csrc/step_head.h``): the logits and argmax of ``compute_logits(hidden,
float32=False)`` bit for bit, and the runner's tokens, logprobs and multi-step output
unchanged by it."""

from __future__ import annotations

import pytest
import torch

from pagedllm.core.outputs import SchedulerOutput
from pagedllm.kernels.ops import argmax_rows
from pagedllm.model import load_model
from pagedllm.model.base import StepOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.model_runner import TorchModelRunner

from .parity_helpers import HandDriver
from .test_gemma_model import write_gemma_gguf
from .test_gguf_and_default_model import write_tiny_gguf
from .test_quantized_gemma import gemma_270m_formats, gemma_checkpoint  # noqa: F401

pytest.importorskip("gguf")


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    """1 thread, and 2: a step team (step_head.h runs the head's chunks in it)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(saved)


def llama_gguf(checkpoints, tmp_path, arch: str = "qwen2_bias"):
    """Q4_1 linears (the head too where untied) and a Q8_0 token embedding, as SmolLM2's."""
    return write_tiny_gguf(checkpoints(arch), tmp_path / "t.gguf", False, "Q4_1", "Q8_0")


def one_call_runner(path, dtype: str, **kwargs) -> TorchModelRunner:
    model = load_model(path, dtype, load_tokenizer=False).model
    runner = TorchModelRunner(model, block_size=16, num_blocks=64, **kwargs)
    if model.fast_path is None or not model.fast_path.runs_head():
        pytest.skip("no one-call decode loop here (the C++ kernels did not load)")
    return runner


def prefilled(runner: TorchModelRunner, count: int):
    """A driver with ``count`` sequences whose prompts are in the cache."""
    driver = HandDriver(runner)
    seqs = [
        driver.add(f"r{i}", [(7 * i + 5 * t) % 250 for t in range(9 + 3 * i)]) for i in range(count)
    ]
    driver.step([driver.schedule(s, len(s.token_ids)) for s in seqs])
    for i, seq in enumerate(seqs):
        driver.append(seq.request_id, 17 + i)
    return driver, seqs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("count", [1, 3, 12])  # 12: beyond the step team's 8 tokens
def test_head_in_the_call_gives_compute_logits(
    tmp_path, checkpoints, threads, dtype, count
) -> None:
    runner = one_call_runner(llama_gguf(checkpoints, tmp_path), dtype)
    driver, seqs = prefilled(runner, count)
    scheduled = tuple(driver.schedule(s, 1) for s in seqs)
    # The same tokens at the same positions each time: the cache ends as it was.
    logits_step = runner.sampled_step(scheduled, argmax=False)
    tokens_step = runner.sampled_step(scheduled, argmax=True)
    assert logits_step.logits is not None and logits_step.tokens is None
    assert tokens_step.tokens is not None and tokens_step.logits is None
    assert torch.equal(logits_step.hidden, tokens_step.hidden)
    expected = runner.model.compute_logits(logits_step.hidden, float32=False)
    assert logits_step.logits.dtype == expected.dtype
    assert torch.equal(logits_step.logits, expected)
    assert torch.equal(tokens_step.tokens, argmax_rows(expected))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gemma_head_in_the_call_gives_compute_logits(
    tmp_path,
    gemma_checkpoint,  # noqa: F811
    threads,
    dtype,
) -> None:
    path = write_gemma_gguf(gemma_checkpoint, tmp_path / "g.gguf", gemma_270m_formats)
    runner = one_call_runner(path, dtype)
    driver, seqs = prefilled(runner, 2)
    scheduled = tuple(driver.schedule(s, 1) for s in seqs)
    logits_step = runner.sampled_step(scheduled, argmax=False)
    tokens_step = runner.sampled_step(scheduled, argmax=True)
    assert logits_step.logits is not None and tokens_step.tokens is not None
    expected = runner.model.compute_logits(logits_step.hidden, float32=False)
    assert torch.equal(logits_step.logits, expected)
    assert torch.equal(tokens_step.tokens, argmax_rows(expected))


def test_a_long_prompt_step_leaves_the_head_to_the_caller(tmp_path, checkpoints) -> None:
    """Beyond the one-call loop's rows the layers run one by one: the hidden states alone."""
    runner = one_call_runner(llama_gguf(checkpoints, tmp_path), "float32")
    runner.model.fast_path.plan = runner.model.fast_path.plan._replace(max_rows=8)
    driver = HandDriver(runner)
    seq = driver.add("p", [(3 * t) % 250 for t in range(20)])
    step = runner.sampled_step((driver.schedule(seq, 20),), argmax=True)
    assert step.hidden.shape[0] == 1 and step.tokens is None and step.logits is None


def without_head(runner: TorchModelRunner) -> None:
    """The runner's model as before ``forward_head``: the head always outside the call."""
    model = runner.model

    def forward_head(input_ids, positions, kv_caches, meta, output_rows=None, *, argmax):
        return StepOutput(model(input_ids, positions, kv_caches, meta, output_rows))

    model.forward_head = forward_head


def execute_steps(runner: TorchModelRunner, params: SamplingParams, num_steps: int) -> list:
    """Two sequences: a prompt step, then six decode steps (``num_steps`` at a time) fed
    their own tokens; every step's output."""
    driver, seqs = prefilled(runner, 2)
    outputs = []
    for _ in range(6 // num_steps):
        scheduled = []
        for seq in seqs:
            driver.grow(seq, seq.num_computed + num_steps)
            item = driver.schedule(seq, 1)._replace(sampling_params=params)
            scheduled.append(item._replace(block_table=tuple(seq.block_table)))
        output = runner.execute(SchedulerOutput(scheduled=tuple(scheduled), num_steps=num_steps))
        outputs.append(output)
        for seq, tokens in zip(seqs, output.sampled_token_ids, strict=True):
            seq.num_computed += len(tokens)
            for token in tokens:
                driver.append(seq.request_id, token)
    return outputs


@pytest.mark.parametrize(
    ("params", "num_steps"),
    [
        (SamplingParams(temperature=0.0), 1),
        (SamplingParams(temperature=0.0), 3),  # multi-step: the argmax fed back as a tensor
        (SamplingParams(temperature=0.0, logprobs=3), 1),  # greedy off the fast path
        (SamplingParams(temperature=0.8, top_k=20, seed=3, logprobs=2), 1),
        (SamplingParams(temperature=1.0, seed=5), 1),  # logits in the model's dtype
    ],
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_runner_outputs_do_not_change(
    tmp_path, checkpoints, threads, params, num_steps, dtype
) -> None:
    path = llama_gguf(checkpoints, tmp_path)
    fused = execute_steps(one_call_runner(path, dtype), params, num_steps)
    plain_runner = one_call_runner(path, dtype)
    without_head(plain_runner)
    plain = execute_steps(plain_runner, params, num_steps)
    assert fused == plain


def test_routes_say_where_the_head_runs(tmp_path, checkpoints) -> None:
    routes = one_call_runner(llama_gguf(checkpoints, tmp_path), "bfloat16").routes()
    assert "inside the one-call decode loop" in routes.lm_head
    assert "for plain greedy rows" in routes.sampler
