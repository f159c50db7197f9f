"""Failure isolation: a runner error fails only the request that causes it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pagedllm.core.outputs import ModelRunnerOutput, SchedulerOutput
from pagedllm.engine.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.fake_runner import FakeModelRunner
from tests.engine.conftest import run_all

WORKLOAD = [  # (request id, prompt, n)
    ("a", "the quick brown fox jumps", 1),
    ("b", "the quick brown fox sleeps all day", 2),  # forks: copy-on-write moves
    ("c", "hello", 1),
    ("d", "a longer prompt that spans several blocks", 1),
]


def tokens_by_request(final: dict[str, Any]) -> dict[str, list[tuple[int, ...]]]:
    return {rid: [c.token_ids for c in out.outputs] for rid, out in final.items()}


def run_workload(
    engine: LLMEngine, extra: tuple[str, str] | None, params: dict[str, Any] | None = None
) -> dict[str, Any]:
    params = params or {}
    for rid, prompt, n in WORKLOAD:
        engine.add_request(rid, prompt, SamplingParams(max_tokens=10, n=n, **params))
        if extra is not None and rid == "b":  # the culprit sits mid-batch
            engine.add_request(extra[0], extra[1], SamplingParams(max_tokens=10))
    return run_all(engine)


def test_only_the_failing_request_fails_and_the_others_are_undisturbed(
    fake_engine: Callable[..., LLMEngine],
) -> None:
    undisturbed = tokens_by_request(run_workload(fake_engine(), None))
    engine = fake_engine(fail_request_ids=("bad",))
    final = run_workload(engine, ("bad", "this one fails"))
    bad = final.pop("bad")
    assert bad.finished and bad.error and "InjectedFailure" in bad.error
    assert all(c.finish_reason == "error" for c in bad.outputs)
    assert tokens_by_request(final) == undisturbed
    assert all(c.finish_reason == "length" for o in final.values() for c in o.outputs)
    stats = engine.get_stats()
    assert stats.num_requests_failed == 1 and stats.num_requests_finished == len(WORKLOAD)
    # (the autouse fixture checks that both pools end all free)


def test_a_failing_parallel_sample_fails_its_whole_group_only(
    fake_engine: Callable[..., LLMEngine],
) -> None:
    engine = fake_engine(fail_request_ids=("b#1",))  # a child, failing at its first decode
    final = run_workload(engine, None)
    assert final["b"].error and all(c.finish_reason == "error" for c in final["b"].outputs)
    for rid in ("a", "c", "d"):
        assert final[rid].error is None and final[rid].outputs[0].finish_reason == "length"


def test_seeded_survivors_draw_the_same_tokens_after_a_retry(
    fake_engine: Callable[..., LLMEngine],
) -> None:
    seeded = {"temperature": 1.3, "top_p": 0.95, "seed": 7}
    undisturbed = tokens_by_request(run_workload(fake_engine(use_sampler=True), None, seeded))
    engine = fake_engine(use_sampler=True, fail_request_ids=("bad",))
    final = run_workload(engine, ("bad", "this one fails"), seeded)
    assert final.pop("bad").error
    assert tokens_by_request(final) == undisturbed


class _Runner(FakeModelRunner):
    """Counts calls; can fail block moves, or fail *after* sampling."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls = 0
        self.fail_moves = False
        self.fail_after_sampling: set[str] = set()

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.calls += 1
        moves = scheduler_output.block_copies or scheduler_output.swap_in
        if self.fail_moves and moves:
            raise RuntimeError("copy failed")
        result = super().execute(scheduler_output)
        ids = {s.request_id for s in scheduler_output.scheduled}
        if ids & self.fail_after_sampling:
            raise RuntimeError("late failure")
        return result


def custom_engine(
    tokenizer: Any, letter_ids: list[int], engines: list[LLMEngine], **runner_kwargs: Any
) -> tuple[LLMEngine, _Runner]:
    runner = _Runner(
        64, 4, vocab_size=len(tokenizer), allowed_token_ids=letter_ids, **runner_kwargs
    )
    engine = LLMEngine(EngineConfig(block_size=4, max_model_len=128), runner, tokenizer)
    engines.append(engine)
    return engine, runner


def test_failed_block_moves_fail_every_request_of_the_step(
    tokenizer: Any, letter_ids: list[int], engines: list[LLMEngine]
) -> None:
    engine, runner = custom_engine(tokenizer, letter_ids, engines)
    for rid, prompt, n in WORKLOAD:
        engine.add_request(rid, prompt, SamplingParams(max_tokens=10, n=n))
    engine.step()  # prompts; "b" waits for the block it shares with "a" (in-flight sharing)
    engine.step()  # "b" finds it cached and forks a child sharing its partial last block
    runner.fail_moves = True
    outputs = engine.step()  # the child's copy-on-write copy fails
    assert {o.request_id for o in outputs} == {rid for rid, _, _ in WORKLOAD}
    assert all(o.finished and o.error and "copy failed" in o.error for o in outputs)
    assert not engine.has_unfinished_requests()


def test_no_retry_and_no_extra_call_without_failure(
    tokenizer: Any, letter_ids: list[int], engines: list[LLMEngine]
) -> None:
    engine, runner = custom_engine(tokenizer, letter_ids, engines)
    for rid, prompt, _ in WORKLOAD:
        engine.add_request(rid, prompt, SamplingParams(max_tokens=6))  # n=1: no moves
    run_all(engine)
    assert runner.calls == engine.get_stats().num_steps


def test_limit_failure_after_sampling_still_finishes_the_survivors(
    tokenizer: Any, letter_ids: list[int], engines: list[LLMEngine]
) -> None:
    """A failure after the draws: survivors are retried and finish normally, but a
    seeded survivor's generator has advanced, so its tokens may differ from an
    undisturbed run (the documented limit of the retry)."""
    engine, runner = custom_engine(tokenizer, letter_ids, engines, use_sampler=True)
    runner.fail_after_sampling.add("late")
    seeded = SamplingParams(max_tokens=6, temperature=1.0, seed=3)
    engine.add_request("s", "seeded survivor", seeded)
    engine.add_request("late", "fails after sampling", SamplingParams(max_tokens=6))
    final = run_all(engine)
    assert final["late"].error and "late failure" in final["late"].error
    survivor = final["s"].outputs[0]
    assert survivor.finish_reason == "length" and len(survivor.token_ids) == 6
