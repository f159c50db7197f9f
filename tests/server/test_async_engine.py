"""AsyncEngine on its own: the step thread, per-request streams, abort, the queue bound."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from pagedllm.engine.async_engine import AsyncEngine, EngineClosedError, QueueFullError
from pagedllm.engine.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.fake_runner import FakeModelRunner

from .conftest import LETTERS


def _engine(
    tokenizer: Any, num_scheduler_steps: int = 1, **runner_kw: Any
) -> tuple[LLMEngine, FakeModelRunner]:
    runner = FakeModelRunner(
        32, 4, vocab_size=len(tokenizer), allowed_token_ids=LETTERS, **runner_kw
    )
    config = EngineConfig(block_size=4, max_model_len=64, num_scheduler_steps=num_scheduler_steps)
    return LLMEngine(config, runner, tokenizer), runner


def _blocks_used(engine: LLMEngine) -> int:
    return engine.get_stats().cache.blocks_used


@pytest.mark.parametrize("num_scheduler_steps", [1, 4])
def test_generate_streams_cumulative_outputs(tokenizer, num_scheduler_steps):
    llm, runner = _engine(tokenizer, num_scheduler_steps)

    async def main():
        engine = AsyncEngine(llm)
        # Greedy: multi-step decoding applies only to plain-argmax requests.
        params = SamplingParams(max_tokens=6, temperature=0.0)
        outputs = [o async for o in engine.generate("r", [97, 98, 99], params)]
        await engine.shutdown()
        return outputs

    outputs = asyncio.run(main())
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    assert lengths == sorted(lengths) and lengths[-1] == 6
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    context = [97, 98, 99]
    for _ in range(6):
        context.append(runner.next_token(context))
    assert list(outputs[-1].outputs[0].token_ids) == context[3:]
    assert _blocks_used(llm) == 0
    if num_scheduler_steps > 1:  # prompt, 4 steps, 1 step: at most three outputs
        assert len(outputs) <= 3


def test_slow_steps_never_block_the_event_loop(tokenizer):
    llm, _ = _engine(tokenizer, step_delay_s=0.2)

    async def main():
        engine = AsyncEngine(llm)
        gaps: list[float] = []
        done = asyncio.Event()

        async def tick():
            last = time.monotonic()
            while not done.is_set():
                await asyncio.sleep(0.005)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        ticker = asyncio.create_task(tick())
        async for _ in engine.generate("slow", [97, 98], SamplingParams(max_tokens=4)):
            pass
        done.set()
        await ticker
        await engine.shutdown()
        return gaps

    gaps = asyncio.run(main())
    assert len(gaps) > 50  # ~0.8 s of steps
    assert max(gaps) < 0.1  # far less than one 0.2 s step


def test_abort_frees_blocks_before_the_next_step(tokenizer):
    llm, _ = _engine(tokenizer, step_delay_s=0.01)

    async def main():
        engine = AsyncEngine(llm)
        stream = await engine.add_request("a", [97] * 9, SamplingParams(max_tokens=40))
        first = await stream.__anext__()
        assert not first.finished
        assert await engine.call(_blocks_used) > 0
        stream.abort()
        # commands run in order: the abort has been applied when this one runs
        used = await engine.call(_blocks_used)
        assert engine.num_in_flight == 0 and engine.num_queued == 0
        await engine.shutdown()
        return used, [o async for o in stream]

    used, rest = asyncio.run(main())
    assert used == 0 and rest == []
    assert llm.get_stats().num_requests_aborted == 1


def test_bad_input_and_duplicates_leave_nothing_behind(tokenizer):
    llm, _ = _engine(tokenizer, step_delay_s=0.01)  # "dup" stays in flight for ~0.6 s

    async def main():
        engine = AsyncEngine(llm)
        with pytest.raises(ValueError):
            await engine.add_request("x", [9999], SamplingParams())
        stream = await engine.add_request("dup", [97], SamplingParams(max_tokens=60))
        with pytest.raises(ValueError, match="in flight"):
            await engine.add_request("dup", [98], SamplingParams())
        assert engine.num_in_flight == 1
        stream.abort()
        await engine.shutdown()
        assert engine.num_queued == 0 and engine.num_in_flight == 0

    asyncio.run(main())
    assert _blocks_used(llm) == 0


def test_queue_bound_counts_requests_without_output(tokenizer):
    llm, _ = _engine(tokenizer)
    gate = threading.Event()

    async def main():
        engine = AsyncEngine(llm, max_queued_requests=1)
        engine.start()
        held = asyncio.ensure_future(engine.call(lambda e: gate.wait(10)))
        first = asyncio.ensure_future(engine.add_request("one", [97], SamplingParams(max_tokens=2)))
        await asyncio.sleep(0.02)
        with pytest.raises(QueueFullError):
            await engine.add_request("two", [97], SamplingParams(max_tokens=2))
        gate.set()
        await held
        outputs = [o async for o in await first]
        # once the first request produced output, it no longer counts as queued
        second = await engine.add_request("two", [97], SamplingParams(max_tokens=2))
        assert [o.finished for o in outputs][-1]
        assert [o async for o in second][-1].finished
        await engine.shutdown()

    asyncio.run(main())


def test_shutdown_fails_streams_and_refuses_new_requests(tokenizer):
    llm, _ = _engine(tokenizer, step_delay_s=0.01)

    async def main():
        engine = AsyncEngine(llm)
        stream = await engine.add_request("long", [97], SamplingParams(max_tokens=60))
        await stream.__anext__()
        await engine.shutdown()
        with pytest.raises(EngineClosedError):
            async for _ in stream:
                pass
        with pytest.raises(EngineClosedError):
            await engine.add_request("late", [97], SamplingParams())
        assert not engine.is_running

    asyncio.run(main())
    assert not llm.has_unfinished_requests() and _blocks_used(llm) == 0


def test_cancelled_add_is_aborted_not_leaked(tokenizer):
    """A caller cancelled while its add waits in the command queue: either the add is
    skipped, or (when the step thread had already taken it) it is aborted at once."""
    llm, _ = _engine(tokenizer, step_delay_s=0.01)
    gate = threading.Event()

    async def main():
        engine = AsyncEngine(llm)
        engine.start()
        held = asyncio.ensure_future(engine.call(lambda e: gate.wait(10)))
        adding = asyncio.ensure_future(
            engine.add_request("gone", [97] * 8, SamplingParams(max_tokens=50))
        )
        await asyncio.sleep(0.02)
        adding.cancel()  # the client went away while its add waited behind the gate
        gate.set()
        await held
        with pytest.raises(asyncio.CancelledError):
            await adding
        stats = await engine.get_stats()
        in_flight = engine.num_in_flight
        await engine.shutdown()
        return stats, in_flight

    stats, in_flight = asyncio.run(main())
    assert in_flight == 0
    assert stats.num_unfinished_requests == 0 and stats.cache.blocks_used == 0
    assert stats.num_generation_tokens < 50
