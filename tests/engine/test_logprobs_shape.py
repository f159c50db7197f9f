"""vLLM's shape for logprobs on the Python API: per position a ``dict[int, Logprob]``
holding the actual token (sampled, or the prompt's) and the top-k, keyed by token id;
``prompt_logprobs`` starts with None."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest

from pagedllm import LLM, Logprob, SamplingParams
from pagedllm.core.outputs import TokenLogprob
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.outputs import position_logprobs
from tests.engine.conftest import run_all


def test_a_position_holds_the_actual_token_and_the_top_k(tokenizer: Any) -> None:
    text = tokenizer.decode
    among = position_logprobs(TokenLogprob(7, -0.5, 2, (9, 7, 4), (-0.1, -0.5, -3.0)), tokenizer)
    assert among == {
        7: Logprob(-0.5, 2, text([7])),
        9: Logprob(-0.1, 1, text([9])),
        4: Logprob(-3.0, 3, text([4])),
    }
    # Not among the top-k: an entry more, at its rank in the distribution (a tie may
    # rank it inside the top-k).
    outside = position_logprobs(TokenLogprob(5, -3.0, 3, (9, 7, 4), (-0.1, -0.5, -3.0)), None)
    assert outside == {
        5: Logprob(-3.0, 3, None),
        9: Logprob(-0.1, 1, None),
        7: Logprob(-0.5, 2, None),
        4: Logprob(-3.0, 3, None),
    }
    assert position_logprobs(TokenLogprob(5, -3.0, 40), None) == {5: Logprob(-3.0, 40, None)}


def sample_logprobs_ok(token_ids: tuple[int, ...], logprobs: Any, k: int, tokenizer: Any) -> None:
    assert isinstance(logprobs, list) and len(logprobs) == len(token_ids)
    for token_id, position in zip(token_ids, logprobs, strict=True):
        assert isinstance(position, dict) and token_id in position
        assert len(position) in (k, k + 1) if k else len(position) == 1
        ranks = sorted(lp.rank for t, lp in position.items() if t != token_id or len(position) == k)
        assert ranks == list(range(1, k + 1)) if k else position[token_id].rank >= 1
        for t, lp in position.items():
            assert isinstance(lp, Logprob) and lp.decoded_token == tokenizer.decode([t])
            assert lp.logprob <= 0.0
        by_rank = sorted(position.values(), key=lambda lp: lp.rank)
        assert [lp.logprob for lp in by_rank] == sorted(
            (lp.logprob for lp in by_rank), key=lambda x: -x
        )


@pytest.mark.parametrize("k", [0, 3])
def test_generate_gives_vllms_shape_for_every_sample(
    fake_engine: Callable[..., LLMEngine], tokenizer: Any, k: int
) -> None:
    llm = LLM.from_engine(fake_engine(use_sampler=True))
    params = SamplingParams(n=2, max_tokens=5, temperature=0.8, seed=1, logprobs=k)
    [out] = llm.generate("shape me", params, use_tqdm=False)
    assert len(out.outputs) == 2 and out.prompt_logprobs is None
    for c in out.outputs:
        sample_logprobs_ok(c.token_ids, c.logprobs, k, tokenizer)
        chosen = [position[t].logprob for t, position in zip(c.token_ids, c.logprobs, strict=True)]
        assert c.cumulative_logprob == pytest.approx(math.fsum(chosen))
    assert out.outputs[0].token_ids != out.outputs[1].token_ids


@pytest.mark.parametrize("k", [0, 2])
def test_prompt_logprobs_in_vllms_shape(
    fake_engine: Callable[..., LLMEngine], tokenizer: Any, k: int
) -> None:
    engine = fake_engine()
    llm = LLM.from_engine(engine)
    prompt = tokenizer.encode("scored prompt")
    params = SamplingParams(n=2, max_tokens=2, temperature=0, prompt_logprobs=k)
    [out] = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    logprobs = out.prompt_logprobs
    assert isinstance(logprobs, list) and len(logprobs) == len(prompt) and logprobs[0] is None
    for p, position in enumerate(logprobs[1:], 1):
        actual = position[prompt[p]]
        predicted = engine.runner.next_token(prompt[:p])
        assert actual.decoded_token == tokenizer.decode([prompt[p]])
        assert actual.rank == (1 if predicted == prompt[p] else 2)
        if k == 0:
            assert list(position) == [prompt[p]]  # only the actual token
        else:
            # The fake runner's top-k: the predicted token, then the lowest other ids.
            top = {predicted, *[t for t in range(k) if t != predicted][: k - 1]}
            assert set(position) == top | {prompt[p]}
            assert position[predicted] == Logprob(0.0, 1, tokenizer.decode([predicted]))
        assert [dict(position.items())] == [position]  # code written for vLLM works


def test_step_outputs_are_cumulative_and_earlier_ones_unchanged(
    fake_engine: Callable[..., LLMEngine],
) -> None:
    engine = fake_engine()
    engine.add_request("r", "step by step", SamplingParams(max_tokens=4, logprobs=1))
    seen = []
    while engine.has_unfinished_requests():
        seen.extend(o.outputs[0] for o in engine.step() if o.outputs)
    lengths = [len(c.logprobs) for c in seen]
    assert lengths == [len(c.token_ids) for c in seen] and lengths[-1] == 4
    assert all(seen[-1].logprobs[: len(c.logprobs)] == c.logprobs for c in seen)
    run_all(engine)
