"""Thread count from the CPU the steps actually get: steady beside busy neighbours.

torch's intra-op threads meet at a barrier after every op. On a quiet machine all of them
run and the step is fastest with one thread per core. When another process keeps a core busy,
the scheduler deschedules one of our threads for whole time slices while the others wait at
the barrier, and the step slows far more than the core it lost. The governor measures, over a
window of steps, the CPU time the process got per wall second per thread (``share``): near 1
when every thread runs, well below when the cores are contended. Below ``min_share`` it drops
to one thread (which a single busy neighbour leaves a core of its own); once ``probe_after_s``
seconds have passed at one thread it tries the full count again for one window and keeps it if
the share has recovered. The measurements behind the thresholds: docs/performance.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol


class ThreadControl(Protocol):
    """Sets the intra-op thread count (``torch.set_num_threads``)."""

    def __call__(self, num_threads: int) -> None: ...


@dataclass(slots=True)
class ThreadGovernor:
    """Call ``step_started`` and ``step_finished`` around every model step."""

    max_threads: int
    set_threads: ThreadControl
    window: int = 4  # steps per decision
    min_share: float = 0.75  # CPU seconds per wall second per thread, below: contended
    probe_after_s: float = 2.0  # wall seconds at one thread before trying max_threads again
    clock: Callable[[], float] = time.perf_counter
    threads: int = field(init=False)
    _wall: float = field(default=0.0, init=False)
    _cpu: float = field(default=0.0, init=False)
    _steps: int = field(default=0, init=False)
    _low_since: float = field(default=0.0, init=False)
    _started: tuple[float, float] = field(default=(0.0, 0.0), init=False)

    def __post_init__(self) -> None:
        if self.max_threads < 1 or self.window < 1 or self.probe_after_s < 0:
            raise ValueError("max_threads and window must be >= 1, probe_after_s >= 0")
        self.threads = self.max_threads

    def step_started(self) -> None:
        self._started = (time.perf_counter(), time.process_time())

    def step_finished(self) -> None:
        wall0, cpu0 = self._started
        self.record(time.perf_counter() - wall0, time.process_time() - cpu0)

    def record(self, wall_s: float, cpu_s: float) -> None:
        """One step's wall and process CPU seconds; decides at the end of a window."""
        self._wall += wall_s
        self._cpu += cpu_s
        self._steps += 1
        if self._steps < self.window:
            return
        share = self._cpu / (self._wall * self.threads) if self._wall > 0 else 1.0
        self._wall = self._cpu = 0.0
        self._steps = 0
        self._decide(share)

    def _decide(self, share: float) -> None:
        if self.threads == self.max_threads:
            if share < self.min_share and self.max_threads > 1:
                self._use(1)
            return
        # At one thread its share says nothing about the other cores: probe now and then
        # (idle time counts: after a quiet pause the first window tries every thread).
        if self.clock() - self._low_since >= self.probe_after_s:
            self._use(self.max_threads)

    def _use(self, threads: int) -> None:
        self._low_since = self.clock()
        if threads != self.threads:
            self.threads = threads
            self.set_threads(threads)
