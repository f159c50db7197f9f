"""`pagedllm plan --simulate`: replay a trace through the real scheduler and block manager.

No model runs: each step's results are fabricated (one token per sampled sequence) and
its duration comes from a simple cost model, ``step_ms + token_ms x batched tokens``.
Requests arrive as a Poisson process. What comes out is measured, not derived: the
admitted concurrency over time, the queueing delay (arrival -> first scheduled),
preemptions by mode, and the three wastes of the paged cache.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from pagedllm.core.accounting import waste
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.outputs import ModelRunnerOutput, SchedulerOutput
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler, SchedulerConfig
from pagedllm.planner.workloads import TraceEntry
from pagedllm.sampling_params import SamplingParams

SAMPLED_TOKEN = 7  # any id: there is no EOS to hit, max_tokens ends each request
MAX_TIMELINE_POINTS = 400
MAX_WASTE_SAMPLES = 100  # the wastes are measured on 100..200 steps of a run


@dataclass(frozen=True, slots=True)
class CostModel:
    """Seconds a step takes: ``(step_ms + token_ms x batched tokens) / 1000``."""

    step_ms: float = 10.0
    token_ms: float = 0.05

    def step_seconds(self, num_batched_tokens: int) -> float:
        return (self.step_ms + self.token_ms * num_batched_tokens) / 1000


@dataclass(frozen=True, slots=True)
class SimulationConfig:
    num_blocks: int
    block_size: int
    max_model_len: int
    arrival_rate: float = 4.0  # requests per second
    cost: CostModel = field(default_factory=CostModel)
    preemption_mode: str = "recompute"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    num_host_blocks: int = 0  # swap tier; swap mode needs some
    enable_prefix_caching: bool = True
    seed: int = 0
    max_steps: int = 1_000_000


@dataclass(frozen=True, slots=True)
class TimelinePoint:
    """The state after one step. The wastes (``core.accounting.waste``, in token slots)
    are measured on a sample of steps (``None`` elsewhere): measuring costs more than
    a step."""

    time: float
    num_running: int
    num_waiting: int
    num_swapped: int
    kv_usage: float
    preempted: bool
    free_while_waiting_tokens: int
    internal_waste_tokens: int | None = None
    external_waste_tokens: int | None = None
    duplicated_tokens: int | None = None
    shared_saved_tokens: int | None = None


@dataclass(slots=True)
class _Sample:
    """Running sums for one request."""

    arrival: float
    admitted: float | None = None
    finished: float | None = None


@dataclass(frozen=True, slots=True)
class SimulationResult:
    num_requests: int
    arrival_rate: float
    preemption_mode: str
    duration_s: float
    num_steps: int
    peak_running: int
    mean_running: float
    mean_running_saturated: float | None  # while some request waited (None: none did)
    queue_delay_mean_s: float
    queue_delay_p50_s: float
    queue_delay_p99_s: float
    num_preemptions: int
    preemptions_by_mode: dict[str, int]
    mean_internal_waste_tokens: float
    mean_external_waste_tokens: float
    mean_free_while_waiting_tokens: float
    mean_duplicated_tokens: float
    mean_shared_saved_tokens: float
    mean_used_tokens: float
    timeline: list[dict[str, Any]]


def simulate(entries: Sequence[TraceEntry], config: SimulationConfig) -> SimulationResult:
    """Replay ``entries`` (in order, Poisson arrivals) until every request has finished."""
    if config.arrival_rate <= 0:
        raise ValueError(f"--arrival-rate must be positive, got {config.arrival_rate}")
    if not entries:
        raise ValueError("nothing to simulate: the trace is empty")
    kv = KVCacheManager(
        config.num_blocks,
        config.block_size,
        enable_prefix_caching=config.enable_prefix_caching,
        num_host_blocks=config.num_host_blocks,
    )
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            preemption_mode=config.preemption_mode,
        ),
        kv,
    )
    arrivals = _arrivals(len(entries), config.arrival_rate, config.seed)
    requests = [
        _request(i, e, t, config.seed)
        for i, (e, t) in enumerate(zip(entries, arrivals, strict=True))
    ]
    return _Replay(scheduler, kv, requests, config).run()


def _arrivals(n: int, rate: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    t, times = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        times.append(t)
    return times


def _request(index: int, entry: TraceEntry, arrival: float, seed: int) -> Request:
    # Token ids only matter to the prefix cache: a group's prompt is the same ids for
    # every member, the rest is private to the request.
    prefix: list[int] = []
    if entry.prefix_id is not None and entry.prefix_tokens:
        group = random.Random(f"{seed}/prefix/{entry.prefix_id}")
        prefix = [group.randrange(1000, 50000) for _ in range(entry.prefix_tokens)]
    own = random.Random(f"{seed}/request/{index}")
    rest = [own.randrange(1000, 50000) for _ in range(entry.prompt_tokens - len(prefix))]
    params = SamplingParams(max_tokens=max(1, entry.output_tokens), ignore_eos=True)
    return Request(f"r{index}", prefix + rest, sampling_params=params, arrival_time=arrival)


class _Replay:
    """One simulation run (internal, mutable)."""

    def __init__(
        self,
        scheduler: Scheduler,
        kv: KVCacheManager,
        requests: list[Request],
        config: SimulationConfig,
    ) -> None:
        self.scheduler, self.kv, self.config = scheduler, kv, config
        self.pending = list(requests)
        self.samples = {r.request_id: _Sample(r.arrival_time) for r in requests}
        self.points: list[TimelinePoint] = []
        self.waste_stride = 1  # measure the wastes every this many steps
        self._num_measured = 0
        self.clock = 0.0
        self.steps = 0
        self.running_time = 0.0  # integral of num_running over time
        self.saturated_time = 0.0  # time during which requests waited
        self.saturated_running_time = 0.0  # integral of num_running over that time

    def run(self) -> SimulationResult:
        while self.pending or self.scheduler.has_unfinished_requests():
            self._admit_arrivals()
            if not self.scheduler.has_unfinished_requests():
                self.clock = self.pending[0].arrival_time
                continue
            self._step()
            if self.steps >= self.config.max_steps:
                raise ValueError(f"simulation did not finish in {self.config.max_steps} steps")
        return self._result()

    def _admit_arrivals(self) -> None:
        while self.pending and self.pending[0].arrival_time <= self.clock:
            self.scheduler.add_request(self.pending.pop(0))

    def _step(self) -> None:
        before = self.scheduler.stats().num_preemptions
        waiting_before = len(self.scheduler.waiting)
        output = self.scheduler.schedule()
        for seq in output.scheduled:
            sample = self.samples[seq.request_id]
            if sample.admitted is None:
                sample.admitted = self.clock
        if output.is_empty:
            # Nothing can run until something arrives (cannot happen with a running batch).
            self.clock = self.pending[0].arrival_time if self.pending else self.clock + 1e-3
            return
        dt = self.config.cost.step_seconds(output.num_batched_tokens)
        self.running_time += len(self.scheduler.running) * dt
        if self.scheduler.waiting:
            self.saturated_time += dt
            self.saturated_running_time += len(self.scheduler.running) * dt
        self.clock += dt
        self.steps += 1
        for update in self.scheduler.update(output, _fabricate(output)):
            if update.request.is_finished:
                self.samples[update.request.request_id].finished = self.clock
        preempted = self.scheduler.stats().num_preemptions > before
        stalled = waiting_before > 0 and len(self.scheduler.waiting) >= waiting_before
        self.points.append(self._point(preempted, stalled))

    def _point(self, preempted: bool, stalled: bool) -> TimelinePoint:
        stats = self.scheduler.stats()
        point = TimelinePoint(
            time=self.clock,
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            num_swapped=stats.num_swapped,
            kv_usage=self.kv.usage,
            preempted=preempted,
            free_while_waiting_tokens=self._free_while_waiting(stalled),
        )
        if self.steps % self.waste_stride:
            return point
        self._num_measured += 1
        if self._num_measured > 2 * MAX_WASTE_SAMPLES:  # measure half as often from now on
            self.waste_stride *= 2
            self._num_measured //= 2
        return replace(point, **self._wastes())

    def _wastes(self) -> dict[str, int]:
        """The three wastes now (core.accounting), and the prompt tokens sharing saved."""
        requests = self.scheduler.requests
        tables = self.kv.live_block_tables()
        token_ids = {rid: requests[rid].all_token_ids for rid in tables}
        head = min(self.scheduler.waiting, key=lambda r: r.arrival_time, default=None)
        next_len = (
            None if head is None else head.num_prompt_tokens + self.scheduler.max_tokens(head)
        )
        report = waste(self.kv, token_ids, next_len)
        logical = sum(self.kv.num_slots(rid) for rid in tables)
        return {
            "internal_waste_tokens": report.internal_tokens,
            "external_waste_tokens": report.external_tokens,
            "duplicated_tokens": report.duplication_tokens or 0,
            "shared_saved_tokens": logical - report.filled_slots,
        }

    def _free_while_waiting(self, stalled: bool) -> int:
        """Free slots while the queue's head, small enough for them, still waited: held
        back by the step's token budget, ``max_num_seqs`` or the admission watermark."""
        if not stalled or not self.scheduler.waiting:
            return 0
        head = min(self.scheduler.waiting, key=lambda r: r.arrival_time)
        free_tokens = self.kv.num_free_blocks * self.config.block_size
        return free_tokens if head.num_tokens <= free_tokens else 0

    def _result(self) -> SimulationResult:
        samples = list(self.samples.values())
        delays = sorted((s.admitted or 0.0) - s.arrival for s in samples)
        points = self.points or [TimelinePoint(0.0, 0, 0, 0, 0.0, False, 0)]
        measured = [p for p in points if p.internal_waste_tokens is not None] or points
        counts = self.scheduler.num_preemptions
        bs = self.config.block_size
        return SimulationResult(
            num_requests=len(samples),
            arrival_rate=self.config.arrival_rate,
            preemption_mode=self.config.preemption_mode,
            duration_s=self.clock,
            num_steps=self.steps,
            peak_running=max(p.num_running for p in points),
            mean_running=self.running_time / self.clock if self.clock else 0.0,
            mean_running_saturated=(
                self.saturated_running_time / self.saturated_time if self.saturated_time else None
            ),
            queue_delay_mean_s=sum(delays) / len(delays),
            queue_delay_p50_s=_pct(delays, 0.5),
            queue_delay_p99_s=_pct(delays, 0.99),
            num_preemptions=sum(counts.values()),
            preemptions_by_mode=dict(counts),
            mean_internal_waste_tokens=_mean([p.internal_waste_tokens or 0 for p in measured]),
            mean_external_waste_tokens=_mean([p.external_waste_tokens or 0 for p in measured]),
            mean_free_while_waiting_tokens=_mean([p.free_while_waiting_tokens for p in points]),
            mean_duplicated_tokens=_mean([p.duplicated_tokens or 0 for p in measured]),
            mean_shared_saved_tokens=_mean([p.shared_saved_tokens or 0 for p in measured]),
            mean_used_tokens=_mean([p.kv_usage * self.config.num_blocks * bs for p in measured]),
            timeline=[asdict(p) for p in _thin(points)],
        )


def _fabricate(output: SchedulerOutput) -> ModelRunnerOutput:
    return ModelRunnerOutput(
        sampled_token_ids=tuple((SAMPLED_TOKEN,) * s.num_samples for s in output.scheduled)
    )


def _thin(points: list[TimelinePoint]) -> list[TimelinePoint]:
    """At most MAX_TIMELINE_POINTS, keeping every step that preempted."""
    stride = max(1, len(points) // MAX_TIMELINE_POINTS)
    return [p for i, p in enumerate(points) if i % stride == 0 or p.preempted]


def _pct(sorted_values: list[float], p: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(p * len(sorted_values)))]


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def simulate_from_plan(
    plan: dict[str, Any], entries: Sequence[TraceEntry], args: argparse.Namespace
) -> dict[str, Any]:
    """Run the simulation the CLI asked for, on the plan's cache geometry."""
    geometry = plan["geometry"]
    if geometry["num_blocks"] < 1:
        raise ValueError("--simulate: the KV budget holds no block")
    if args.sim_requests < 1:
        raise ValueError(f"--sim-requests must be >= 1, got {args.sim_requests}")
    entries = list(entries)[: args.sim_requests]
    swap = args.preemption_mode in ("swap", "auto")
    config = SimulationConfig(
        num_blocks=geometry["num_blocks"],
        block_size=geometry["block_size"],
        max_model_len=plan["model"]["max_model_len"],
        arrival_rate=args.arrival_rate,
        cost=CostModel(args.step_ms, args.token_ms),
        preemption_mode=args.preemption_mode,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_host_blocks=geometry["num_blocks"] if swap else 0,
        seed=args.seed,
    )
    return asdict(simulate(entries, config))


def render_simulation(sim: dict[str, Any]) -> list[str]:
    """Text lines for the CLI."""
    modes = ", ".join(f"{n} by {m}" for m, n in sim["preemptions_by_mode"].items() if n) or "none"
    used = sim["mean_used_tokens"] or 1
    return [
        f"simulation: {sim['num_requests']} requests at {sim['arrival_rate']:g}/s through the "
        f"scheduler and block manager ({sim['num_steps']:,} steps, {sim['duration_s']:.1f} s simulated)",
        f"  admitted concurrency   peak {sim['peak_running']}, mean {sim['mean_running']:.1f}"
        + (
            f", mean {sim['mean_running_saturated']:.1f} while requests waited"
            if sim["mean_running_saturated"] is not None
            else ", no request ever waited"
        ),
        f"  queueing delay         mean {sim['queue_delay_mean_s']:.2f} s, p50 "
        f"{sim['queue_delay_p50_s']:.2f} s, p99 {sim['queue_delay_p99_s']:.2f} s",
        f"  preemptions            {sim['num_preemptions']} ({modes}; mode {sim['preemption_mode']})",
        f"  waste (core.accounting, mean over sampled steps, of {used:,.0f} tokens in use)",
        f"    internal  (last-block slack)  {sim['mean_internal_waste_tokens']:,.0f} tokens "
        f"({sim['mean_internal_waste_tokens'] / used:.1%})",
        f"    external  (free, unusable)    {sim['mean_external_waste_tokens']:,.0f} tokens",
        f"    (not waste: {sim['mean_free_while_waiting_tokens']:,.0f} tokens free while the queue's "
        "head waited for the token budget, max_num_seqs or the watermark)",
        f"    duplication (prompt copies)   {sim['mean_duplicated_tokens']:,.0f} tokens "
        f"({sim['mean_duplicated_tokens'] / used:.1%}); sharing saved "
        f"{sim['mean_shared_saved_tokens']:,.0f} tokens",
    ]
