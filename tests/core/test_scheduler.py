"""Scheduler tests with fabricated model outputs: no model, no torch."""

from __future__ import annotations

import pytest

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.outputs import ModelRunnerOutput, SchedulerOutput, TokenLogprob
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler, SchedulerConfig, child_request_id
from pagedllm.sampling_params import SamplingParams

BS = 4


def make(
    num_blocks: int = 16,
    *,
    budget: int = 8,
    max_num_seqs: int = 4,
    max_model_len: int = 64,
    mode: str = "recompute",
    host_blocks: int = 0,
    prefix_caching: bool = True,
    chunked: bool = True,
    inflight_sharing: bool = True,
    prefill_while_decoding: int | None = None,
) -> Scheduler:
    kv = KVCacheManager(
        num_blocks,
        BS,
        enable_prefix_caching=prefix_caching,
        num_host_blocks=host_blocks,
        watermark=0.0,
    )
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        preemption_mode=mode,
        enable_chunked_prefill=chunked,
        enable_inflight_sharing=inflight_sharing,
        max_prefill_tokens_while_decoding=prefill_while_decoding,
    )
    return Scheduler(config, kv)


def req(
    request_id: str,
    prompt_len: int,
    max_tokens: int = 8,
    *,
    n: int = 1,
    priority: int = 0,
    arrival: float = 0.0,
    first: int = 0,
    eos: int | None = None,
    **params,
) -> Request:
    return Request(
        request_id,
        list(range(first, first + prompt_len)),
        SamplingParams(max_tokens=max_tokens, n=n, **params),
        eos_token_id=eos,
        arrival_time=arrival,
        priority=priority,
    )


def batch(output: SchedulerOutput) -> list[tuple[str, int, int, int]]:
    """(request id, start position, number of tokens, number of samples) per sequence."""
    return [
        (s.request_id, s.start_position, len(s.token_ids), s.num_samples) for s in output.scheduled
    ]


def run_model(output: SchedulerOutput, token: int = 1000) -> ModelRunnerOutput:
    """A fabricated model: sample j of every sequence is ``token + j``."""
    return ModelRunnerOutput(
        sampled_token_ids=tuple(
            tuple(token + j for j in range(s.num_samples)) for s in output.scheduled
        ),
        logprobs=tuple(None for _ in output.scheduled),
    )


def step(s: Scheduler, token: int = 1000) -> SchedulerOutput:
    output = s.schedule()
    s.update(output, run_model(output, token))
    s.kv.check_invariants()
    return output


def run_to_end(s: Scheduler, limit: int = 200) -> None:
    for _ in range(limit):
        if not s.has_unfinished_requests():
            return
        step(s)
    raise AssertionError("requests did not finish")


def test_exact_batches_running_first_then_chunked_admission() -> None:
    s = make(budget=8)
    s.add_request(req("A", 6))
    s.add_request(req("B", 5, first=100))
    assert batch(step(s)) == [("A", 0, 6, 1), ("B", 0, 2, 0)]
    # Decodes first, then the rest of B's prompt.
    assert batch(step(s)) == [("A", 6, 1, 1), ("B", 2, 3, 1)]
    assert batch(step(s)) == [("A", 7, 1, 1), ("B", 5, 1, 1)]
    a = s.requests["A"]
    assert a.output_token_ids == [1000, 1000, 1000]
    assert a.num_computed_tokens == 8


def test_long_prompt_is_chunked_and_never_starves_decodes() -> None:
    s = make(budget=6)
    s.add_request(req("D", 3, max_tokens=20))
    step(s)  # D's prompt
    s.add_request(req("L", 17))
    starts = []
    for _ in range(4):
        out = step(s)
        assert batch(out)[0][0] == "D" and batch(out)[0][2] == 1  # the decode always comes first
        starts.append(batch(out)[1])
    # L's prompt in chunks of the 5 tokens left after D's decode; the last one samples.
    assert starts == [("L", 0, 5, 0), ("L", 5, 5, 0), ("L", 10, 5, 0), ("L", 15, 2, 1)]


def test_prompt_slices_shrink_while_requests_decode() -> None:
    s = make(num_blocks=32, budget=12, prefill_while_decoding=3)
    s.add_request(req("A", 10))
    s.add_request(req("B", 9, first=100))
    # Nobody decodes yet: the whole budget goes to prompts.
    assert batch(step(s)) == [("A", 0, 10, 1), ("B", 0, 2, 0)]
    # A decodes: B's prompt (a running prefill) gets 3 tokens a step, not the 11 left.
    assert batch(step(s)) == [("A", 10, 1, 1), ("B", 2, 3, 0)]
    s.add_request(req("C", 5, first=200))
    assert batch(step(s)) == [("A", 11, 1, 1), ("B", 5, 3, 0)]
    # B's last prompt token is one token, scheduled as a decode; the slice covers
    # waiting requests too.
    assert batch(step(s)) == [("A", 12, 1, 1), ("B", 8, 1, 1), ("C", 0, 3, 0)]
    with pytest.raises(ValueError, match="max_prefill_tokens_while_decoding"):
        SchedulerConfig(max_prefill_tokens_while_decoding=0)


def test_prefill_without_chunking_waits_for_room_in_the_budget() -> None:
    s = make(num_blocks=32, budget=64, chunked=False)
    s.add_request(req("A", 40))
    s.add_request(req("B", 30, first=100))
    assert batch(step(s)) == [("A", 0, 40, 1)]  # B does not fit the rest of the budget
    assert batch(step(s)) == [("A", 40, 1, 1), ("B", 0, 30, 1)]


def test_max_num_seqs_limits_admission() -> None:
    s = make(budget=64, max_num_seqs=2)
    for name in "ABC":
        s.add_request(req(name, 3))
    assert [b[0] for b in batch(step(s))] == ["A", "B"]
    assert s.stats().num_waiting == 1


def test_preemption_by_recompute_takes_the_newest_and_resumes_it_first() -> None:
    s = make(num_blocks=4, budget=16)
    s.add_request(req("A", 7, max_tokens=6, arrival=1.0))
    s.add_request(req("B", 7, max_tokens=6, arrival=2.0, first=100))
    assert batch(step(s)) == [("A", 0, 7, 1), ("B", 0, 7, 1)]  # all 4 blocks used
    assert batch(step(s)) == [("A", 7, 1, 1), ("B", 7, 1, 1)]  # position 7 still fits
    s.add_request(req("C", 2, arrival=3.0, first=200))
    out = step(s)  # A needs a 3rd block: B (newest running) is preempted
    assert batch(out) == [("A", 8, 1, 1)]
    b = s.requests["B"]
    assert b.status is RequestStatus.WAITING and b.num_preemptions == 1
    assert b.num_computed_tokens == 0 and b.output_token_ids == [1000, 1000]
    assert s.stats().num_preemptions_recompute == 1
    # B returns before C (it arrived first) as soon as A finishes.
    order = []
    while s.has_unfinished_requests():
        order += [x[0] for x in batch(step(s)) if x[0] not in order]
    assert order.index("B") < order.index("C")
    assert s.kv.stats().blocks_used == 0


def test_preemption_by_swap_resumes_before_new_admissions() -> None:
    s = make(num_blocks=4, budget=16, mode="swap", host_blocks=8)
    s.add_request(req("A", 7, max_tokens=6, arrival=1.0))
    s.add_request(req("B", 7, max_tokens=6, arrival=2.0, first=100))
    step(s)
    step(s)
    out = step(s)
    assert out.swap_out and len(out.swap_out) == 2  # B's two blocks go to the host
    b = s.requests["B"]
    assert b.status is RequestStatus.SWAPPED and b.num_computed_tokens == 8
    assert s.stats().num_preemptions_swap == 1
    s.add_request(req("C", 2, arrival=3.0, first=200))
    swapped_in = False
    while s.has_unfinished_requests():
        out = step(s)
        ids = [x[0] for x in batch(out)]
        if out.swap_in:
            swapped_in = True
            assert "B" in ids
        if "C" in ids:
            assert swapped_in, "C admitted while B was still swapped out"
    assert s.kv.stats().blocks_used == 0 and s.kv.stats().host_blocks_used == 0


def test_victim_respects_priority() -> None:
    s = make(num_blocks=4, budget=16)
    s.add_request(req("low", 7, max_tokens=6, priority=5, arrival=1.0))
    s.add_request(req("high", 7, max_tokens=6, priority=0, arrival=2.0, first=100))
    step(s)
    step(s)
    step(s)  # somebody needs a 3rd block: the low-priority one goes, though it is older
    assert s.requests["low"].status is RequestStatus.WAITING
    assert s.requests["high"].status is RequestStatus.RUNNING


def test_a_request_that_can_never_fit_is_rejected_with_both_numbers() -> None:
    s = make(num_blocks=4, max_model_len=64)
    with pytest.raises(
        ValueError, match=r"60 tokens\) \+ max_tokens \(8\) = 68 .* max_model_len \(64\)"
    ):
        s.add_request(req("long", 60, max_tokens=8))
    with pytest.raises(ValueError, match=r"needs 5 KV blocks .* holds 4 blocks"):
        s.add_request(req("big", 16, max_tokens=2))
    s.add_request(req("fits", 16, max_tokens=1))  # exactly the whole cache
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(req("fits", 2))
    with pytest.raises(ValueError, match=r"n \(5\) exceeds max_num_seqs \(4\)"):
        s.add_request(req("many", 2, n=5))
    run_to_end(s)


def test_request_filling_the_whole_cache_runs_even_after_others() -> None:
    s = make(num_blocks=4, budget=16)
    s.add_request(req("A", 5, max_tokens=3))
    s.add_request(req("whole", 14, max_tokens=3, first=50))  # 16 tokens = every block
    run_to_end(s)
    assert s.kv.stats().blocks_used == 0


def test_prefix_cache_hit_skips_cached_tokens() -> None:
    s = make(budget=32)
    s.add_request(req("A", 10, max_tokens=2))
    run_to_end(s)
    s.add_request(req("B", 10, max_tokens=2))
    out = step(s)
    assert batch(out) == [("B", 8, 2, 1)]  # two full blocks (8 tokens) came from the cache
    assert out.scheduled[0].token_ids == (8, 9)
    run_to_end(s)


def test_parallel_samples_fork_after_one_prefill_and_copy_the_partial_block() -> None:
    s = make(budget=32)
    s.add_request(req("P", 6, n=3, max_tokens=3))
    out = step(s)
    assert batch(out) == [("P", 0, 6, 3)]
    child1, child2 = child_request_id("P", 1), child_request_id("P", 2)
    assert s.requests["P"].output_token_ids == [1000]
    assert s.requests[child1].output_token_ids == [1001]
    assert s.requests[child2].output_token_ids == [1002]
    tables = s.kv.live_block_tables()
    assert tables["P"] == tables[child1] == tables[child2]  # one copy of the prompt
    assert s.kv.stats().blocks_used == 2
    out = step(s)
    # Each sample writes position 6, in the shared partial block: two copy-on-writes.
    assert sorted(x[0] for x in batch(out)) == sorted(["P", child1, child2])
    assert len(out.block_copies) == 2
    assert s.kv.stats().blocks_used == 4  # 1 shared full block + 3 private partial blocks
    run_to_end(s)
    assert s.kv.stats().blocks_used == 0


def test_a_score_only_request_parks_and_its_fork_continues_it() -> None:
    s = make(budget=32)
    parent = req("B", 6, max_tokens=3, logprobs=2)
    parent.score_only = True
    s.add_request(parent)
    out = s.schedule()
    top = TokenLogprob(1000, -0.1, 1, (1000, 7), (-0.1, -2.0))
    result = ModelRunnerOutput(sampled_token_ids=((1000,),), logprobs=((top,),))
    (update,) = s.update(out, result)
    # Scored, not extended: no token, the position's logprobs; then nothing to schedule.
    assert update.new_token_ids == () and update.new_logprobs == (top,)
    assert parent.output_token_ids == [] and parent.num_computed_tokens == 6
    assert s.schedule().scheduled == ()
    child = s.fork(parent, "B2")
    child.append_output_token_ids(7)  # the client's choice, not the sampled 1000
    assert child.score_only and s.kv.live_block_tables()["B2"] == s.kv.live_block_tables()["B"]
    s.finish_requests(["B"], RequestStatus.FINISHED_STOPPED)
    assert batch(s.schedule()) == [("B2", 6, 1, 1)]


def test_stops_eos_stop_token_min_tokens_and_length() -> None:
    s = make(budget=32)
    s.add_request(req("eos", 3, eos=1000))
    s.add_request(req("stoptok", 3, stop_token_ids=[1000], first=10))
    s.add_request(req("min", 3, eos=1000, min_tokens=2, first=20))
    s.add_request(req("ignore", 3, max_tokens=4, eos=1000, ignore_eos=True, first=30))
    step(s)
    assert "eos" not in s.requests and "stoptok" not in s.requests
    step(s)
    assert "min" not in s.requests  # stopped at its 2nd token, not its 1st
    run_to_end(s)


def test_abort_frees_blocks_wherever_the_request_is() -> None:
    s = make(num_blocks=4, budget=16, mode="swap", host_blocks=8)
    s.add_request(req("A", 7, max_tokens=6))
    s.add_request(req("B", 7, max_tokens=6, arrival=1.0, first=100))
    s.add_request(req("W", 3, arrival=2.0, first=200))
    step(s)
    step(s)
    step(s)  # B swapped out, W waiting
    assert s.requests["B"].status is RequestStatus.SWAPPED
    finished = s.finish_requests(["A", "B", "W", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in finished] == ["A", "B", "W"]
    stats = s.kv.stats()
    assert stats.blocks_used == 0 and stats.host_blocks_used == 0
    assert not s.has_unfinished_requests()
    assert s.schedule().finished_request_ids == {"A", "B", "W"}


def test_fail_last_step_finishes_its_requests_with_error() -> None:
    s = make(budget=16)
    s.add_request(req("A", 4))
    s.add_request(req("B", 4))
    step(s)
    s.add_request(req("C", 4))
    s.schedule()  # the model raises: nothing is updated
    failed = s.fail_last_step()
    assert sorted(r.request_id for r in failed) == ["A", "B", "C"]
    assert all(r.status is RequestStatus.FINISHED_ERROR for r in failed)
    assert s.kv.stats().blocks_used == 0


def test_abort_between_schedule_and_update_is_ignored() -> None:
    s = make()
    s.add_request(req("A", 4))
    out = s.schedule()
    s.finish_requests(["A"], RequestStatus.FINISHED_ABORTED)
    assert s.update(out, run_model(out)) == []
    assert s.kv.stats().blocks_used == 0


@pytest.mark.parametrize("mode", ["recompute", "swap", "auto"])
def test_many_requests_on_a_tiny_cache_all_finish(mode: str) -> None:
    s = make(num_blocks=8, budget=10, max_num_seqs=6, mode=mode, host_blocks=6)
    for i in range(12):
        s.add_request(
            req(f"r{i}", 3 + i % 7, max_tokens=4 + i % 5, arrival=float(i), n=1 + (i % 3 == 0))
        )
    run_to_end(s, limit=500)
    assert s.stats().num_preemptions > 0
    stats = s.kv.stats()
    assert stats.blocks_used == 0 and stats.host_blocks_used == 0


def test_max_num_tokens_is_exactly_what_check_fits_admits() -> None:
    s = make(num_blocks=4, max_model_len=64)
    assert s.max_num_tokens() == 17  # 16 cached tokens and the last, never written
    s.check_fits(10, 7)
    with pytest.raises(ValueError, match="needs 5 KV blocks"):
        s.check_fits(10, 8)
    assert s.default_max_tokens(10) == 7
    with pytest.raises(ValueError, match="leaves no room"):
        s.default_max_tokens(17)
    roomy = make(num_blocks=64, max_model_len=64)
    assert roomy.max_num_tokens() == 64
    request = req("filled", 10, max_tokens=None)
    roomy.add_request(request)
    assert request.sampling_params.max_tokens == 54 == roomy.max_tokens(request)
