"""The thread governor: one thread while the cores are contended, the full count again once a
probe finds them free."""

from __future__ import annotations

import pytest

from pagedllm.worker.threads import ThreadGovernor


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def governor(calls: list[int], clock: Clock) -> ThreadGovernor:
    return ThreadGovernor(2, calls.append, window=2, min_share=0.75, probe_after_s=1.0, clock=clock)


def test_quiet_cores_keep_every_thread():
    calls: list[int] = []
    g = governor(calls, Clock())
    for _ in range(20):
        g.record(0.010, 0.019)  # 0.95 of two threads
    assert g.threads == 2 and calls == []


def test_contended_cores_drop_to_one_thread_and_probe_back():
    calls: list[int] = []
    clock = Clock()
    g = governor(calls, clock)
    g.record(0.030, 0.040)  # a busy neighbour: 0.67 of two threads
    assert calls == []  # the window is not full yet
    g.record(0.030, 0.040)
    assert g.threads == 1 and calls == [1]
    clock.now = 0.9
    for _ in range(4):  # windows at one thread before the probe is due
        g.record(0.015, 0.015)
    assert calls == [1]
    clock.now = 1.0
    g.record(0.015, 0.015)
    g.record(0.015, 0.015)  # a window ends with the probe due: try both threads
    assert g.threads == 2 and calls == [1, 2]
    for _ in range(2):  # the neighbour is gone
        g.record(0.010, 0.019)
    assert g.threads == 2 and calls == [1, 2]
    for _ in range(2):  # it is back
        g.record(0.030, 0.040)
    assert calls == [1, 2, 1]


def test_one_thread_has_nothing_to_drop():
    calls: list[int] = []
    g = ThreadGovernor(1, calls.append, window=1)
    g.record(0.030, 0.005)
    assert g.threads == 1 and calls == []


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="max_threads"):
        ThreadGovernor(0, lambda n: None)
