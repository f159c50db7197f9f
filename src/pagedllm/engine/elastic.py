"""The elastic KV pool, engine side: what a resize reports, and the automatic policy.

A shrink runs between steps: the core plans compaction slices (``core/compaction.py``),
the runner copies each slice's blocks (``block_copies`` of a moves-only step) and the core
moves its books; once nothing is held past the target, the core drops the tail and the
runner gives its memory back (``worker/allocator.BlockArena``). A grow resizes the runner,
then the core. ``ElasticPool`` carries both out between the steps of one engine
(``LLMEngine.elastic``: ``resize``, ``start``, ``idle_tick``; ``elastic_pool`` builds it from
the engine's config and KV plan); beside it, the plain parts: the report, one resize's
running tally, the automatic policy.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.outputs import SchedulerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.config import EngineConfig
from pagedllm.engine.kv_plan import KVPlan
from pagedllm.util.memory import resident_bytes as process_resident_bytes
from pagedllm.worker.base import ModelRunner, ResizableRunner

logger = logging.getLogger(__name__)

# How many policy events /metrics and the dashboard can show.
MAX_EVENTS = 64
# Blocks the first slice of a shrink under load moves: its time sets the next ones' size.
FIRST_SLICE_MOVES = 8


@dataclass(frozen=True, slots=True)
class ResizeReport:
    """What one resize did. ``bytes_returned`` is negative when the pool grew.

    Cached blocks (prompt-cache entries, one per full block) are counted at the start
    (``cached_blocks_before``), kept at the end, moved by compaction, and dropped (least
    recently used first) where the smaller pool could not hold them: to the disk tier
    when it holds them (every indexed block is stored there), else gone. ``limited_by`` says
    why the pool stopped above ``blocks_requested``, or is None.
    """

    resize_id: int
    blocks_before: int
    blocks_after: int
    blocks_requested: int
    blocks_moved: int
    cached_blocks_before: int
    cached_blocks_kept: int
    cached_blocks_moved: int
    cached_blocks_to_disk: int
    cached_blocks_dropped: int
    bytes_per_block: int
    bytes_returned: int
    resident_bytes_before: int | None
    resident_bytes_after: int | None
    duration_ms: float
    num_slices: int
    num_preempted: int
    limited_by: str | None = None
    reason: str = "manual"

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(slots=True)
class ResizeTally:
    """A resize under way (the engine's running count, internal)."""

    resize_id: int
    blocks_before: int
    blocks_requested: int
    cached_blocks_before: int
    resident_bytes_before: int | None
    reason: str
    started: float = field(default_factory=time.perf_counter)
    blocks_moved: int = 0
    cached_blocks_moved: int = 0
    cached_blocks_to_disk: int = 0
    cached_blocks_dropped: int = 0
    num_slices: int = 0
    num_preempted: int = 0
    limited_by: str | None = None

    def report(
        self,
        blocks_after: int,
        cached_blocks_kept: int,
        bytes_per_block: int,
        resident_bytes_after: int | None,
    ) -> ResizeReport:
        return ResizeReport(
            resize_id=self.resize_id,
            blocks_before=self.blocks_before,
            blocks_after=blocks_after,
            blocks_requested=self.blocks_requested,
            blocks_moved=self.blocks_moved,
            cached_blocks_before=self.cached_blocks_before,
            cached_blocks_kept=cached_blocks_kept,
            cached_blocks_moved=self.cached_blocks_moved,
            cached_blocks_to_disk=self.cached_blocks_to_disk,
            cached_blocks_dropped=self.cached_blocks_dropped,
            bytes_per_block=bytes_per_block,
            bytes_returned=(self.blocks_before - blocks_after) * bytes_per_block,
            resident_bytes_before=self.resident_bytes_before,
            resident_bytes_after=resident_bytes_after,
            duration_ms=(time.perf_counter() - self.started) * 1e3,
            num_slices=self.num_slices,
            num_preempted=self.num_preempted,
            limited_by=self.limited_by,
            reason=self.reason,
        )


@dataclass(frozen=True, slots=True)
class ElasticEvent:
    """One decision of the automatic policy (or a manual resize), for /metrics."""

    time: float  # time.time()
    kind: str  # "grow" | "shrink"
    reason: str
    blocks_before: int
    blocks_after: int
    duration_ms: float


@dataclass(frozen=True, slots=True)
class LoadView:
    """What the policy looks at after a step (plain numbers from the engine)."""

    num_blocks: int
    num_used: int
    num_cached: int
    num_free: int
    num_running: int
    num_waiting: int
    blocks_wanted: int  # the first waiting request's prompt, in blocks (0: none waits)
    num_preemptions: int  # since start-up
    idle: bool  # no unfinished request


class ElasticPolicy:
    """``--kv-cache-memory MIN:MAX``: grow under load up to MAX, shrink toward MIN (down
    to what the prompt cache still holds, packed) after ``idle_s`` without requests.

    Grow when a request waits for blocks the pool lacks, or when a step preempted: by
    a quarter of the range at least, to what the waiting request needs at most MAX.
    """

    def __init__(self, min_blocks: int, max_blocks: int, *, idle_s: float = 30.0) -> None:
        if not 0 < min_blocks <= max_blocks:
            raise ValueError(f"need 0 < MIN <= MAX blocks, got {min_blocks}:{max_blocks}")
        if idle_s < 0:
            raise ValueError(f"idle_s must be >= 0, got {idle_s}")
        self.min_blocks = min_blocks
        self.max_blocks = max_blocks
        self.idle_s = idle_s
        self.grow_step = max(1, (max_blocks - min_blocks) // 4)
        self.events: deque[ElasticEvent] = deque(maxlen=MAX_EVENTS)
        self.num_grows = 0
        self.num_shrinks = 0
        self._idle_since: float | None = None
        self._preemptions_seen = 0

    def target(self, view: LoadView, now: float) -> tuple[int, str] | None:
        """A new size (blocks) and the reason, or None to stay."""
        preempted = view.num_preemptions > self._preemptions_seen
        self._preemptions_seen = view.num_preemptions
        if view.idle:
            if self._idle_since is None:
                self._idle_since = now
        else:
            self._idle_since = None
        short = view.blocks_wanted > view.num_free
        if (preempted or (view.num_waiting and short)) and view.num_blocks < self.max_blocks:
            wanted = view.num_blocks + max(self.grow_step, view.blocks_wanted - view.num_free)
            reason = "preemption" if preempted else "requests waiting for blocks"
            return min(self.max_blocks, wanted), reason
        if self._idle_since is not None and now - self._idle_since >= self.idle_s:
            packed = max(self.min_blocks, view.num_used + view.num_cached)
            if packed < view.num_blocks:
                return packed, f"idle for {self.idle_s:g} s"
        return None

    def record(self, event: ElasticEvent) -> None:
        self.events.append(event)
        if event.blocks_after > event.blocks_before:
            self.num_grows += 1
        elif event.blocks_after < event.blocks_before:
            self.num_shrinks += 1


@dataclass(frozen=True, slots=True)
class ElasticStats:
    """The elastic pool in ``EngineStats``: sizes, the policy's range (None without
    automatic mode), whether a shrink is under way, the last resize and recent events."""

    bytes_per_block: int
    min_blocks: int | None
    max_blocks: int | None
    resizing: bool
    num_grows: int
    num_shrinks: int
    last_resize: ResizeReport | None
    events: tuple[ElasticEvent, ...]


def elastic_pool(
    config: EngineConfig,
    kv: KVCacheManager,
    scheduler: Scheduler,
    runner: ModelRunner,
    plan: KVPlan,
) -> ElasticPool:
    """The pool of an engine: with ``--kv-cache-memory MIN:MAX`` its automatic policy
    (MIN is the start size), and the scheduler told the most blocks a request may count on."""
    policy = None
    if config.kv_cache_memory_max is not None:
        if not isinstance(runner, ResizableRunner):
            raise ValueError(f"kv_cache_memory_max: {type(runner).__name__} cannot resize")
        policy = ElasticPolicy(plan.num_blocks, plan.max_num_blocks, idle_s=config.elastic_idle_s)
        scheduler.max_num_blocks = policy.max_blocks
    return ElasticPool(
        kv,
        scheduler,
        runner,
        step_fraction=config.compaction_step_fraction,
        policy=policy,
        free_bytes=lambda: _free_memory_bytes(config.device),
    )


def _free_memory_bytes(device: str) -> int:
    from pagedllm.worker.kv_cache import available_memory_bytes

    return available_memory_bytes(device)


class ElasticPool:
    """Carries out resizes of one engine's device tier between its steps
    (``LLMEngine.elastic``; the engine calls ``before_step`` and ``after_step``).

    A shrink never cuts below what running requests hold plus one block each (their
    next tokens) nor below the largest unfinished request's whole need (it could never
    finish); ``preempt=True`` preempts running requests (by recompute, the scheduler's
    usual victims first) to get under the request instead. The report's ``limited_by``
    says which limit held. Between steps, each slice moves at most as many blocks as
    ``compaction_step_fraction`` of a step's time allows (measured as it goes).
    """

    def __init__(
        self,
        kv: KVCacheManager,
        scheduler: Scheduler,
        runner: ModelRunner,
        *,
        step_fraction: float = 0.15,
        policy: ElasticPolicy | None = None,
        free_bytes: Callable[[], int] | None = None,
    ) -> None:
        self.kv = kv
        self.scheduler = scheduler
        self.runner = runner
        self.step_fraction = step_fraction
        self.policy = policy
        self.free_bytes = free_bytes  # the device's free memory now (None: unknown)
        self.last_report: ResizeReport | None = None
        # Reports of the last few resizes by id (``start``'s answer), for callers that poll.
        self._reports: dict[int, ResizeReport] = {}
        self._num_started = 0
        self._tally: ResizeTally | None = None
        self._callbacks: list[Callable[[ResizeReport], None]] = []
        # Running estimates for slice sizes: seconds per step and per block moved.
        self._recent_steps: deque[float] = deque(maxlen=5)
        self._step_seconds = 0.02
        self._move_seconds: float | None = None

    # ---- public ------------------------------------------------------------------------

    @property
    def resizing(self) -> bool:
        return self._tally is not None

    @property
    def bytes_per_block(self) -> int:
        return self._resizable().kv_block_bytes

    def resize(self, num_bytes: int, *, preempt: bool = False) -> ResizeReport:
        """Resize now, every compaction slice back to back; returns the report."""
        self.start(num_bytes, preempt=preempt)
        while self._tally is not None:
            self._slice(None)
        assert self.last_report is not None
        return self.last_report

    def start(
        self,
        num_bytes: int,
        *,
        preempt: bool = False,
        on_done: Callable[[ResizeReport], None] | None = None,
        reason: str = "manual",
    ) -> int:
        """Begin a resize; a grow (or a shrink with nothing running) completes at once,
        a shrink under load goes on in slices before the next steps. ``on_done`` gets the
        report. A resize still under way ends where it got to first. Returns the resize's
        id (``report_for``)."""
        runner = self._resizable()
        if isinstance(num_bytes, bool) or not isinstance(num_bytes, int):
            raise TypeError(f"kv cache size must be an integer number of bytes, got {num_bytes!r}")
        requested = num_bytes // runner.kv_block_bytes
        if requested < 1:
            raise ValueError(
                f"kv cache size {num_bytes} bytes is less than one block "
                f"({runner.kv_block_bytes} bytes)"
            )
        self._check_room(num_bytes, requested, runner)
        if self._tally is not None:
            self._tally.limited_by = "superseded by another resize"
            self._complete(settle=True)
        if requested < self.kv.num_blocks:
            self.scheduler.release_pins()  # pinned prefixes are cached-free again: movable
        pool = self.kv.pool
        self._num_started += 1
        self._tally = ResizeTally(
            resize_id=self._num_started,
            blocks_before=self.kv.num_blocks,
            blocks_requested=requested,
            cached_blocks_before=pool.num_cached_free_blocks,
            resident_bytes_before=process_resident_bytes(),
            reason=reason,
        )
        if on_done is not None:
            self._callbacks.append(on_done)
        if requested >= self.kv.num_blocks:
            runner.resize_kv_cache(requested)
            self.kv.grow(requested)
            self._complete(settle=True)
        else:
            self.kv.begin_shrink(self._shrink_target(requested, preempt))
            if not self.scheduler.has_unfinished_requests():
                self.finish_now()
        return self._num_started

    def report_for(self, resize_id: int) -> ResizeReport | None:
        """The report of resize ``resize_id`` once it is done (None while under way);
        ValueError for an id never started or long forgotten."""
        report = self._reports.get(resize_id)
        if report is None and not (self._tally and self._tally.resize_id == resize_id):
            raise ValueError(
                f"no resize {resize_id!r} (the last one started is {self._num_started})"
            )
        return report

    def capacity_blocks(self) -> int:
        """The most device blocks one request may count on: the pool's size (the target
        of a shrink under way), or the automatic policy's MAX."""
        return max(self.kv.usable_blocks, self.scheduler.max_num_blocks or 0)

    def idle_tick(self) -> None:
        """Let the automatic policy act while no step runs (an idle server's timer calls
        this); a shrink under way with nothing running completes."""
        if self.resizing and not self.scheduler.has_unfinished_requests():
            self.finish_now()
        self.tick(time.monotonic())

    def finish_now(self) -> None:
        """Run the rest of a shrink under way at once."""
        while self._tally is not None:
            self._slice(None)

    def before_step(self) -> None:
        """One bounded slice of a shrink under way (the engine calls it before a step)."""
        if self._tally is None:
            return
        if not self.scheduler.has_unfinished_requests():
            self.finish_now()
            return
        if self._move_seconds is None:
            self._slice(FIRST_SLICE_MOVES)  # measure before trusting a budget
            return
        budget = self.step_fraction * self._step_seconds
        self._slice(max(1, int(budget / self._move_seconds)))

    def after_step(self, step_seconds: float, now: float) -> None:
        """Learn the step's length (the next slice's budget follows the median of the last
        few steps: a prompt-heavy step long ago is no guide to the decode steps now, nor is
        one slow step); let the automatic policy act."""
        self._recent_steps.append(step_seconds)
        self._step_seconds = statistics.median(self._recent_steps)
        self.tick(now)

    def tick(self, now: float) -> None:
        """The automatic policy's turn (after steps, and from an idle server's timer)."""
        if self.policy is None or self._tally is not None:
            return
        decision = self.policy.target(self._load_view(), now)
        if decision is not None:
            blocks, reason = decision
            self.start(blocks * self.bytes_per_block, reason=reason)

    def stats(self) -> ElasticStats:
        policy = self.policy
        return ElasticStats(
            bytes_per_block=self.bytes_per_block,
            min_blocks=policy.min_blocks if policy else None,
            max_blocks=policy.max_blocks if policy else None,
            resizing=self.resizing,
            num_grows=policy.num_grows if policy else 0,
            num_shrinks=policy.num_shrinks if policy else 0,
            last_resize=self.last_report,
            events=tuple(policy.events) if policy else (),
        )

    # ---- internal ----------------------------------------------------------------------

    def _check_room(self, num_bytes: int, requested: int, runner: ResizableRunner) -> None:
        """Refuse up front a grow past the device's free memory: the allocation would fail
        late, or on a CPU that overcommits the OOM killer would end the process."""
        more = (requested - self.kv.num_blocks) * runner.kv_block_bytes
        if self.free_bytes is None or more <= 0:
            return
        free = self.free_bytes()
        if more > free:
            raise ValueError(
                f"kv cache size {num_bytes} bytes would grow the pool by {more} bytes, "
                f"more than the {free} bytes free on the device"
            )

    def _resizable(self) -> ResizableRunner:
        if not isinstance(self.runner, ResizableRunner):
            raise ValueError(f"{type(self.runner).__name__} cannot resize its KV cache")
        return self.runner

    def _shrink_target(self, requested: int, preempt: bool) -> int:
        tally, scheduler, pool = self._tally, self.scheduler, self.kv.pool
        assert tally is not None
        if preempt:
            while scheduler.running and pool.num_used_blocks + len(scheduler.running) > requested:
                scheduler.preempt_one()
                tally.num_preempted += 1
        held = pool.num_used_blocks + len(scheduler.running)
        largest = scheduler.max_blocks_needed()
        if held > requested:
            tally.limited_by = (
                f"running requests hold {pool.num_used_blocks} blocks "
                f"(+1 each for their next tokens); preempt to go lower"
            )
        if largest > max(requested, held):
            tally.limited_by = f"an unfinished request needs {largest} blocks at its longest"
        return min(self.kv.num_blocks, max(requested, held, largest, 1))

    def _slice(self, max_moves: int | None) -> None:
        tally = self._tally
        assert tally is not None
        kv = self.kv
        started = time.perf_counter()
        # Disk stores planned by the last step read their device blocks first, before
        # any of them moves or is released.
        disk_ops = kv.take_disk_ops()
        plan = kv.plan_compaction(max_moves)
        num_cached = sum(1 for src, _ in plan.moves if kv.pool.ref_count(src) == 0)
        on_disk = sum(
            1 for b in plan.drops if kv.disk is not None and kv.pool.block_hash(b) in kv.disk
        )
        if plan.moves or disk_ops:
            try:
                self.runner.execute(SchedulerOutput(block_copies=plan.moves, disk=disk_ops))
            except Exception as exc:  # the books are unchanged: stop the shrink here
                logger.exception("compaction copy failed; the pool keeps its size")
                tally.limited_by = f"block copy failed: {type(exc).__name__}: {exc}"
                self.kv.grow(self.kv.num_blocks)
                self._complete(settle=True)
                return
        kv.apply_compaction(plan)
        if plan.moves:
            # The whole slice (planning and books too) per block moved: the budget then
            # covers a slice's fixed costs as well as its copies.
            per_move = (time.perf_counter() - started) / len(plan.moves)
            last = self._move_seconds
            self._move_seconds = per_move if last is None else 0.7 * last + 0.3 * per_move
        tally.num_slices += 1
        tally.blocks_moved += len(plan.moves)
        tally.cached_blocks_moved += num_cached
        tally.cached_blocks_to_disk += on_disk
        tally.cached_blocks_dropped += len(plan.drops) - on_disk
        if not kv.shrink_pending:
            self._complete(settle=False)
        elif plan.is_empty:
            tally.limited_by = tally.limited_by or "running requests hold blocks past the target"
            self._complete(settle=True)

    def _complete(self, *, settle: bool) -> None:
        tally = self._tally
        assert tally is not None
        self._tally = None
        runner = self._resizable()
        size = self.kv.finish_shrink(settle=settle)
        if size < runner.num_blocks:
            disk_ops = self.kv.take_disk_ops()  # stores read their blocks before release
            if disk_ops:
                self.runner.execute(SchedulerOutput(disk=disk_ops))
            runner.resize_kv_cache(size)
        report = tally.report(
            size,
            self.kv.pool.num_cached_free_blocks,
            runner.kv_block_bytes,
            process_resident_bytes(),
        )
        self.last_report = report
        self._reports[tally.resize_id] = report
        for old in [i for i in self._reports if i <= tally.resize_id - MAX_EVENTS]:
            del self._reports[old]
        logger.info(
            "KV cache resized %d -> %d blocks (%s): %d moved, %.1f ms%s",
            report.blocks_before,
            report.blocks_after,
            report.reason,
            report.blocks_moved,
            report.duration_ms,
            f"; {report.limited_by}" if report.limited_by else "",
        )
        if self.policy is not None and size != tally.blocks_before:
            kind = "grow" if size > tally.blocks_before else "shrink"
            self.policy.record(
                ElasticEvent(
                    time.time(), kind, tally.reason, tally.blocks_before, size, report.duration_ms
                )
            )
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(report)

    def _load_view(self) -> LoadView:
        pool, scheduler = self.kv.pool, self.scheduler
        wanted = 0
        if scheduler.waiting:
            first = min(scheduler.waiting, key=lambda r: (r.priority, r.arrival_time))
            wanted = -(-first.num_tokens // self.kv.block_size)
        return LoadView(
            num_blocks=self.kv.num_blocks,
            num_used=pool.num_used_blocks,
            num_cached=pool.num_cached_free_blocks,
            num_free=pool.num_free_blocks,
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            blocks_wanted=wanted,
            num_preemptions=scheduler.stats().num_preemptions,
            idle=not scheduler.has_unfinished_requests(),
        )
