"""LLMEngine on a tiny random Llama: paging choices must not change greedy tokens."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams
from tests.engine.conftest import run_all

MAX_TOKENS = 12


def prompts() -> list[list[int]]:
    rng = random.Random(5)
    system = [rng.randrange(256) for _ in range(19)]  # a shared prefix, not block-aligned
    return [system + [rng.randrange(256) for _ in range(n)] for n in (3, 11, 1)] + [
        [rng.randrange(256) for _ in range(n)] for n in (2, 26)
    ]


def generate(
    engine: LLMEngine, params: SamplingParams | None = None
) -> list[list[tuple[int, ...]]]:
    params = params or SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts()):
        engine.add_request(str(i), prompt, params)
    final = run_all(engine)
    return [[c.token_ids for c in final[str(i)].outputs] for i in range(len(prompts()))]


BASE = dict(block_size=4, max_model_len=64)


@pytest.fixture
def baseline(model_engine: Callable[..., LLMEngine]) -> list[list[tuple[int, ...]]]:
    engine = model_engine(num_blocks=256, enable_prefix_caching=False, **BASE)
    return generate(engine)


VARIANTS = {
    "prefix-cache": dict(num_blocks=256),
    "chunk-5": dict(num_blocks=256, max_num_batched_tokens=5),
    "chunk-16-no-prefix": dict(
        num_blocks=256, max_num_batched_tokens=16, enable_prefix_caching=False
    ),
    "recompute-tiny": dict(num_blocks=18, preemption_mode="recompute"),
    "swap-tiny": dict(num_blocks=18, preemption_mode="swap", num_host_blocks=64),
    "auto-tiny-chunk-7": dict(
        num_blocks=18, preemption_mode="auto", num_host_blocks=64, max_num_batched_tokens=7
    ),
    "multi-step-4": dict(num_blocks=256, num_scheduler_steps=4),
    "multi-step-8-tiny": dict(num_blocks=18, preemption_mode="recompute", num_scheduler_steps=8),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_greedy_tokens_do_not_depend_on_paging(
    name: str, baseline, model_engine: Callable[..., LLMEngine]
) -> None:
    engine = model_engine(**VARIANTS[name], **BASE)
    first = generate(engine)
    assert first == baseline
    stats = engine.get_stats()
    if "tiny" in name:
        assert stats.num_preemptions > 0
    if name.startswith("swap"):
        assert stats.num_preemptions_swap > 0
    if name in ("prefix-cache", "multi-step-4"):
        second = generate(engine)  # now served partly from the prompt cache
        assert second == baseline
        assert engine.get_stats().cache.prefix_hits_tokens > 0


def test_n4_shares_the_prompt_blocks(model_engine: Callable[..., LLMEngine]) -> None:
    prompt = prompts()[4]  # 26 tokens: 6 full blocks of 4 + 2 tokens
    params = SamplingParams(max_tokens=3, temperature=1.0, seed=0, ignore_eos=True)

    def peak(engine: LLMEngine) -> int:
        most = 0
        while engine.has_unfinished_requests():
            engine.step()
            most = max(most, engine.kv.stats().blocks_used)
        return most

    forked = model_engine(num_blocks=128, enable_prefix_caching=False, **BASE)
    forked.add_request("n4", prompt, SamplingParams(**{**_fields(params), "n": 4}))
    separate = model_engine(num_blocks=128, enable_prefix_caching=False, **BASE)
    for i in range(4):
        separate.add_request(str(i), prompt, params)
    assert peak(separate) == 4 * 7
    assert peak(forked) == 6 + 4


def test_seeded_sampling_is_reproducible(model_engine: Callable[..., LLMEngine]) -> None:
    params = SamplingParams(max_tokens=10, temperature=1.0, top_k=50, seed=42, n=2, ignore_eos=True)
    a = generate(model_engine(num_blocks=256, **BASE), params)
    b = generate(model_engine(num_blocks=18, preemption_mode="recompute", **BASE), params)
    assert a == b
    other = SamplingParams(**{**_fields(params), "seed": 43})
    assert generate(model_engine(num_blocks=256, **BASE), other) != a


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in params.__dataclass_fields__}


def test_block_moves_alone_run_no_forward(model_engine: Callable[..., LLMEngine]) -> None:
    """The engine's first half of a step: moves with nothing scheduled (see LLMEngine.step)."""
    import torch

    from pagedllm.core.outputs import ModelRunnerOutput, SchedulerOutput

    runner = model_engine(num_blocks=8, max_model_len=32).runner
    k_cache, v_cache = runner.kv_caches[0]
    k_cache[0].fill_(1.5)
    v_cache[0].fill_(-2.0)
    result = runner.execute(SchedulerOutput(block_copies=((0, 3),)))
    assert result == ModelRunnerOutput()
    assert torch.equal(k_cache[3], k_cache[0]) and torch.equal(v_cache[3], v_cache[0])
