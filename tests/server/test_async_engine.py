"""AsyncEngine with its engine core in a thread: streams of deltas, abort, the queue
bound, shutdown. The same messages cross the same sockets as with the core in its own
process (test_core_process.py)."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass
from typing import Any

import pytest

from pagedllm.engine.async_engine import AsyncEngine, EngineClosedError, QueueFullError
from pagedllm.engine.config import EngineConfig
from pagedllm.engine.core import EngineCore
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.messages import Call
from pagedllm.engine.reports import EngineStats
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.fake_runner import FakeModelRunner

from .conftest import LETTERS, hold_core, wait_until


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
def test_generate_streams_deltas_and_the_text_of_their_tokens(tokenizer, num_scheduler_steps):
    llm, runner = _engine(tokenizer, num_scheduler_steps)

    async def main():
        engine = AsyncEngine.in_thread(llm)
        # Greedy: multi-step windows are for plain argmax requests only.
        params = SamplingParams(max_tokens=6, temperature=0.0)
        stream = await engine.add_request("r", [97, 98, 99], params)
        deltas = [d async for d in stream]
        await engine.shutdown()
        return deltas, stream.output()

    deltas, output = asyncio.run(main())
    context = [97, 98, 99]
    for _ in range(6):
        context.append(runner.next_token(context))
    expected = context[3:]
    assert [t for d in deltas for t in d.choices[0].token_ids] == expected
    assert "".join(d.choices[0].text for d in deltas) == tokenizer.decode(expected)
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert deltas[-1].choices[0].finish_reason == "length"
    assert list(output.outputs[0].token_ids) == expected and output.finished
    assert output.outputs[0].text == tokenizer.decode(expected)
    assert _blocks_used(llm) == 0
    # The prompt's step, then multi-step windows: fewer messages than tokens.
    assert len(deltas) <= (3 if num_scheduler_steps > 1 else 6)


def test_stop_strings_cut_the_text_as_offline(tokenizer):
    llm, runner = _engine(tokenizer)
    context = [97, 98]
    for _ in range(8):
        context.append(runner.next_token(context))
    text = tokenizer.decode(context[2:])
    stop = text[3:5]
    params = SamplingParams(max_tokens=8, stop=[stop])

    async def main():
        engine = AsyncEngine.in_thread(llm)
        stream = await engine.add_request("s", [97, 98], params)
        deltas = [d async for d in stream]
        await engine.shutdown()
        return deltas

    deltas = asyncio.run(main())
    assert "".join(d.choices[0].text for d in deltas) == text[: text.index(stop)]
    assert deltas[-1].choices[0].finish_reason == "stop"
    assert deltas[-1].choices[0].stop_reason == stop


def test_stream_output_carries_vllms_logprobs_as_offline(tokenizer):
    """The server's RequestStream gives the offline engine's logprobs: vLLM's shape,
    decoded where the text is (n=2, prompt logprobs, the real sampler)."""
    from pagedllm import LLM

    params = SamplingParams(
        n=2, max_tokens=5, temperature=0.8, seed=4, logprobs=2, prompt_logprobs=1
    )

    async def main():
        engine = AsyncEngine.in_thread(_engine(tokenizer, use_sampler=True)[0])
        stream = await engine.add_request("r", [97, 98, 99, 100, 101], params)
        deltas = [d async for d in stream]
        await engine.shutdown()
        return deltas, stream.output()

    deltas, served = asyncio.run(main())
    llm = LLM.from_engine(_engine(tokenizer, use_sampler=True)[0])
    [offline] = llm.generate([[97, 98, 99, 100, 101]], params, use_tqdm=False)
    assert served.prompt_logprobs == offline.prompt_logprobs
    assert served.prompt_logprobs[0] is None and len(served.prompt_logprobs) == 5
    for c, o in zip(served.outputs, offline.outputs, strict=True):
        assert c.token_ids == o.token_ids and c.logprobs == o.logprobs
        assert c.cumulative_logprob == o.cumulative_logprob
        assert all(t in position for t, position in zip(c.token_ids, c.logprobs, strict=True))
        streamed = [p for d in deltas for x in d.choices if x.index == c.index for p in x.logprobs]
        assert streamed == c.logprobs


def test_slow_steps_never_block_the_event_loop(tokenizer):
    llm, _ = _engine(tokenizer, step_delay_s=0.2)

    async def main():
        engine = AsyncEngine.in_thread(llm)
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
        engine = AsyncEngine.in_thread(llm)
        stream = await engine.add_request("a", [97] * 9, SamplingParams(max_tokens=40))
        first = await stream.__anext__()
        assert not first.finished
        assert (await engine.get_stats()).cache.blocks_used > 0
        stream.abort()
        # messages run in order: the abort has been applied when this call runs
        stats = await engine.get_stats()
        assert engine.num_in_flight == 0 and engine.num_queued == 0
        await engine.shutdown()
        return stats, [d async for d in stream]

    stats, rest = asyncio.run(main())
    assert stats.cache.blocks_used == 0 and rest == []
    assert stats.num_requests_aborted == 1 and stats.num_unfinished_requests == 0


def test_bad_input_and_duplicates_leave_nothing_behind(tokenizer):
    llm, _ = _engine(tokenizer, step_delay_s=0.01)  # "dup" stays in flight for ~0.6 s

    async def main():
        engine = AsyncEngine.in_thread(llm)
        with pytest.raises(ValueError):
            await engine.add_request("x", [9999], SamplingParams())
        assert engine.num_in_flight == 0 and engine.num_queued == 0
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
        engine = AsyncEngine.in_thread(llm, max_queued_requests=1)
        engine.start()
        held = await hold_core(engine, llm, gate)
        first = asyncio.ensure_future(engine.add_request("one", [97], SamplingParams(max_tokens=2)))
        await wait_until(lambda: engine.num_queued == 1, what="the first request to be queued")
        with pytest.raises(QueueFullError):
            await engine.add_request("two", [97], SamplingParams(max_tokens=2))
        gate.set()
        await held
        deltas = [d async for d in await first]
        # once the first request produced output, it no longer counts as queued
        second = await engine.add_request("two", [97], SamplingParams(max_tokens=2))
        assert deltas[-1].finished
        assert [d async for d in second][-1].finished
        await engine.shutdown()

    asyncio.run(main())


@dataclass(frozen=True, slots=True)
class _Tokenize(Call[list[int]]):
    """A call the core does not declare (it was a public LLMEngine method once)."""

    prompt: list[int]


def test_calls_are_typed_and_the_core_runs_only_declared_ones(tokenizer):
    llm, _ = _engine(tokenizer)

    async def main():
        engine = AsyncEngine.in_thread(llm)
        assert await engine.num_unfinished_requests() == 0
        stats = await engine.get_stats()
        assert isinstance(stats, EngineStats) and stats.cache.blocks_total == 32
        with pytest.raises(ValueError, match="no message named '_Tokenize'"):
            await engine.call(_Tokenize([97]))
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await engine.add_request("bad", [99999], SamplingParams())
        report = await engine.cache_report()
        assert report["blocks_total"] == 32 and report["blocks_used"] == 0
        await engine.shutdown()

    asyncio.run(main())
    with pytest.raises(ValueError, match="takes no _Tokenize"):
        EngineCore(llm).handle(_Tokenize([97]))


def test_shutdown_fails_streams_and_refuses_new_requests(tokenizer):
    llm, _ = _engine(tokenizer, step_delay_s=0.01)

    async def main():
        engine = AsyncEngine.in_thread(llm)
        stream = await engine.add_request("long", [97], SamplingParams(max_tokens=60))
        await stream.__anext__()
        await engine.shutdown()
        with pytest.raises(EngineClosedError):
            async for _ in stream:
                pass
        with pytest.raises(EngineClosedError):
            await engine.add_request("late", [97], SamplingParams())
        assert not engine.is_running
        assert not engine.host.is_alive()

    asyncio.run(main())
    assert not llm.has_unfinished_requests() and _blocks_used(llm) == 0


def test_a_delta_that_cannot_be_applied_fails_its_stream_only(tokenizer, monkeypatch):
    """A stream whose delta raises on the server side (its detokenizer, say) fails; the
    reader goes on: the other stream finishes, calls are answered, and the core stops
    at once on shutdown (a dead reader left everything waiting, the core included)."""
    from pagedllm.engine.async_engine import RequestStream

    llm, runner = _engine(tokenizer, step_delay_s=0.005)
    put = RequestStream._put

    def failing_put(self: RequestStream, delta: Any) -> None:
        if self.request_id == "bad":
            raise RuntimeError("cannot apply this delta")
        put(self, delta)

    monkeypatch.setattr(RequestStream, "_put", failing_put)

    async def main() -> tuple[list, float]:
        engine = AsyncEngine.in_thread(llm)
        params = SamplingParams(max_tokens=8, temperature=0.0)
        bad = await engine.add_request("bad", [97, 98, 99], params)
        good = await engine.add_request("good", [97, 98, 100], params)
        with pytest.raises(RuntimeError, match="cannot apply"):
            async for _ in bad:
                pass
        deltas = [d async for d in good]
        assert await engine.num_unfinished_requests() == 0
        start = time.monotonic()
        await engine.shutdown()
        assert not engine.host.is_alive()
        return deltas, time.monotonic() - start

    deltas, stop_s = asyncio.run(asyncio.wait_for(main(), 60))
    assert deltas[-1].finished and deltas[-1].choices[0].finish_reason == "length"
    assert stop_s < 5
    assert not llm.has_unfinished_requests() and _blocks_used(llm) == 0


def test_cancelled_add_is_aborted_not_leaked(tokenizer):
    """A caller cancelled while its add waits behind a busy core: the add still runs
    there, and the abort sent after it removes it."""
    llm, _ = _engine(tokenizer, step_delay_s=0.01)
    gate = threading.Event()

    async def main():
        engine = AsyncEngine.in_thread(llm)
        engine.start()
        held = await hold_core(engine, llm, gate)
        adding = asyncio.ensure_future(
            engine.add_request("gone", [97] * 8, SamplingParams(max_tokens=50))
        )
        await wait_until(lambda: engine.num_in_flight == 1, what="the add to be sent")
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
