"""The Sampler on hand-made logits: each parameter changes what it should."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from pagedllm.core.outputs import ScheduledSequence
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.sampler import (
    Sampler,
    _filter,
    filter_top_k_top_p,
    inverse_cdf,
    inverse_cdf_blocked,
)


def seq(
    request_id: str = "r",
    params: SamplingParams | None = None,
    *,
    samples: int = 1,
    prompt: tuple[int, ...] = (0,),
    output: tuple[int, ...] = (),
) -> ScheduledSequence:
    return ScheduledSequence(
        request_id=request_id,
        token_ids=(0,),
        start_position=0,
        block_table=(0,),
        num_samples=samples,
        sampling_params=params,
        prompt_token_ids=prompt,
        output_token_ids=output,
    )


def draw(logits: list[float], params: SamplingParams, **kw) -> int:
    out = Sampler()(torch.tensor([logits]), [seq(params=params, **kw)])
    return out.sampled_token_ids[0][0]


LOGITS = [1.0, 3.0, 2.0, 0.5, 2.9]


def test_greedy_and_filters_that_leave_one_token_pick_the_argmax() -> None:
    assert draw(LOGITS, SamplingParams(temperature=0)) == 1
    assert draw(LOGITS, SamplingParams(temperature=5.0, top_k=1)) == 1
    assert draw(LOGITS, SamplingParams(temperature=5.0, top_p=1e-6)) == 1
    assert draw(LOGITS, SamplingParams(temperature=5.0, min_p=0.99)) == 1


def test_top_k_and_top_p_keep_only_the_head() -> None:
    sampler = Sampler()
    logits = torch.tensor([LOGITS] * 400)
    params = SamplingParams(temperature=10.0, top_k=2)
    out = sampler(logits, [seq(str(i), params) for i in range(400)])
    assert {t[0] for t in out.sampled_token_ids} == {1, 4}
    # top_p: with probs of tokens 1, 4 about 0.36 and 0.33, 0.5 keeps exactly those two.
    params = SamplingParams(temperature=1.0, top_p=0.5)
    out = sampler(logits, [seq(str(i), params) for i in range(400)])
    assert {t[0] for t in out.sampled_token_ids} == {1, 4}


def test_sampling_follows_the_softmax() -> None:
    torch.manual_seed(0)
    logits = torch.tensor([[0.0, math.log(2.0), math.log(7.0)]])
    sampler = Sampler()
    n = 4000
    out = sampler(logits, [seq(params=SamplingParams(temperature=1.0, n=n), samples=n)])
    tokens = out.sampled_token_ids[0]
    assert len(tokens) == n
    freq = [tokens.count(i) / n for i in range(3)]
    for got, want in zip(freq, [0.1, 0.2, 0.7], strict=True):
        assert abs(got - want) < 0.03


@pytest.mark.parametrize("draw_fn", [inverse_cdf, inverse_cdf_blocked])
def test_inverse_cdf_edges_and_zero_probabilities(draw_fn) -> None:
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0], [0.0, 0.0, 0.0, 0.0, 1.0]])
    for u, want in ((0.0, [1, 4]), (0.2499, [1, 4]), (0.25, [3, 4]), (1 - 2**-24, [3, 4])):
        assert draw_fn(probs, torch.tensor([u, u])).tolist() == want
    # A token of tiny probability keeps its share (float64 sums).
    tiny = torch.full((1, 49152), 1e-9, dtype=torch.float32)
    tiny[0, 0] = 1.0
    share = 1.0 / (1.0 + 1e-9 * 49151)  # token 0 of the row
    assert draw_fn(tiny, torch.tensor([share * 0.999999])).item() == 0
    assert draw_fn(tiny, torch.tensor([min(share * 1.000001, 1 - 2**-24)])).item() > 0
    # The last nonzero token of a block, and of the vocabulary (the top of [0, 1)).
    edge = torch.zeros(2, 600)
    edge[0, 255], edge[0, 256], edge[1, 599] = 0.5, 0.5, 1.0
    assert draw_fn(edge, torch.tensor([0.4999, 1 - 2**-24])).tolist() == [255, 599]
    assert draw_fn(edge, torch.tensor([0.5, 0.0])).tolist() == [256, 599]


def test_blocked_inverse_cdf_draws_as_the_plain_one() -> None:
    gen = torch.Generator().manual_seed(3)
    for vocab, scale in ((49152, 3.0), (1000, 0.1), (300, 8.0), (7, 1.0)):
        probs = torch.softmax(torch.randn(16, vocab, generator=gen) * scale, dim=-1)
        probs[:, ::5] = 0.0  # zero-probability tokens among the others
        for _ in range(50):
            uniform = torch.rand(16, generator=gen)
            want = inverse_cdf(probs, uniform)
            assert torch.equal(inverse_cdf_blocked(probs, uniform), want)
            assert bool((probs.gather(1, want[:, None]) > 0).all())


def test_penalties() -> None:
    logits = [2.0, 1.9, 0.0]
    assert draw(logits, SamplingParams(temperature=0)) == 0
    # Token 0 appears in the output: penalised below token 1.
    assert draw(logits, SamplingParams(temperature=0, presence_penalty=0.5), output=(0,)) == 1
    assert draw(logits, SamplingParams(temperature=0, frequency_penalty=0.06), output=(0, 0)) == 1
    assert draw(logits, SamplingParams(temperature=0, frequency_penalty=0.06), output=(0,)) == 0
    # Repetition penalty also counts the prompt; it divides positive logits.
    assert draw(logits, SamplingParams(temperature=0, repetition_penalty=1.2), prompt=(0,)) == 1
    neg = [-1.0, -1.1, -5.0]
    assert draw(neg, SamplingParams(temperature=0, repetition_penalty=1.2), prompt=(0,)) == 1


def test_min_tokens_masks_eos_and_stop_tokens_then_releases_them() -> None:
    logits = [0.0, 1.0, 5.0, 4.0]
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[3]).with_eos(2)
    assert draw(logits, params, output=(1,)) == 1  # EOS (2) and stop token (3) masked
    assert draw(logits, params, output=(1, 1)) == 2  # min_tokens reached


def test_logit_bias() -> None:
    assert draw(LOGITS, SamplingParams(temperature=0, logit_bias={3: 10.0})) == 3


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=1.0, seed=7)
    alone = Sampler()(logits[1:2], [seq("s", params, samples=3)]).sampled_token_ids[0]
    other = SamplingParams(temperature=1.0)
    batch = [seq("a", other), seq("s", params, samples=3), seq("b", other)]
    mixed = Sampler()(logits, batch).sampled_token_ids[1]
    assert mixed == alone
    assert len(set(alone)) > 1  # three independent draws


def test_logprobs_top_k_and_rank() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.5]])
    params = SamplingParams(temperature=0, logprobs=2, logit_bias={2: 5.0})
    out = Sampler()(logits, [seq(params=params)])
    (lp,) = out.logprobs[0]
    raw = torch.log_softmax(logits[0], dim=-1)
    # The bias picked token 2; its logprob and rank are those of the raw model output.
    assert lp.token_id == 2 and lp.rank == 2
    assert lp.logprob == pytest.approx(float(raw[2]))
    assert lp.top_token_ids == (1, 2)
    assert lp.top_logprobs == pytest.approx([float(raw[1]), float(raw[2])])


def test_rows_without_samples_are_skipped() -> None:
    logits = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
    batch = [seq("chunk", samples=0), seq("a", SamplingParams(temperature=0)), seq("b")]
    out = Sampler()(logits, batch)
    assert out.sampled_token_ids == ((), (1,), (0,))
    assert out.logprobs == (None, None, None)


FILTER_PARAMS = [
    SamplingParams(temperature=1.0, top_k=50),
    SamplingParams(temperature=1.0, top_p=0.9),
    SamplingParams(temperature=1.0, top_p=0.3, top_k=2000),
    SamplingParams(temperature=1.0),  # filters nothing
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=1.0, top_p=0.999),
]


def assert_same_kept_tokens(
    got: torch.Tensor, want: torch.Tensor, logits: torch.Tensor, params: list[SamplingParams]
) -> None:
    """Equal masks, except a token whose mass before it (in the full sort's float32
    sums) lies within rounding of its row's top_p."""
    kept_values = torch.where(torch.isfinite(want), want, got)
    assert torch.equal(torch.where(torch.isfinite(got), got, want), kept_values)
    for row, column in (torch.isfinite(got) != torch.isfinite(want)).nonzero().tolist():
        probs = torch.softmax(logits[row], dim=-1)
        before = float(probs[probs > probs[column]].sum())
        assert before == pytest.approx(params[row].top_p, abs=1e-5)


@pytest.mark.parametrize("scale", [0.2, 3.0, 12.0])  # flat (full-sort fallback) .. peaked
def test_candidate_filter_keeps_what_the_full_sort_keeps(scale: float) -> None:
    gen = torch.Generator().manual_seed(int(scale * 10))
    logits = torch.randn(len(FILTER_PARAMS) * 2, 5000, generator=gen) * scale
    params = FILTER_PARAMS * 2
    assert_same_kept_tokens(
        filter_top_k_top_p(logits, params), _filter(logits, params), logits, params
    )
    # Each kind of row alone (no plain rows beside it), and all top_k rows together.
    only_k = [FILTER_PARAMS[0], FILTER_PARAMS[2], FILTER_PARAMS[4]]
    for batch in [[p] * 3 for p in FILTER_PARAMS] + [only_k]:
        got = filter_top_k_top_p(logits[:3], batch)
        assert_same_kept_tokens(got, _filter(logits[:3], batch), logits[:3], batch)


def test_fast_sampling_draws_the_reference_tokens() -> None:
    """Seeded requests (their own generators): the fast draw and filters pick exactly
    the tokens of the plain references, step after step, beside greedy and n > 1 rows."""
    gen = torch.Generator().manual_seed(5)
    kinds = [*FILTER_PARAMS, SamplingParams(temperature=0.7, min_p=0.05)]
    batch = [seq(f"s{i}", replace(p, seed=i)) for i, p in enumerate(kinds)]
    batch.append(seq("g", SamplingParams(temperature=0)))
    batch.append(seq("n", SamplingParams(temperature=1.3, top_p=0.8, seed=99, n=3), samples=3))
    fast, plain = Sampler(), Sampler(fast_sampling=False)
    for step in range(20):
        scale = (0.5, 2.0, 6.0)[step % 3]
        logits = torch.randn(len(batch), 49152, generator=gen) * scale
        assert fast(logits, batch) == plain(logits, batch)
