"""A seeded request's parallel sample j draws from ``seed + j``, taken from the scheduled
sequence's ``sample_index``; the request id means nothing to the sampler."""

from __future__ import annotations

import torch

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.outputs import ModelRunnerOutput, ScheduledSequence
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler, SchedulerConfig
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.sampler import Sampler

LOGITS = torch.randn(1, 1000, generator=torch.Generator().manual_seed(2))


def draws(request_id: str, seed: int, sample_index: int, num_draws: int = 8) -> list[int]:
    """``num_draws`` successive tokens of one sequence from the same logits."""
    params = SamplingParams(temperature=1.0, seed=seed)
    seq = ScheduledSequence(request_id, (0,), 0, (0,), 1, params, sample_index=sample_index)
    sampler = Sampler()
    return [sampler(LOGITS, [seq]).sampled_token_ids[0][0] for _ in range(num_draws)]


def test_sample_j_draws_from_seed_plus_j():
    assert draws("r", seed=7, sample_index=3) == draws("r", seed=10, sample_index=0)
    assert draws("r", seed=7, sample_index=1) != draws("r", seed=7, sample_index=0)


def test_the_request_id_does_not_choose_the_seed():
    assert draws("r#3", seed=7, sample_index=0) == draws("r", seed=7, sample_index=0)


def test_forked_children_are_scheduled_with_their_sample_index():
    scheduler = Scheduler(SchedulerConfig(max_model_len=64), KVCacheManager(16, 4))
    params = SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=4)
    scheduler.add_request(Request("p", [1, 2, 3], params))
    first = scheduler.schedule()
    assert [s.sample_index for s in first.scheduled] == [0]
    scheduler.update(first, ModelRunnerOutput(((5, 6, 7),), (None,)))
    second = scheduler.schedule()
    assert {s.request_id: s.sample_index for s in second.scheduled} == {
        "p": 0,
        "p#1": 1,
        "p#2": 2,
    }
