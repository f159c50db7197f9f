"""LLMEngine on the FakeModelRunner: every paging path must give the reference tokens."""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from typing import Any

import pytest

from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.fake_runner import FakeModelRunner
from tests.engine.conftest import run_all

PROMPTS = [
    "the quick brown fox jumps",
    "the quick brown fox sleeps all day",
    "hello",
    "the quick brown",
    "a much longer prompt that spans several blocks of the cache",
]


def reference(runner: FakeModelRunner, prompt_ids: list[int], max_tokens: int, sample: int = 0):
    """What the fake model generates, computed without any cache."""
    context = list(prompt_ids)
    out = [runner.next_token(context, sample)]
    context.append(out[0])
    while len(out) < max_tokens:
        out.append(runner.next_token(context))
        context.append(out[-1])
    return out


def add_all(engine: LLMEngine, max_tokens: int = 12, n_for: tuple[str, ...] = ()) -> None:
    for i, prompt in enumerate(PROMPTS):
        n = 2 if str(i) in n_for else 1
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=max_tokens, n=n))


def check_reference(engine: LLMEngine, tokenizer: Any, final: dict, max_tokens: int) -> None:
    for i, prompt in enumerate(PROMPTS):
        output = final[str(i)]
        ids = tokenizer.encode(prompt)
        for completion in output.outputs:
            expected = reference(engine.runner, ids, max_tokens, completion.index)
            assert list(completion.token_ids) == expected, f"prompt {i} sample {completion.index}"
            assert completion.text == tokenizer.decode(expected)
            assert completion.finish_reason == "length"


CONFIGS = {
    "big-cache": dict(num_blocks=128),
    "no-prefix-cache": dict(num_blocks=128, enable_prefix_caching=False),
    "chunk-3": dict(num_blocks=128, max_num_batched_tokens=3),
    "chunk-7": dict(num_blocks=128, max_num_batched_tokens=7),
    "recompute-tiny": dict(num_blocks=20, preemption_mode="recompute"),
    "recompute-tiny-no-prefix": dict(
        num_blocks=20, preemption_mode="recompute", enable_prefix_caching=False
    ),
    "swap-tiny": dict(num_blocks=20, preemption_mode="swap", host_blocks=40),
    "auto-tiny-chunked": dict(
        num_blocks=20, preemption_mode="auto", host_blocks=40, max_num_batched_tokens=5
    ),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_tokens_match_the_cache_free_reference(
    name: str, fake_engine: Callable[..., LLMEngine], tokenizer: Any
) -> None:
    engine = fake_engine(**CONFIGS[name])
    add_all(engine, n_for=("1",))
    final = run_all(engine)
    check_reference(engine, tokenizer, final, 12)
    stats = engine.get_stats()
    if "tiny" in name:
        assert stats.num_preemptions > 0, "the tiny cache should have forced preemption"
    if name.startswith("swap"):
        assert stats.num_preemptions_swap > 0
    assert stats.num_requests_finished == len(PROMPTS)


def test_parallel_samples_hold_fewer_blocks_than_independent_requests(
    fake_engine: Callable[..., LLMEngine],
) -> None:
    def peak_blocks(engine: LLMEngine) -> int:
        peak = 0
        while engine.has_unfinished_requests():
            engine.step()
            peak = max(peak, engine.kv.stats().blocks_used)
        return peak

    prompt = "a prompt of some thirty bytes"  # 7 full blocks + 1 partial
    forked = fake_engine(num_blocks=128, enable_prefix_caching=False)
    forked.add_request("n4", prompt, SamplingParams(max_tokens=4, n=4))
    separate = fake_engine(num_blocks=128, enable_prefix_caching=False)
    for i in range(4):
        separate.add_request(str(i), prompt, SamplingParams(max_tokens=4))
    forked_peak, separate_peak = peak_blocks(forked), peak_blocks(separate)
    # 29 prompt + 3 written outputs = 32 tokens: 8 blocks per sequence alone.
    assert separate_peak == 4 * 8
    # Forked: the 7 full prompt blocks once, then one private tail block per sample.
    assert forked_peak == 7 + 4 * 1
    assert forked_peak < separate_peak


def test_stop_string_across_token_boundaries(
    fake_engine: Callable[..., LLMEngine], tokenizer: Any
) -> None:
    engine = fake_engine()
    engine.add_request("free", "stop here", SamplingParams(max_tokens=20))
    text = run_all(engine)["free"].outputs[0].text
    stop = text[6:9]  # three characters: three tokens of the byte-level tokenizer
    cut = text.index(stop)
    engine.add_request("cut", "stop here", SamplingParams(max_tokens=20, stop=[stop, "zzzz"]))
    engine.add_request(
        "kept",
        "stop here",
        SamplingParams(max_tokens=20, stop=stop, include_stop_str_in_output=True),
    )
    seen: dict[str, list[str]] = {"cut": [], "kept": []}
    final = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            seen[output.request_id].append(output.outputs[0].text)
            if output.finished:
                final[output.request_id] = output
    assert final["cut"].outputs[0].text == text[:cut]
    assert final["kept"].outputs[0].text == text[: cut + 3]
    for name in ("cut", "kept"):
        completion = final[name].outputs[0]
        assert completion.finish_reason == "stop" and completion.stop_reason == stop
        texts = seen[name]
        # Cumulative text only grows: nothing shown is ever taken back by the stop.
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))


def test_abort_frees_every_block_wherever_the_request_is(
    fake_engine: Callable[..., LLMEngine],
) -> None:
    engine = fake_engine(num_blocks=20, preemption_mode="swap", host_blocks=40)
    add_all(engine, max_tokens=20, n_for=("0",))
    swapped_seen = False
    for _ in range(12):
        engine.step()
        swapped_seen |= engine.get_stats().num_swapped > 0
    assert engine.kv.stats().blocks_used > 0
    engine.abort_request(["0", "1", "nonexistent"])
    engine.abort_request("4")
    run_all(engine)
    engine.add_request("late", "hello", SamplingParams(max_tokens=3))
    engine.abort_request("late")  # aborted while waiting
    assert not engine.has_unfinished_requests()
    assert swapped_seen
    assert engine.get_stats().num_requests_aborted == 4


def test_seeded_sampling_is_reproducible_whatever_the_batch(
    fake_engine: Callable[..., LLMEngine],
) -> None:
    params = SamplingParams(max_tokens=16, temperature=1.5, top_p=0.95, seed=1234, n=2)

    def run(extra: int, seed: int = 1234, **config: Any) -> list[tuple[int, ...]]:
        engine = fake_engine(use_sampler=True, **config)
        for i in range(extra):
            engine.add_request(f"x{i}", f"other prompt {i}", SamplingParams(max_tokens=9))
        engine.add_request("s", "sample me", SamplingParams(**{**_fields(params), "seed": seed}))
        return [c.token_ids for c in run_all(engine)["s"].outputs]

    alone = run(0)
    assert run(3) == alone
    assert run(2, num_blocks=12, preemption_mode="recompute") == alone
    assert run(0, seed=99) != alone
    assert alone[0] != alone[1]  # the two samples differ


def test_logprobs_are_returned_and_summed(fake_engine: Callable[..., LLMEngine]) -> None:
    engine = fake_engine(use_sampler=True)
    engine.add_request("lp", "logprobs", SamplingParams(max_tokens=5, temperature=0, logprobs=3))
    completion = run_all(engine)["lp"].outputs[0]
    assert len(completion.logprobs) == 5
    for token, position in zip(completion.token_ids, completion.logprobs, strict=True):
        assert len(position) == 3  # the top 3, the sampled token among them
        assert position[token].rank == 1 and position[token].logprob < 0  # greedy: the top
        assert sorted(lp.rank for lp in position.values()) == [1, 2, 3]
    assert completion.cumulative_logprob == pytest.approx(
        sum(position[t].logprob for t, position in zip(completion.token_ids, completion.logprobs))
    )


def test_add_request_rejects_bad_input(fake_engine: Callable[..., LLMEngine]) -> None:
    engine = fake_engine(num_blocks=8, max_model_len=32)
    with pytest.raises(ValueError, match=r"prompt \(5 tokens\) \+ max_tokens \(30\)"):
        engine.add_request("long", "hello", SamplingParams(max_tokens=30))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("ids", [1, 2, 10_000], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="at least one token"):
        engine.add_request("empty", [], SamplingParams(max_tokens=2))
    vocab = engine.runner.vocab_size
    with pytest.raises(ValueError, match=f"stop_token_ids holds token id {vocab}, outside"):
        engine.add_request("stop", "hi", SamplingParams(max_tokens=2, stop_token_ids=[vocab]))
    with pytest.raises(ValueError, match=f"logit_bias holds token id {vocab + 7}, outside"):
        engine.add_request("bias", "hi", SamplingParams(max_tokens=2, logit_bias={vocab + 7: 1}))
    with pytest.raises(TypeError):
        engine.add_request("params", "hello", {"max_tokens": 3})
    engine.add_request("ok", "hello", SamplingParams(max_tokens=None))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("ok", "again")
    final = run_all(engine)
    assert len(final["ok"].outputs[0].token_ids) == 32 - 5  # max_tokens filled to the limit
    assert not engine.has_unfinished_requests()


def test_stats_count_tokens_and_prefix_hits(fake_engine: Callable[..., LLMEngine]) -> None:
    engine = fake_engine()
    engine.add_request("a", "shared prefix of sixteen b", SamplingParams(max_tokens=4))
    run_all(engine)
    engine.add_request("b", "shared prefix of sixteen b", SamplingParams(max_tokens=4))
    final = run_all(engine)
    assert final["b"].num_cached_tokens == 24  # 6 full blocks of 4 (capped below 26)
    stats = engine.get_stats()
    assert stats.num_prompt_tokens == 52 and stats.num_generation_tokens == 8
    assert stats.cache.prefix_hits_tokens == 24
    assert stats.num_running == stats.num_waiting == 0


def test_reset_prefix_cache_forgets_prompts_but_not_while_requests_run(
    fake_engine: Callable[..., LLMEngine],
) -> None:
    engine = fake_engine()
    prompt = "shared prefix of sixteen b"
    engine.add_request("a", prompt, SamplingParams(max_tokens=4))
    run_all(engine)
    assert engine.kv.pool.num_cached_free_blocks > 0
    engine.add_request("b", prompt, SamplingParams(max_tokens=4))
    engine.step()
    indexed = engine.kv.pool.hashed_blocks()
    assert engine.reset_prefix_cache() is False  # "b" holds indexed blocks
    assert engine.kv.pool.hashed_blocks() == indexed
    b = run_all(engine)["b"]
    assert b.num_cached_tokens == 24
    assert engine.reset_prefix_cache() is True
    assert engine.kv.pool.hashed_blocks() == {}
    engine.add_request("c", prompt, SamplingParams(max_tokens=4))
    c = run_all(engine)["c"]
    assert c.num_cached_tokens == 0
    assert c.outputs[0].token_ids == b.outputs[0].token_ids


def _fields(params: SamplingParams) -> dict[str, Any]:
    return {name: getattr(params, name) for name in params.__dataclass_fields__}


def test_priority_orders_admission(fake_engine: Callable[..., LLMEngine]) -> None:
    engine = fake_engine(max_num_seqs=1)
    engine.add_request("low", "first come", SamplingParams(max_tokens=2), priority=5)
    engine.add_request("high", "second come", SamplingParams(max_tokens=2), priority=0)
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["high", "low"]


@pytest.mark.parametrize("seed", range(int(os.environ.get("PAGEDLLM_FUZZ_SEEDS", "12"))))
def test_random_workloads_on_tiny_caches_match_the_reference(
    seed: int, fake_engine: Callable[..., LLMEngine], tokenizer: Any
) -> None:
    """Random arrivals, lengths, n, aborts and cache shapes (PAGEDLLM_FUZZ_SEEDS=1000
    for a longer hunt): every finished completion equals the reference."""
    rng = random.Random(seed)
    block_size = rng.choice([2, 4, 8])
    engine = fake_engine(
        num_blocks=max(rng.choice([10, 16, 40]), 40 // block_size),
        block_size=block_size,
        preemption_mode=rng.choice(["recompute", "swap", "auto"]),
        host_blocks=rng.choice([0, 6, 50]),
        max_num_batched_tokens=rng.choice([3, 8, 64]),
        max_num_seqs=rng.choice([3, 5, 16]),
        enable_prefix_caching=rng.random() < 0.7,
        max_model_len=40,
    )
    stems = ["shared system words ", "other ", ""]
    expected: dict[str, tuple[list[int], int, int]] = {}
    aborted: set[str] = set()
    for step in range(2000):
        if step < 60 and rng.random() < 0.3:
            rid = f"r{step}"
            prompt = rng.choice(stems) + "".join(
                rng.choice("abcdef ") for _ in range(rng.randint(1, 9))
            )
            ids = tokenizer.encode(prompt)[:30]
            max_tokens, n = rng.randint(1, 40 - len(ids)), rng.choice([1, 1, 2, 3])
            engine.add_request(rid, ids, SamplingParams(max_tokens=max_tokens, n=n))
            expected[rid] = (ids, max_tokens, n)
        if expected and rng.random() < 0.03:
            victim = rng.choice(sorted(expected))
            engine.abort_request(victim)
            aborted.add(victim)
        for output in engine.step():
            if output.finished:
                ids, max_tokens, n = expected[output.request_id]
                assert len(output.outputs) == n
                for c in output.outputs:
                    assert list(c.token_ids) == reference(engine.runner, ids, max_tokens, c.index)
                expected.pop(output.request_id)
        engine.kv.check_invariants()
        if step >= 60 and not engine.has_unfinished_requests():
            break
    assert not engine.has_unfinished_requests()
    assert set(expected) <= aborted


def test_stats_measure_the_three_wastes(fake_engine: Callable[..., LLMEngine]) -> None:
    engine = fake_engine(enable_prefix_caching=False)
    assert engine.get_stats().waste.allocated_slots == 0
    prompt = "ten chars!"
    assert len(engine.tokenize(prompt)) == 10
    engine.add_request("shared", prompt, SamplingParams(max_tokens=4, n=2))
    engine.step()  # the parent's prompt, then a fork sharing all its blocks
    waste = engine.get_stats().waste
    # 10 tokens held by two samples in 3 shared blocks of 4: 2 empty slots
    assert waste.allocated_slots == engine.get_stats().cache.blocks_used * 4 == 12
    assert waste.internal_tokens == 2
    assert waste.duplication_tokens == 0  # sharing is not duplication
    engine.add_request("copy", prompt, SamplingParams(max_tokens=4))
    engine.step()  # the same prompt again, stored twice without prefix caching
    waste = engine.get_stats().waste
    assert waste.duplication_tokens >= 10
    assert waste.external_tokens == 0  # paged: any free block will do
    run_all(engine)
    waste = engine.get_stats().waste
    assert waste.allocated_slots == waste.internal_tokens == waste.duplication_tokens == 0


def test_finished_only_steps_return_the_same_final_outputs(fake_engine):
    """``step(finished_only=True)`` (what LLM.generate uses) builds outputs only for finished
    requests, and those equal the final outputs of plain steps."""
    plain, quiet = fake_engine(), fake_engine()
    for engine in (plain, quiet):
        engine.add_request("a", "hello there", SamplingParams(max_tokens=5, ignore_eos=True))
        engine.add_request("b", "hi", SamplingParams(max_tokens=9, ignore_eos=True, n=2))
        engine.add_request("c", "x" * 40, SamplingParams(max_tokens=3, ignore_eos=True))
    expected = run_all(plain)
    got = {}
    while quiet.has_unfinished_requests():
        for output in quiet.step(finished_only=True):
            assert output.finished and output.request_id not in got
            got[output.request_id] = output
    assert got == expected and set(got) == {"a", "b", "c"}


def test_lazy_and_plain_steps_mixed_give_the_plain_outputs(fake_engine):
    """Lazy steps leave the tokens of sequences without stop strings in the request, for
    the detokenizer to take when the text is read: a plain step after lazy ones (and every
    finished output) must show exactly what plain steps all along show."""
    plain, mixed = fake_engine(), fake_engine()
    for engine in (plain, mixed):
        engine.add_request("a", "hello there", SamplingParams(max_tokens=11, ignore_eos=True))
        engine.add_request("b", "hi", SamplingParams(max_tokens=9, ignore_eos=True, n=2))
        engine.add_request("c", "x" * 40, SamplingParams(max_tokens=7, ignore_eos=True))
        engine.add_request("d", "stop me", SamplingParams(max_tokens=12, stop=["e"]))
    step = 0
    while plain.has_unfinished_requests():
        expected = plain.step()
        lazy = step % 3 != 2
        got = mixed.step(finished_only=lazy)
        assert got == ([o for o in expected if o.finished] if lazy else expected), step
        step += 1
    assert not mixed.has_unfinished_requests()


def test_an_engine_gone_idle_hands_its_freed_memory_back(fake_engine, monkeypatch) -> None:
    """The step that finishes the last request releases the heap's freed pages (the steps'
    buffers), once; steps with work left, and idle calls, do not."""
    from pagedllm.engine import llm_engine

    releases: list[int] = []
    monkeypatch.setattr(llm_engine, "release_freed_memory", lambda: releases.append(1))
    engine = fake_engine()
    add_all(engine, max_tokens=6)
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        assert len(releases) == (0 if engine.has_unfinished_requests() else 1)
    engine.step()  # idle: nothing to release again
    assert steps > 1 and len(releases) == 1
    engine.add_request("again", "hello", SamplingParams(max_tokens=2))
    run_all(engine)
    assert len(releases) == 2
