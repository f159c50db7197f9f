"""The scheduler with drafts (speculative decoding): draft slots count in the step's token
budget and blocks, so admission sees them; drafts never preempt; verified tokens are
applied one by one with their stops; rejected slots are rolled back. Driven by the fake
runner, whose tokens depend on the context it reads back through the block tables."""

from __future__ import annotations

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.outputs import ModelRunnerOutput, ScheduledSequence, SchedulerOutput
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler, SchedulerConfig
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.fake_runner import FakeModelRunner

BS = 4


def make(num_blocks: int = 16, budget: int = 16, max_model_len: int = 64, steps: int = 1):
    kv = KVCacheManager(num_blocks, BS, watermark=0.0)
    config = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        num_scheduler_steps=steps,
    )
    runner = FakeModelRunner(num_blocks, BS, vocab_size=64, allowed_token_ids=range(10, 20))
    return Scheduler(config, kv), runner


def req(request_id: str, prompt_len: int, max_tokens: int = 16, first: int = 0, eos=None):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    tokens = list(range(first, first + prompt_len))
    return Request(request_id, tokens, params, eos_token_id=eos)


def step(s: Scheduler, runner: FakeModelRunner) -> SchedulerOutput:
    output = s.schedule()
    s.update(output, runner.execute(output))
    s.kv.check_invariants()
    return output


def rows(output: SchedulerOutput) -> list[tuple[str, int, int, int]]:
    """(id, start, tokens, drafts) per scheduled sequence."""
    return [
        (s.request_id, s.start_position, len(s.token_ids), s.num_draft_tokens)
        for s in output.scheduled
    ]


def truth(runner: FakeModelRunner, request: Request, n: int) -> list[int]:
    """The next ``n`` tokens the runner generates for ``request`` (what a perfect proposer
    would draft)."""
    context = list(request.all_token_ids)
    for _ in range(n):
        context.append(runner.next_token(context))
    return context[request.num_tokens :]


def test_drafts_are_scheduled_verified_and_rolled_back() -> None:
    s, runner = make()
    s.add_request(req("A", 6))
    step(s, runner)  # the prompt; one token sampled
    a = s.requests["A"]
    right = truth(runner, a, 2)
    a.draft_token_ids = [right[0], right[1] + 1, 7, 7, 7]  # the second draft is wrong
    output = step(s, runner)
    assert rows(output) == [("A", 6, 6, 5)]
    assert output.scheduled[0].token_ids[1:] == (right[0], right[1] + 1, 7, 7, 7)
    # One draft accepted and the runner's own token after it; the rest rolled back.
    assert a.output_token_ids[1:] == right
    assert a.num_computed_tokens == 8 and a.draft_token_ids == []
    assert s.kv.block_table("A") == [0, 1]  # block 2 (positions 8 .. 11) went back
    # Without drafts the same tokens come, one step each.
    s2, runner2 = make()
    s2.add_request(req("A", 6))
    for _ in range(3):
        step(s2, runner2)
    assert s2.requests["A"].output_token_ids == a.output_token_ids


def test_admission_counts_draft_slots() -> None:
    # 4 blocks: A (6 tokens + its sample) holds 2; B's prompt of 8 needs 2 more.
    s, runner = make(num_blocks=4)
    s.add_request(req("A", 6, max_tokens=6))
    step(s, runner)
    a = s.requests["A"]
    a.draft_token_ids = truth(runner, a, 4)[:2] + [3, 3]  # positions 7 .. 10: block 2
    s.add_request(req("B", 8, max_tokens=4, first=40))
    output = step(s, runner)
    # A's drafts took block 2, so B's two blocks are not there: B waits.
    assert rows(output) == [("A", 6, 5, 4)]
    assert s.requests["B"].status is RequestStatus.WAITING
    # Two drafts accepted: block 2 keeps computed tokens and stays A's; B still waits.
    assert a.num_computed_tokens == 9 and s.kv.block_table("A") == [0, 1, 2]
    output = step(s, runner)
    assert rows(output) == [("A", 9, 1, 0)]
    # Without drafts, the same state admits B at once (A's next token fits its block 2).
    s2, runner2 = make(num_blocks=4)
    s2.add_request(req("A", 6, max_tokens=6))
    step(s2, runner2)
    s2.add_request(req("B", 8, max_tokens=4, first=40))
    assert rows(step(s2, runner2)) == [("A", 6, 1, 0), ("B", 0, 8, 0)]


def test_draft_slots_count_in_the_token_budget() -> None:
    s, runner = make(budget=8)
    s.add_request(req("A", 6))
    step(s, runner)
    s.requests["A"].draft_token_ids = [1, 2, 3, 4, 5]
    s.add_request(req("B", 5, first=40))
    # A takes 1 + 5 of the 8 tokens; B's prompt gets the other 2.
    assert rows(step(s, runner)) == [("A", 6, 6, 5), ("B", 0, 2, 0)]


def test_drafts_are_trimmed_to_the_budget_and_to_max_tokens() -> None:
    s, runner = make(budget=4)
    s.add_request(req("A", 3, max_tokens=20))
    step(s, runner)
    s.requests["A"].draft_token_ids = [1, 2, 3, 4, 5, 6]
    assert rows(step(s, runner)) == [("A", 3, 4, 3)]
    s, runner = make()
    s.add_request(req("B", 3, max_tokens=3))
    step(s, runner)
    b = s.requests["B"]
    assert s.max_drafts(b) == 1  # 2 tokens left: one draft and the token after it
    b.draft_token_ids = [1, 2, 3]
    assert rows(step(s, runner)) == [("B", 3, 2, 1)]


def test_max_model_len_bounds_the_drafts() -> None:
    s, runner = make(max_model_len=10)
    s.add_request(req("A", 6, max_tokens=4))
    step(s, runner)  # 7 tokens; the last slot a draft may take is position 8
    assert s.max_drafts(s.requests["A"]) == 2


def test_drafts_that_do_not_fit_never_preempt() -> None:
    s, runner = make(num_blocks=3)
    s.add_request(req("A", 4, max_tokens=8))
    s.add_request(req("B", 4, max_tokens=4, first=40))
    step(s, runner)  # blocks 0 and 1; each needs a new block for its next token
    a, b = s.requests["A"], s.requests["B"]
    a.draft_token_ids = [1, 2, 3, 4, 5]  # would take two blocks: there is one
    output = step(s, runner)
    # A decodes plainly, its drafts dropped (preempting B would have made their room);
    # B, the newest, is preempted only because A's one token took the last block.
    assert rows(output) == [("A", 4, 1, 0)]
    assert s.num_preemptions == {"recompute": 1, "swap": 0}
    assert a.draft_token_ids == [] and b.status is RequestStatus.WAITING
    assert s.kv.block_table("A") == [0, 2]


def test_a_stop_among_accepted_drafts_drops_the_rest() -> None:
    s, runner = make()
    s.add_request(req("A", 6))
    step(s, runner)
    a = s.requests["A"]
    right = truth(runner, a, 4)
    a.eos_token_id = right[1]
    a.sampling_params = SamplingParams(temperature=0.0, max_tokens=16)
    a.draft_token_ids = right[:3]
    step(s, runner)
    assert a.status is RequestStatus.FINISHED_STOPPED
    assert a.output_token_ids[1:] == right[:2]  # the EOS ended it; right[2] is dropped
    assert s.kv.stats().blocks_used == 0


def test_drafts_turn_a_multi_step_schedule_into_one_step() -> None:
    s, runner = make(steps=4)
    s.add_request(req("A", 6))
    step(s, runner)
    s.requests["A"].draft_token_ids = [1, 2]
    output = step(s, runner)
    assert output.num_steps == 1 and rows(output) == [("A", 6, 3, 2)]
    assert step(s, runner).num_steps == 4


def test_update_takes_a_runner_that_accepted_nothing() -> None:
    s, _ = make()
    s.add_request(req("A", 6))
    output = s.schedule()
    s.update(output, ModelRunnerOutput(((50,),), (None,)))
    a = s.requests["A"]
    a.draft_token_ids = [1, 2]
    output = s.schedule()
    assert isinstance(output.scheduled[0], ScheduledSequence)
    s.update(output, ModelRunnerOutput(((51,),), (None,)))
    assert a.output_token_ids == [50, 51] and a.num_computed_tokens == 7
    assert s.kv.block_table("A") == [0, 1]
    s.kv.check_invariants()
