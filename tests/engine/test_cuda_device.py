"""``--device cuda``: the paged engine on a GPU. Greedy tokens equal transformers' on the
same GPU; paging choices (prefix hits, chunked prefill, preemption by recompute and by swap
through pinned host blocks) do not change them; seeded sampling repeats. Skipped where no
CUDA device is visible (the CI machines are CPU-only; a lent GPU runs them)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams
from tests.engine.test_engine_model import BASE, VARIANTS, generate, prompts

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device; none is visible here"
)
CUDA_VARIANTS = ("prefix-cache", "chunk-5", "recompute-tiny", "swap-tiny", "multi-step-4")


@pytest.fixture
def cuda_engine(model_engine: Callable[..., LLMEngine]) -> Callable[..., LLMEngine]:
    return lambda **config: model_engine(device="cuda", **config)


def transformers_greedy(model_dir, prompt: list[int], num_tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model = model.to("cuda").eval()
    tokens = list(prompt)
    with torch.inference_mode():
        for _ in range(num_tokens):
            logits = model(input_ids=torch.tensor([tokens], device="cuda")).logits
            tokens.append(int(logits[0, -1].argmax()))
    return tokens[len(prompt) :]


def test_greedy_tokens_on_the_gpu_equal_transformers_on_the_gpu(
    cuda_engine: Callable[..., LLMEngine], tiny_model_dir
) -> None:
    engine = cuda_engine(num_blocks=256, **BASE)
    assert engine.runner.device.type == "cuda"
    ours = generate(engine)
    for prompt, [tokens] in zip(prompts(), ours, strict=True):
        assert list(tokens) == transformers_greedy(tiny_model_dir, prompt, len(tokens))


@pytest.mark.parametrize("name", CUDA_VARIANTS)
def test_paging_choices_on_the_gpu_keep_greedy_tokens(
    cuda_engine: Callable[..., LLMEngine], name: str
) -> None:
    baseline = generate(cuda_engine(num_blocks=256, enable_prefix_caching=False, **BASE))
    assert generate(cuda_engine(**BASE, **VARIANTS[name])) == baseline


def test_seeded_sampling_on_the_gpu_repeats(cuda_engine: Callable[..., LLMEngine]) -> None:
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=7, n=2, ignore_eos=True)
    first = generate(cuda_engine(num_blocks=256, **BASE), params)
    assert first == generate(cuda_engine(num_blocks=256, **BASE), params)
    assert all(len(set(outputs)) == 2 for outputs in first)  # two samples differ
