"""Fast paths against the plain constructions they replace (issue 6)."""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm.core.outputs import ScheduledSequence
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.input_batch import build_input_batch, build_input_batch_reference
from pagedllm.worker.sampler import Sampler


def random_batch(rng: random.Random, block_size: int) -> list[ScheduledSequence]:
    batch = []
    next_block = 0
    for i in range(rng.randint(1, 9)):
        start = rng.choice([0, rng.randint(0, 40)])
        num_new = rng.choice([1, rng.randint(1, 30)])
        num_table = -(-(start + num_new) // block_size) + rng.randint(0, 2)
        table = tuple(range(next_block, next_block + num_table))
        next_block += num_table
        tokens = tuple(rng.randint(0, 999) for _ in range(num_new))
        batch.append(ScheduledSequence(f"r{i}", tokens, start, table, rng.randint(0, 2)))
    if all(seq.num_samples == 0 for seq in batch) and rng.random() < 0.5:
        batch[-1] = ScheduledSequence("last", (1,), 0, (0,), 1)
    return batch


@pytest.mark.parametrize("seed", range(40))
def test_vectorised_input_batch_equals_the_plain_construction(seed: int) -> None:
    rng = random.Random(seed)
    block_size = rng.choice([1, 4, 16])
    batch = random_batch(rng, block_size)
    fast = build_input_batch(batch, block_size)
    plain = build_input_batch_reference(batch, block_size)
    for name in ("input_ids", "positions", "logits_indices"):
        a, b = getattr(fast, name), getattr(plain, name)
        assert a.dtype == b.dtype, name
        assert torch.equal(a, b), name
    for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
        a, b = getattr(fast.meta, name), getattr(plain.meta, name)
        assert a.dtype == b.dtype, name
        assert torch.equal(a, b), name
    for name in ("query_lens_list", "seq_lens_list", "max_query_len", "max_seq_len"):
        assert getattr(fast.meta, name) == getattr(plain.meta, name), name


@pytest.mark.parametrize("seed", range(10))
def test_vectorised_input_batch_equals_the_plain_construction_in_plain_decode(seed: int) -> None:
    rng = random.Random(seed)
    block_size = rng.choice([1, 4, 16])
    # Even seeds: every sequence samples (the decode steps' all-rows shortcut); odd: some
    # one-token chunks that do not (budget-cut prompt chunks).
    batch = [
        ScheduledSequence(
            seq.request_id,
            seq.token_ids[:1],
            seq.start_position,
            seq.block_table,
            1 if seed % 2 == 0 else rng.randint(0, 2),
        )
        for seq in random_batch(rng, block_size)
    ]
    fast = build_input_batch(batch, block_size)
    plain = build_input_batch_reference(batch, block_size)
    for name in ("input_ids", "positions", "logits_indices"):
        a, b = getattr(fast, name), getattr(plain, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
        a, b = getattr(fast.meta, name), getattr(plain.meta, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert fast.meta.seq_lens_list == plain.meta.seq_lens_list


def test_vectorised_input_batch_refuses_what_the_plain_one_refuses() -> None:
    too_short = [ScheduledSequence("a", (1, 2, 3), 2, (0,))]
    with pytest.raises(ValueError, match="cannot hold"):
        build_input_batch(too_short, block_size=4)
    outside = [ScheduledSequence("a", (1,), 0, (7,))]
    with pytest.raises(ValueError, match="num_blocks"):
        build_input_batch(outside, block_size=4, num_blocks=7)


def sampled(params: SamplingParams | None, samples: int, output=()) -> ScheduledSequence:
    return ScheduledSequence(
        "r", (0,), 0, (0,), samples, params, prompt_token_ids=(1, 2), output_token_ids=output
    )


GREEDY = SamplingParams(temperature=0.0)


@pytest.mark.parametrize(
    "batch",
    [
        [sampled(GREEDY, 1), sampled(None, 1), sampled(GREEDY, 0), sampled(GREEDY, 3)],
        [sampled(GREEDY, 0)],
        [sampled(SamplingParams(temperature=0.0, logprobs=2), 1), sampled(GREEDY, 1)],
        [sampled(SamplingParams(temperature=0.0, repetition_penalty=1.5), 1)],
        [sampled(SamplingParams(temperature=0.0, logit_bias={3: 50.0}), 2)],
        [sampled(SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[5]), 1)],
    ],
)
def test_greedy_fast_path_equals_the_general_sampler(batch: list[ScheduledSequence]) -> None:
    torch.manual_seed(0)
    rows = sum(1 for seq in batch if seq.num_samples)
    logits = torch.randn(rows, 11)
    if rows:
        logits[:, 5] = 10.0  # the argmax, unless min_tokens masks it or a bias wins
    fast = Sampler()(logits, batch)
    plain = Sampler(fast_greedy=False)(logits, batch)
    assert fast == plain


def test_greedy_fast_path_is_taken_only_for_plain_greedy_rows() -> None:
    logits = torch.zeros(1, 4)
    logits[0, 1] = 1.0
    with_logprobs = Sampler()(logits, [sampled(SamplingParams(temperature=0.0, logprobs=0), 1)])
    assert with_logprobs.logprobs[0] is not None
    plain = Sampler()(logits, [sampled(GREEDY, 2)])
    assert plain.sampled_token_ids == ((1, 1),)
    assert plain.logprobs == (None,)


def test_fast_path_check_looks_at_every_sequence_sharing_params() -> None:
    sampler = Sampler()
    hot = SamplingParams(temperature=1.0)
    # A mid-prompt chunk needs no sampling, whatever its params; a later row with them does.
    assert not sampler.uses_fast_path([sampled(hot, 0), sampled(hot, 1)])
    early = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[5])
    assert not sampler.uses_fast_path([sampled(early, 1, (1, 2, 3)), sampled(early, 1)])
    assert sampler.uses_fast_path([sampled(early, 1, (1, 2, 3)), sampled(early, 1, (4, 5))])
    assert sampler.uses_fast_path([sampled(GREEDY, 1), sampled(None, 1), sampled(GREEDY, 2)])
    assert not sampler.uses_fast_path([sampled(GREEDY, 1), sampled(hot, 1)])


def test_fast_argmax_matches_torch_including_ties_and_nan() -> None:
    from pagedllm.worker.sampler import _argmax_rows

    torch.manual_seed(1)
    logits = torch.randn(6, 300)
    logits[1, 7] = logits[1, 200] = 100.0  # a tie: the first index wins
    logits[2, :] = 0.0
    logits[3, 50] = float("nan")
    logits[4, 9] = float("inf")
    assert _argmax_rows(logits) == logits.argmax(dim=-1).tolist()
    assert _argmax_rows(logits[:, ::2]) == logits[:, ::2].argmax(dim=-1).tolist()


def test_engine_auto_backend_is_the_fast_one_and_reference_stays_available() -> None:
    from pagedllm.attention.select import get_backend
    from pagedllm.engine.builder import attention_backend
    from pagedllm.engine.config import EngineConfig

    auto = attention_backend(EngineConfig(model="m"))
    assert auto.name == get_backend("auto").name == "cpu"
    assert attention_backend(EngineConfig(model="m", attention_backend="reference")).name == (
        "reference"
    )
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(model="m", attention_backend="fast")
    with pytest.raises(ValueError, match="num_threads"):
        EngineConfig(model="m", num_threads=0)
