"""The ``Speculator``'s automatic mode on the fake runner: a sequence drafts while its
drafts pay for the tokens they cost, stops when they are mostly wrong, starts again when
the proposals it did not verify turn out right; a compute-bound batch drafts nothing; the
step cost model fits the steps it is shown."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest

from pagedllm.core.request import Request
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.speculator import PRIOR_TOKEN_SHARE, SpecDecodeStats, Speculator, StepCostModel
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.worker.fake_runner import FakeModelRunner


class OracleProposer:
    """Drafts the fake runner's own next tokens, or for ids in ``wrong``, other tokens."""

    def __init__(self, runner: FakeModelRunner, wrong: set[str] = frozenset()) -> None:
        self.runner = runner
        self.wrong = set(wrong)

    def propose(self, requests: Sequence[Request], max_tokens: Sequence[int]) -> list[list[int]]:
        drafts = []
        for request, k in zip(requests, max_tokens, strict=True):
            context = list(request.all_token_ids)
            guesses = []
            for _ in range(k):
                token = self.runner.next_token(context)
                context.append(token)
                guesses.append(token + 1 if request.request_id in self.wrong else token)
            drafts.append(guesses)
        return drafts

    def request_finished(self, request: Request) -> None:
        pass


class FixedCost:
    """A cost model that says one more token costs ``share`` of the step."""

    def __init__(self, share: float) -> None:
        self.share = share

    def token_share(self, num_tokens: int) -> float:
        return self.share

    def observe(self, num_tokens: int, seconds: float) -> None:
        pass

    def fit(self) -> tuple[float, float]:
        return 0.0, 0.0


def engine_with(
    fake_engine: Callable[..., LLMEngine], share: float, wrong=(), **config: Any
) -> tuple[LLMEngine, list[list[tuple[str, int]]]]:
    """A fake-runner engine whose speculator drafts with the oracle and sees ``share``;
    and the drafts each step took, as (request id, count)."""
    engine = fake_engine(speculative_config={"num_speculative_tokens": 4}, **config)
    speculator = engine.speculator
    assert speculator is not None
    speculator.proposer = OracleProposer(engine.runner, set(wrong))
    speculator.cost = FixedCost(share)
    taken: list[list[tuple[str, int]]] = []
    propose = speculator.propose

    def recording(scheduler: Any, allowed: Any = None) -> bool:
        single = propose(scheduler, allowed)
        taken.append([(r.request_id, len(r.draft_token_ids)) for r in scheduler.running])
        return single

    speculator.propose = recording  # type: ignore[method-assign]
    return engine, taken


def run(engine: LLMEngine, ids: Sequence[str], max_tokens: int = 40) -> None:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for rid in ids:
        engine.add_request(rid, [3, 4, 5, 6], params)
    while engine.has_unfinished_requests():
        engine.step()
        engine.kv.check_invariants()


def drafts_of(taken: list[list[tuple[str, int]]], rid: str) -> list[int]:
    return [n for step in taken for r, n in step if r == rid]


def test_right_drafts_go_on_and_wrong_ones_stop(fake_engine) -> None:
    engine, taken = engine_with(fake_engine, share=0.05, wrong={"bad"})
    run(engine, ["good", "bad"])
    good, bad = drafts_of(taken, "good"), drafts_of(taken, "bad")
    assert good and all(n == 4 for n in good[:-2])  # every draft right: always 4 (capped late)
    assert bad[0] > 0 and bad[-5:] == [0] * 5  # never right: it stops drafting
    stats = engine.get_stats().speculative
    assert stats is not None and stats.num_accepted_tokens > 0
    engine.step()  # idle: the speculator forgets the finished sequences
    assert engine.speculator.num_tracked == 0


def test_a_compute_bound_batch_drafts_nothing_and_runs_multi_step(fake_engine) -> None:
    engine, taken = engine_with(fake_engine, share=1.0, num_scheduler_steps=4)
    run(engine, ["a", "b", "c"])
    assert all(n == 0 for step in taken for _, n in step)
    assert engine.get_stats().speculative.num_draft_tokens == 0
    assert engine.num_steps > len(taken)  # multi-step schedules ran several steps each


def test_drafts_keep_steps_single_so_the_next_step_can_draft(fake_engine) -> None:
    engine, taken = engine_with(fake_engine, share=0.05, num_scheduler_steps=8)
    run(engine, ["a"])
    assert engine.num_steps == len(taken)  # one model step per schedule: none multi-step


def test_proposals_not_verified_still_teach_the_rate(fake_engine) -> None:
    """A sequence whose rate sits below the share drafts nothing, but its proposals are
    judged against the tokens that come: right ones lift the rate until it drafts."""
    engine, taken = engine_with(fake_engine, share=0.6)
    speculator = engine.speculator
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    engine.add_request("a", [3, 4, 5, 6], params)
    engine.step()  # the prompt
    seq = speculator._sequence(engine.scheduler.requests["a"])
    seq.accepted, seq.trials = 0.0, 10.0  # as if its drafts had all been wrong
    while engine.has_unfinished_requests():
        engine.step()
    counts = drafts_of(taken, "a")
    assert counts[0] == 0 and max(counts) > 0


def test_cost_model_prior_then_fit() -> None:
    cost = StepCostModel()
    assert cost.fit() == (0.0, 0.0)
    for _ in range(4):
        cost.observe(1, 0.010)
    fixed, per_token = cost.fit()  # too few and too alike: the prior share
    assert per_token == pytest.approx(0.010 * PRIOR_TOKEN_SHARE)
    assert fixed + per_token == pytest.approx(0.010)
    for tokens in (1, 6, 11, 16) * 4:
        cost.observe(tokens, 0.010 + 0.0005 * tokens)
    fixed, per_token = cost.fit()
    assert per_token == pytest.approx(0.0005, rel=0.2)
    assert cost.token_share(16) == pytest.approx(per_token / (fixed + 16 * per_token))


@pytest.mark.parametrize(
    "rate,num_drafts,share,kept", [(0.9, 4, 0.3, 4), (0.5, 4, 0.3, 1), (0.2, 4, 0.3, 0)]
)
def test_a_draft_is_kept_while_its_chance_beats_its_cost(rate, num_drafts, share, kept) -> None:
    assert Speculator._worth(rate, num_drafts, share) == kept


def test_stats_mean_acceptance_length() -> None:
    stats = SpecDecodeStats("ngram", 5, True, num_verifications=4, num_draft_tokens=20)
    assert stats.mean_acceptance_length == 1.0 and stats.acceptance_rate == 0.0
    stats = SpecDecodeStats("ngram", 5, True, 4, 20, num_accepted_tokens=10)
    assert stats.mean_acceptance_length == 3.5 and stats.acceptance_rate == 0.5


def test_always_mode_drafts_whatever_the_proposer_finds(fake_engine) -> None:
    engine = fake_engine(speculative_config={"automatic": False, "num_speculative_tokens": 3})
    engine.speculator.proposer = OracleProposer(engine.runner, {"x"})
    run(engine, ["x"], max_tokens=10)
    stats = engine.get_stats().speculative
    assert stats.num_verifications >= 8 and stats.num_accepted_tokens == 0


def test_a_runner_that_cannot_verify_is_refused(tokenizer) -> None:
    from pagedllm.engine.config import EngineConfig

    class Plain(FakeModelRunner):
        supports_speculation = False

    with pytest.raises(ValueError, match="cannot verify drafts"):
        LLMEngine(
            EngineConfig(block_size=4, max_model_len=64, speculative_config={}),
            Plain(64, 4, vocab_size=len(tokenizer)),
            tokenizer,
        )
    assert SpeculativeConfig.from_value({}).method == "ngram"
