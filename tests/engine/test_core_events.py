"""The engine core's cache-event push: what it sends a watcher, and when."""

from __future__ import annotations

from pagedllm.core.cache_events import REMOVED, STORED
from pagedllm.engine.core import EngineCore
from pagedllm.sampling_params import SamplingParams


def _finish(core: EngineCore, **step_kw) -> None:
    while core.has_unfinished_requests():
        core.step(**step_kw)


def test_nothing_is_pushed_until_watched_then_batches_are_contiguous(fake_engine):
    engine = fake_engine(num_blocks=16, block_size=4)
    core = EngineCore(engine)
    params = SamplingParams(max_tokens=2)
    engine.add_request("a", list(range(97, 106)), params)  # 9 tokens: 2 full blocks
    _finish(core)
    assert engine.kv.events.next_seq == 2 and core.pending_events() is None
    assert core.watch_events() == 2
    assert core.pending_events() is None  # nothing new since the watch began
    engine.add_request("b", list(range(100, 109)), params)
    _finish(core)
    batch = core.pending_events()
    assert batch is not None
    assert (batch["first_seq"], batch["next_seq"]) == (2, engine.kv.events.next_seq)
    assert [kind for kind, _ in batch["events"]] == [STORED, STORED]
    assert batch["epoch"] == engine.kv.events.epoch
    assert core.pending_events() == batch  # not pushed yet: the same batch again
    core.events_pushed(batch)
    assert core.pending_events() is None
    assert core.watch_events() == batch["next_seq"]  # a second watcher: no reset


def test_the_schedules_evictions_are_pushed_before_the_model_runs(fake_engine):
    """A step whose allocation evicts cached blocks: the hook between schedule and model
    sees the REMOVED events while the runner has not run the step yet."""
    engine = fake_engine(num_blocks=6, block_size=4)
    core = EngineCore(engine)
    engine.add_request("a", list(range(97, 106)), SamplingParams(max_tokens=1))
    _finish(core)  # a's two full blocks stay cached-free
    core.watch_events()
    engine.add_request("b", list(range(110, 130)), SamplingParams(max_tokens=1))  # 5 blocks
    seen = []

    def on_scheduled() -> None:
        seen.append((engine.runner.num_steps, core.pending_events()))

    steps_before = engine.runner.num_steps
    core.step(on_scheduled=on_scheduled)
    (steps_then, batch), *_ = seen
    assert steps_then == steps_before  # the model has not run this step yet
    assert batch is not None and [kind for kind, _ in batch["events"]][:1] == [REMOVED]
    _finish(core)
