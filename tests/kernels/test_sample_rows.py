"""``sample_rows`` (the C++ draw: temperature, softmax and inverse CDF in one pass) against
the torch pipeline it replaces (softmax, then the float64 inverse CDF)."""

from __future__ import annotations

import math

import pytest
import torch

from pagedllm.core.outputs import ScheduledSequence
from pagedllm.kernels.build import load_library
from pagedllm.kernels.ops import sample_rows
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.sampler import Sampler, inverse_cdf

needs_library = pytest.mark.usefixtures("kernel_ops")


def reference_interval(logits: torch.Tensor, inverse: torch.Tensor, tokens: torch.Tensor):
    """Per row: the chosen token's [start, end) of the float64 CDF of the reference
    softmax, and its probability."""
    probs = torch.softmax(logits.double() * inverse.double()[:, None], dim=-1)
    cdf = probs.cumsum(dim=-1)
    end = cdf.gather(1, tokens[:, None])[:, 0]
    chosen = probs.gather(1, tokens[:, None])[:, 0]
    return end - chosen, end, chosen


def random_logits(rows: int, vocab: int, scale: float, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * scale
    logits[:, 3::7] = float("-inf")  # masked tokens among the others
    return logits


@needs_library
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [7, 256, 1000, 49152, 49157])
def test_each_draw_lies_in_its_tokens_share_of_the_reference_cdf(dtype, vocab) -> None:
    gen = torch.Generator().manual_seed(vocab)
    for scale, temperature in ((0.5, 1.0), (3.0, 0.7), (8.0, 1.6)):
        logits = random_logits(16, vocab, scale, seed=vocab + int(scale)).to(dtype)
        inverse = torch.full((16,), 1.0 / temperature)
        for _ in range(20):
            uniform = torch.rand(16, generator=gen)
            tokens = sample_rows(logits, inverse, uniform)
            assert tokens is not None
            start, end, chosen = reference_interval(logits.float(), inverse, tokens)
            assert bool((chosen > 0).all()), "a zero-probability token was drawn"
            target = uniform.double()
            assert bool((start <= target + 1e-6).all() and (target < end + 1e-6).all())


@needs_library
def test_it_draws_the_reference_tokens_away_from_rounding_edges() -> None:
    """Same tokens as softmax + ``inverse_cdf`` wherever the uniform number is not within
    rounding of a token's edge (none is, for these seeds)."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(32, 49152, generator=gen) * 2.0
    inverse = torch.full((32,), 1.0)
    for _ in range(30):
        uniform = torch.rand(32, generator=gen)
        want = inverse_cdf(torch.softmax(logits, dim=-1), uniform)
        assert torch.equal(sample_rows(logits, inverse, uniform), want)


@needs_library
def test_edges_zero_and_tiny_probabilities_and_the_top_of_the_range() -> None:
    neg = float("-inf")
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0], [0.0, 0.0, 0.0, 0.0, 1.0]])
    logits = probs.log()  # zero probability: -inf
    ones = torch.ones(2)
    for u, want in ((0.0, [1, 4]), (0.2499, [1, 4]), (0.2501, [3, 4]), (1 - 2**-24, [3, 4])):
        assert sample_rows(logits, ones, torch.tensor([u, u])).tolist() == want
    # A token of tiny probability keeps its share: 49151 tokens of e^-20 beside one of 1.
    tiny = torch.full((1, 49152), -20.0)
    tiny[0, 0] = 0.0
    share = 1.0 / (1.0 + math.exp(-20.0) * 49151)
    assert sample_rows(tiny, ones[:1], torch.tensor([share * 0.99999])).item() == 0
    assert sample_rows(tiny, ones[:1], torch.tensor([share * 1.00001])).item() > 0
    # The last token of a block and of the vocabulary.
    edge = torch.full((2, 600), neg)
    edge[0, 255] = edge[0, 256] = edge[1, 599] = 0.0
    assert sample_rows(edge, ones, torch.tensor([0.4999, 1 - 2**-24])).tolist() == [255, 599]
    assert sample_rows(edge, ones, torch.tensor([0.5001, 0.0])).tolist() == [256, 599]


@needs_library
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_row_without_a_finite_maximum_is_left_to_the_reference(bad: float) -> None:
    logits = torch.zeros(3, 300)
    logits[1, 17] = bad
    assert sample_rows(logits, torch.ones(3), torch.rand(3)) is None
    assert sample_rows(torch.full((1, 300), float("-inf")), torch.ones(1), torch.rand(1)) is None


@needs_library
def test_the_draw_does_not_depend_on_the_thread_count() -> None:
    logits = random_logits(16, 49152, 3.0, seed=4).to(torch.bfloat16)
    inverse, uniform = torch.full((16,), 1.25), torch.rand(16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = sample_rows(logits, inverse, uniform)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(sample_rows(logits, inverse, uniform), one)


@needs_library
def test_strided_rows_and_bad_arguments() -> None:
    logits = random_logits(4, 600, 2.0, seed=2)
    uniform = torch.rand(4)
    assert torch.equal(
        sample_rows(logits[:, :300], torch.ones(4), uniform),
        sample_rows(logits[:, :300].contiguous(), torch.ones(4), uniform),
    )
    with pytest.raises(RuntimeError, match="uniform"):
        torch.ops.pagedllm.sample_rows(logits, torch.ones(4), torch.rand(3))
    with pytest.raises(RuntimeError, match="float32 and bfloat16"):
        torch.ops.pagedllm.sample_rows(logits.half(), torch.ones(4), uniform)


def test_without_the_library_the_torch_pipeline_draws(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDLLM_NO_EXTENSION", "1")
    load_library.cache_clear()
    try:
        assert sample_rows(torch.zeros(2, 10), torch.ones(2), torch.rand(2)) is None
        batch = [plain_seq(f"r{i}", SamplingParams(temperature=0.8, seed=i)) for i in range(4)]
        logits = random_logits(4, 1000, 2.0, seed=5)
        fast = Sampler()(logits, batch)
        plain = Sampler(fast_sampling=False)(logits, batch)
        assert fast == plain
    finally:
        load_library.cache_clear()


def plain_seq(request_id: str, params: SamplingParams) -> ScheduledSequence:
    return ScheduledSequence(request_id, (0,), 0, (0,), 1, params, prompt_token_ids=(1,))


@needs_library
def test_the_sampler_draws_plain_rows_from_bf16_logits_without_a_float32_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Plain random rows (a temperature, nothing else) go to ``sample_rows`` in the
    logits' dtype, and seeded ones draw the reference's tokens."""
    logits = random_logits(6, 49152, 2.5, seed=6).to(torch.bfloat16)
    batch = [plain_seq(f"r{i}", SamplingParams(temperature=0.6 + i / 5, seed=i)) for i in range(6)]
    want = Sampler(fast_sampling=False)(logits, batch)
    sampler = Sampler()
    assert sampler.takes_model_dtype(batch)

    def no_float(self: torch.Tensor) -> torch.Tensor:
        raise AssertionError("float32 copy on the kernel's draw")

    monkeypatch.setattr(torch.Tensor, "float", no_float)
    assert sampler(logits, batch) == want


def test_rows_with_filters_penalties_or_logprobs_take_float32_logits() -> None:
    sampler = Sampler()
    for params in (
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=1.0, min_p=0.1),
        SamplingParams(temperature=1.0, logprobs=1),
        SamplingParams(temperature=1.0, presence_penalty=0.5),
        SamplingParams(temperature=1.0, logit_bias={1: 2.0}),
    ):
        batch = [plain_seq("a", SamplingParams(temperature=1.0)), plain_seq("b", params)]
        assert not sampler.takes_model_dtype(batch)
    assert not Sampler(fast_sampling=False).takes_model_dtype(
        [plain_seq("a", SamplingParams(temperature=1.0))]
    )
