"""Draft verification (``worker/spec_verify.py``): greedy keeps the agreeing drafts;
sampled, every token has the model's distribution (chi-square on a tiny model); a seeded
sequence draws exactly what it draws without drafts; logprobs and penalties apply per
position."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedllm.core.outputs import ScheduledSequence
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.sampler import Sampler
from pagedllm.worker.spec_verify import accept_argmax, positions, verify

VOCAB = 50


def seq(drafts=(), params=None, rid="r", output=(7,), start=10) -> ScheduledSequence:
    params = params or SamplingParams(temperature=0.0)
    return ScheduledSequence(
        rid,
        (output[-1], *drafts),
        start,
        (0, 1, 2, 3),
        1,
        params,
        (1, 2, 3),
        list(output),
        num_draft_tokens=len(drafts),
    )


def peaked(tokens: list[int]) -> torch.Tensor:
    """One logits row per token, each certain of it."""
    logits = torch.full((len(tokens), VOCAB), -10.0)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 10.0
    return logits


def test_positions_carry_the_drafts_before_them():
    split = positions([seq((4, 5)), seq(rid="plain")])
    assert [list(s.output_token_ids) for s in split.seqs] == [[7], [7, 4], [7, 4, 5], [7]]
    assert split.spans == [(0, 3), (3, 4)]


@pytest.mark.parametrize(
    "model_tokens,expected",
    [([4, 5, 6], (4, 5, 6)), ([4, 9, 6], (4, 9)), ([8, 5, 6], (8,))],
)
def test_greedy_keeps_the_longest_agreeing_prefix_and_one_more(model_tokens, expected):
    scheduled = [seq((4, 5))]
    assert verify(Sampler(), peaked(model_tokens), scheduled).sampled_token_ids == (expected,)
    assert accept_argmax(model_tokens, scheduled).sampled_token_ids == (expected,)


def test_a_batch_mixes_speculating_and_plain_sequences():
    scheduled = [seq((4,), rid="a"), seq(rid="b"), seq((1, 2), rid="c")]
    logits = peaked([4, 3, 11, 1, 9, 12])
    out = verify(Sampler(), logits, scheduled).sampled_token_ids
    assert out == ((4, 3), (11,), (1, 9))


def test_logprobs_and_penalties_apply_per_position():
    params = SamplingParams(temperature=0.0, logprobs=2, repetition_penalty=100.0)
    logits = torch.zeros(3, VOCAB)
    logits[:, 4] = 5.0  # the model wants 4 at every position ...
    logits[:, 6] = 4.0
    # ... but once the draft 4 is accepted, the penalty on 4 makes position 1 choose 6.
    out = verify(Sampler(), logits, [seq((4, 4), params)])
    assert out.sampled_token_ids == ((4, 6),)
    first, second = out.logprobs[0]
    assert (first.token_id, first.rank, second.token_id, second.rank) == (4, 1, 6, 2)


def test_min_tokens_applies_per_position():
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3])
    params = params.with_eos(None)
    logits = peaked([3, 3, 3])
    logits[:, 5] = 9.0
    # One output token so far: position 0 (the second token) may not stop, position 1 may.
    out = verify(Sampler(), logits, [seq((5, 5), params)])
    assert out.sampled_token_ids == ((5, 3),)


def seeded_tokens_without_drafts(logits: torch.Tensor, params: SamplingParams, n: int) -> list:
    """What a seeded sequence draws step by step from the given rows (no drafts)."""
    sampler = Sampler()
    tokens, output = [], [7]
    for j in range(n):
        one = ScheduledSequence("r", (output[-1],), 10 + j, (0,), 1, params, (1,), list(output))
        token = sampler(logits[j : j + 1], [one]).sampled_token_ids[0][0]
        tokens.append(token)
        output.append(token)
    return tokens, sampler


def test_a_seeded_sequence_draws_what_it_draws_without_drafts():
    params = SamplingParams(temperature=1.0, seed=11)
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(0)) * 2
    reference, plain = seeded_tokens_without_drafts(logits, params, 8)
    sampler, made, step = Sampler(), [], 0
    while len(made) < 8:
        # Drafts: the reference's next two tokens, the second of them spoiled.
        drafts = (reference[len(made)], (reference[len(made) + 1] + 1) % VOCAB)[: 7 - len(made)]
        rows = logits[len(made) : len(made) + len(drafts) + 1]
        one = seq(drafts, params, output=(7, *made), start=10 + len(made))
        made += verify(sampler, rows, [one]).sampled_token_ids[0]
        step += 1
    assert made[:8] == reference and step < 8
    # The generator stands where eight plain draws leave it.
    probe = torch.rand(1, generator=sampler._generators["r"])
    assert probe == torch.rand(1, generator=plain._generators["r"])


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """The p-value of ``counts`` drawn from ``probs`` (bins expecting fewer than 5 merged)."""
    total = counts.sum()
    expected = probs.double() * total
    big = expected >= 5
    observed = torch.cat([counts[big].double(), counts[~big].double().sum().view(1)])
    expected = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = expected > 0
    observed, expected = observed[keep], expected[keep]
    statistic = ((observed - expected) ** 2 / expected).sum()
    dof = torch.tensor(float(len(expected) - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, statistic / 2))


@pytest.fixture(scope="module")
def tiny_runner(tmp_path_factory: pytest.TempPathFactory):
    from pagedllm.model.loader import load_model
    from pagedllm.testing import make_tiny_checkpoint
    from pagedllm.worker.model_runner import TorchModelRunner

    # Larger weights than the default: a peaked next-token distribution, so that drafts
    # are accepted often enough to test what follows them.
    path: Path = make_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny"), "llama", seed=5, initializer_range=0.3
    )
    loaded = load_model(str(path), "float32", load_tokenizer=False)
    return TorchModelRunner(loaded.model, block_size=4, num_blocks=8, optimize=False)


def test_sampled_drafts_keep_the_models_distribution(tiny_runner):
    """20,000 verifications at temperature 1 of the model's favourite as the draft (about a
    third of its mass): the first token matches the model's next-token distribution, and
    after an accepted draft so does the second (chi-square, p > 0.01, fixed seed)."""
    prompt = [3, 17, 42, 9, 100, 7]
    runner = tiny_runner
    context = ScheduledSequence("ctx", tuple(prompt), 0, (0, 1), 1, None, tuple(prompt), [])
    first = torch.softmax(runner.row_logits([context])[-1].double(), dim=-1)
    order = first.argsort(descending=True)
    draft = int(order[0])  # accepted about a third of the time: both branches are common
    with_draft = context._replace(token_ids=(*prompt, draft))
    rows = runner.row_logits([with_draft])[-2:]  # scores after the prompt, after the draft
    second = torch.softmax(rows[1].double(), dim=-1)
    n = 20_000
    params = SamplingParams(temperature=1.0)
    scheduled = [
        ScheduledSequence(
            f"s{i}", (prompt[-1], draft), 5, (0, 1), 1, params, tuple(prompt[:-1]), [prompt[-1]],
            num_draft_tokens=1,
        )
        for i in range(n)
    ]  # fmt: skip
    torch.manual_seed(1234)
    out = verify(Sampler(), rows.repeat(n, 1), scheduled).sampled_token_ids
    firsts = torch.tensor([tokens[0] for tokens in out])
    counts = torch.bincount(firsts, minlength=first.numel())
    accepted = float(counts[draft]) / n
    assert abs(accepted - float(first[draft])) < 0.02
    assert chi_square_p(counts, first) > 0.01
    seconds = torch.tensor([tokens[1] for tokens in out if len(tokens) == 2])
    assert len(seconds) == counts[draft]
    assert chi_square_p(torch.bincount(seconds, minlength=second.numel()), second) > 0.01


def test_the_chi_square_check_can_fail():
    """The same statistic rejects draws from a distribution nudged off the model's."""
    probs = torch.softmax(torch.randn(VOCAB, generator=torch.Generator().manual_seed(3)), dim=-1)
    nudged = probs.clone()
    nudged[0] += 0.02
    nudged /= nudged.sum()
    draws = torch.multinomial(
        nudged, 20_000, replacement=True, generator=torch.Generator().manual_seed(4)
    )
    assert chi_square_p(torch.bincount(draws, minlength=VOCAB), probs) < 0.01
