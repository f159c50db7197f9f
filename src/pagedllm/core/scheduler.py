"""Continuous batching over the paged cache. Pure Python.

One counter per request, ``num_computed_tokens``, replaces "prefill" and "decode"
phases: each step advances every chosen request by some tokens, within
``max_num_batched_tokens`` tokens and ``max_num_seqs`` sequences::

    |<------------------ all_token_ids ------------------>|
    |<-- num_computed_tokens -->|<-- scheduled (k) -->|...|   k <= token budget
                                 ^ start_position

A decoding request has exactly one token to do; a prompt has many and is cut into
chunks (chunked prefill) so that decodes are never starved.

Order within a step:

1. running requests (decodes first, then prompt chunks); when one cannot grow,
   the newest running request (largest ``(priority, arrival_time)``) is preempted
   by recompute (free, requeue) or by swap (blocks to the host tier);
2. swapped requests are swapped back in (only in a step without preemption);
3. waiting requests are admitted (only when no request is still swapped out):
   longest cached prefix first, then the rest within the budget; a request whose next
   uncached block a running request computes waits for it (``core/inflight.py``).

Collaborators: ``scheduler_config`` (the limits), ``request_fit`` (the fit rule and the
``max_tokens`` default), ``inflight`` (in-flight sharing), ``step_batch`` (the step being
built and its ``ScheduledSequence``s); the KV cache through ``kv_protocol``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, NamedTuple

from pagedllm.core.inflight import InflightSharing
from pagedllm.core.multi_step import multi_step_size, schedule_steps
from pagedllm.core.outputs import (
    ModelRunnerOutput,
    ScheduledSequence,
    SchedulerOutput,
    TokenLogprob,
)
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.request_fit import FitRule
from pagedllm.core.scheduler_config import SchedulerConfig
from pagedllm.core.step_batch import StepBatch, num_samples, to_scheduled, will_fork
from pagedllm.core.stops import stop_status

if TYPE_CHECKING:
    from pagedllm.core.kv_protocol import KVCacheProtocol
    from pagedllm.core.kv_records import Allocation, ComputedBlocks


def child_request_id(parent_id: str, index: int) -> str:
    """Id of the ``index``-th parallel sample (index 0 is the parent itself)."""
    return f"{parent_id}#{index}"


class SequenceUpdate(NamedTuple):
    """What one step did to one sequence: tokens appended (and maybe finished).

    ``parent_id`` is set on a parallel sample forked from its parent this step.
    A named tuple, not a frozen dataclass: one is built per sequence per step, and
    a tuple is several times cheaper to build.
    """

    request: Request
    new_token_ids: tuple[int, ...]
    new_logprobs: tuple[TokenLogprob, ...] | None = None
    parent_id: str | None = None


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_swapped: int
    num_preemptions_recompute: int
    num_preemptions_swap: int
    # Prompt tokens found in the prefix cache that were in flight (being computed by
    # another request) when the request first waited for them.
    num_inflight_shared_tokens: int = 0
    num_inflight_waits: int = 0
    # Waiting requests' pins released to make room for another allocation.
    num_pins_given_up: int = 0

    @property
    def num_preemptions(self) -> int:
        return self.num_preemptions_recompute + self.num_preemptions_swap


class Scheduler:
    """Chooses each step's batch, and applies the model's results.

    ``schedule()`` -> ``SchedulerOutput`` -> the runner -> ``update(output, result)``.
    """

    def __init__(self, config: SchedulerConfig, kv: KVCacheProtocol) -> None:
        self.config = config
        self.kv = kv
        block_size = kv.stats().block_size
        self._block_size = block_size
        self.fit = FitRule(config, kv, block_size)
        self.inflight = InflightSharing(kv, block_size, config.enable_inflight_sharing)
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self._arrival_order: dict[str, int] = {}
        self._next_order = 0
        self._finished_ids: set[str] = set()
        self._last_step_ids: frozenset[str] = frozenset()
        self.num_preemptions = {"recompute": 0, "swap": 0}
        self.num_pins_given_up = 0

    # ------------------------------------------------------------------ public

    def add_request(self, request: Request) -> None:
        """Queue a request; ``ValueError`` when it could never run."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        params = request.sampling_params
        if params is not None and params.max_tokens is None:
            default = self.default_max_tokens(request.num_prompt_tokens)
            request.sampling_params = params.with_max_tokens(default)
        self.check_fits(request.num_prompt_tokens, self.max_tokens(request), num_samples(request))
        self._enqueue(request)
        self.waiting.append(request)
        request.arrival_event_seq = self.kv.events.next_seq
        if self.config.pin_waiting_prefixes:
            self.kv.pin_prefix(request)

    # The fit rule and the max_tokens default live in ``core/request_fit.py``.

    def check_fits(self, num_prompt_tokens: int, max_tokens: int, n: int = 1) -> None:
        """Raise ``ValueError`` (with both numbers) for a request that can never fit."""
        self.fit.check_fits(num_prompt_tokens, max_tokens, n)

    def max_num_tokens(self) -> int:
        """The most tokens (prompt + ``max_tokens``) one request may have."""
        return self.fit.max_num_tokens()

    def default_max_tokens(self, num_prompt_tokens: int) -> int:
        """``max_tokens`` of a request that sets none: all the room its prompt leaves."""
        return self.fit.default_max_tokens(num_prompt_tokens)

    def max_tokens(self, request: Request) -> int:
        """The most output tokens ``request`` may have."""
        return self.fit.max_tokens(request)

    @property
    def max_num_blocks(self) -> int | None:
        """The most blocks the pool may grow to (the elastic pool's MAX), if it can grow."""
        return self.fit.max_num_blocks

    @max_num_blocks.setter
    def max_num_blocks(self, value: int | None) -> None:
        self.fit.max_num_blocks = value

    def schedule(self, *, single_step: bool = False) -> SchedulerOutput:
        """Choose this step's work. Mutates block tables and queues.

        Multi-step decoding (``num_scheduler_steps > 1``): when nothing waits or is swapped
        out and every running request decodes greedily (``multi_step_size``), each gets
        slots for the next k tokens and the worker runs k steps in a row; the per-sequence
        Python of scheduling, sampling and updating is paid once for k tokens. Tokens past
        a request's stop are computed and dropped (its extra slots go with its blocks).
        ``single_step``: one step this time (speculative decoding expects drafts soon)."""
        step = StepBatch(budget=self.config.max_num_batched_tokens)
        num_steps = 1
        if not (single_step or self.waiting or self.swapped):  # core/multi_step.py
            num_steps = multi_step_size(self.config, self.running, self.fit.max_tokens)
        if num_steps > 1 and not schedule_steps(self.kv, self.running, step, num_steps):
            num_steps = 1
        if num_steps == 1:
            self._schedule_running(step)
            if not step.preempted:
                self._schedule_swapped(step)
                if not self.swapped:
                    self._schedule_waiting(step)
        self._last_step_ids = frozenset(step.scheduled).union(step.touched)
        output = SchedulerOutput(
            scheduled=tuple(to_scheduled(self.kv, r, k) for r, k in step.scheduled.values()),
            block_copies=tuple(c for cs in step.copies.values() for c in cs),
            swap_out=tuple(step.swap_out),
            swap_in=tuple(step.swap_in),
            finished_request_ids=frozenset(self._finished_ids),
            num_steps=num_steps,
            disk=self.kv.take_disk_ops(),
            released_block_ids=self.kv.take_released_block_ids(),
        )
        self._finished_ids.clear()
        return output

    def reject_loads(self, output: SchedulerOutput, block_ids: Iterable[int]) -> SchedulerOutput:
        """The worker could not load these blocks of ``output.disk.loads``: they leave the
        prefix index and the disk tier, every running request holding one is freed and
        queued again (it will be recomputed from the first missing block; not counted as
        a preemption), and ``output`` is returned without those requests."""
        failed = set(block_ids)
        if not failed:
            return output
        self.kv.loads_failed(failed)
        dropped = set()
        for request in list(self.running):
            if failed.intersection(self.kv.block_table_tuple(request.request_id)):
                self.running.remove(request)
                self.kv.free(request)
                request.num_computed_tokens = 0
                request.status = RequestStatus.WAITING
                self.waiting.insert(0, request)
                dropped.add(request.request_id)
        scheduled = tuple(s for s in output.scheduled if s.request_id not in dropped)
        return replace(output, scheduled=scheduled)

    def update(self, output: SchedulerOutput, result: ModelRunnerOutput) -> list[SequenceUpdate]:
        """Advance counters, append sampled tokens, fork parallel samples, finish. A
        ``score_only`` request's update has no token, only its logprobs."""
        if output.num_steps > 1:
            return self._update_steps(output, result)
        updates: list[SequenceUpdate] = []
        sampled, all_logprobs = result.sampled_token_ids, result.logprobs
        num_sampled, num_logprobs = len(sampled), len(all_logprobs)
        for i, seq in enumerate(output.scheduled):
            tokens = sampled[i] if i < num_sampled else ()
            logprobs = all_logprobs[i] if i < num_logprobs else None
            if seq.num_draft_tokens:
                update = self._apply_verified(seq, tokens, logprobs)
                if update is not None:
                    updates.append(update)
                continue
            request = self._advance(seq)
            if request is None:
                continue
            if request.score_only:  # the sampled token is not appended: the client picks
                if tokens:
                    updates.append(SequenceUpdate(request, (), logprobs))
                continue
            if len(tokens) == 1:  # the common case: one token, no fork
                updates.append(self._append(request, tokens[0], logprobs[0] if logprobs else None))
            elif tokens:
                updates.extend(self._apply_samples(request, tuple(tokens), logprobs))
        return updates

    def _apply_verified(
        self,
        seq: ScheduledSequence,
        tokens: Sequence[int],
        logprobs: tuple[TokenLogprob, ...] | None,
    ) -> SequenceUpdate | None:
        """``update`` of a decode with drafts: ``tokens`` are its accepted drafts and the
        token sampled after them. Each is appended and checked for a stop in turn (those
        after a stop are dropped); the input token and the accepted drafts become computed,
        and the rejected drafts' slots are rolled back (``release_unverified``)."""
        request = self.requests.get(seq.request_id)
        if request is None or request.status is not RequestStatus.RUNNING:
            return None
        request.draft_token_ids = []
        drafts = seq.token_ids[1:]
        assert 0 < len(tokens) <= len(drafts) + 1 and list(tokens[:-1]) == list(
            drafts[: len(tokens) - 1]
        ), f"{seq.request_id}: {list(tokens)} are not accepted drafts of {list(drafts)} + 1"
        kept = 0
        for token_id in tokens:
            request.append_output_token_ids(token_id)
            kept += 1
            self._check_stop(request, token_id)
            if request.status is not RequestStatus.RUNNING:
                break
        if request.status is RequestStatus.RUNNING:
            request.num_computed_tokens += kept  # the input token and the accepted drafts
            self.kv.cache_full_blocks(request)
            self.kv.release_out_of_window(request)
            self.kv.release_unverified(request)
        lp = tuple(logprobs[:kept]) if logprobs else None
        return SequenceUpdate(request, tuple(tokens[:kept]), lp)

    def _update_steps(
        self, output: SchedulerOutput, result: ModelRunnerOutput
    ) -> list[SequenceUpdate]:
        """``update`` of a multi-step output: each sequence's tokens are its steps, applied
        one at a time as single steps would apply them (the step's input token computed,
        newly full blocks registered, the token appended, the stops checked); the tokens
        after a stop are dropped. A sequence the engine retried alone has one token."""
        updates: list[SequenceUpdate] = []
        running = RequestStatus.RUNNING
        cache_full_blocks = self.kv.cache_full_blocks
        for seq, tokens in zip(output.scheduled, result.sampled_token_ids, strict=False):
            request = self._advance(seq)  # the window's first input computed
            if request is None:
                continue
            kept = 0
            for token_id in tokens:
                if kept:  # the token before is this step's input
                    request.num_computed_tokens += 1
                    cache_full_blocks(request)
                    self.kv.release_out_of_window(request)
                request.append_output_token_ids(token_id)
                kept += 1
                self._check_stop(request, token_id)
                if request.status is not running:
                    break
            if kept:
                updates.append(SequenceUpdate(request, tuple(tokens[:kept]), None, None))
        return updates

    def _advance(self, seq: ScheduledSequence) -> Request | None:
        """``seq``'s request with its tokens computed and newly full blocks registered, or
        None when it finished (or left) since ``schedule()``."""
        request = self.requests.get(seq.request_id)
        if request is None or request.status is not RequestStatus.RUNNING:
            return None
        request.num_computed_tokens += len(seq.token_ids)
        self.kv.cache_full_blocks(request)
        self.kv.release_out_of_window(request)
        return request

    def fork(self, parent: Request, child_id: str, sample_index: int = 0) -> Request:
        """A new running request sharing all of ``parent``'s blocks (and tokens);
        ``sample_index``: which parallel sample of the parent it is."""
        if child_id in self.requests:
            raise ValueError(f"request_id {child_id!r} is already in use")
        child = Request(
            request_id=child_id,
            prompt_token_ids=list(parent.prompt_token_ids),
            sampling_params=parent.sampling_params,
            eos_token_id=parent.eos_token_id,
            arrival_time=parent.arrival_time,
            priority=parent.priority,
            cache_salt=parent.cache_salt,
            output_token_ids=list(parent.output_token_ids),
            sample_index=sample_index,
            score_only=parent.score_only,
        )
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        child.cache_event_seq = parent.cache_event_seq
        child.arrival_event_seq = parent.arrival_event_seq
        child.status = RequestStatus.RUNNING
        self.kv.fork(parent, child)
        self._enqueue(child)
        self.running.append(child)
        return child

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish (abort, stop, fail) requests wherever they are; frees their blocks."""
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None:
                self._finish(request, status)
                finished.append(request)
        return finished

    def fail_last_step(self) -> list[Request]:
        """Finish with ``error`` every request the last ``schedule()`` touched
        (scheduled, swapped out or in): their cache contents are unknown."""
        ids = [i for i in self._last_step_ids if i in self.requests]
        self._last_step_ids = frozenset()
        return self.finish_requests(ids, RequestStatus.FINISHED_ERROR)

    def preempt_one(self) -> Request | None:
        """Preempt (by recompute) the running request that a full cache would preempt
        first, between steps (a shrink asked to make room); None when nothing runs."""
        if not self.running:
            return None
        victim = max(self.running, key=self._victim_key)
        self.running.remove(victim)
        victim.num_preemptions += 1
        self._requeue(victim)
        return victim

    def release_pins(self) -> int:
        """End every waiting request's pin (a shrink of the pool wants the room); returns
        how many there were."""
        return sum(1 for request in self.waiting if self.kv.release_pin(request))

    def max_blocks_needed(self) -> int:
        """Blocks the largest unfinished request holds at its longest: a pool smaller
        than this could never finish it."""
        return max(
            (
                self.fit.blocks_needed(r.num_prompt_tokens + self.max_tokens(r))
                for r in self.requests.values()
            ),
            default=0,
        )

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_swapped=len(self.swapped),
            num_preemptions_recompute=self.num_preemptions["recompute"],
            num_preemptions_swap=self.num_preemptions["swap"],
            num_inflight_shared_tokens=self.inflight.num_shared_tokens,
            num_inflight_waits=self.inflight.num_waits,
            num_pins_given_up=self.num_pins_given_up,
        )

    # --------------------------------------------------------------- running

    def _schedule_running(self, step: StepBatch) -> None:
        # Decodes (one token to do, or none: parked) before prompt chunks, so a long prompt
        # never starves them; each group in running order.
        decodes: list[Request] = []
        prefills: list[Request] = []
        for request in self.running:
            todo = len(request.all_token_ids) - request.num_computed_tokens
            (prefills if todo > 1 else decodes).append(request)
        self._grow_running(decodes, step)
        cap = self.config.max_prefill_tokens_while_decoding
        if cap is not None and step.scheduled:  # this step decodes: prompts get a slice
            step.budget = min(step.budget, cap)
        self._grow_running(prefills, step)

    def _grow_running(self, requests: list[Request], step: StepBatch) -> None:
        """Slots for each running request's next tokens, within the budget; preempts
        (the newest running request first) when one does not fit."""
        allocate_slots, running = self.kv.allocate_slots, RequestStatus.RUNNING
        scheduled = step.scheduled  # not empty after a multi-step attempt that did not fit
        for request in requests:
            if step.budget <= 0:
                break
            if request.status is not running or request.request_id in scheduled:
                continue  # preempted earlier in this loop, or already given its slots
            num_new = min(len(request.all_token_ids) - request.num_computed_tokens, step.budget)
            if num_new <= 0:
                continue  # parked: a beam waiting for its siblings (beam search)
            if request.draft_token_ids:
                allocation = self._allocate_drafts(request, step.budget)
                if allocation is not None:
                    step.add(request, 1 + len(request.draft_token_ids), allocation.block_copies)
                    continue
            # The first try inline (it nearly always fits); preemption when it does not.
            allocation = allocate_slots(request, num_new)
            if allocation is not None:
                copies = allocation.block_copies
            else:
                copies = self._allocate_or_preempt(request, num_new, step)
                if copies is None:
                    continue
            step.add(request, num_new, copies)

    def _allocate_drafts(self, request: Request, budget: int) -> Allocation | None:
        """Slots for a decode and its drafts (as many as ``max_drafts`` and the step's
        budget allow), or None with its drafts dropped: drafts never preempt anyone, and
        a request they do not fit decodes its one token as usual."""
        drafts = request.draft_token_ids
        num_drafts = min(len(drafts), self.max_drafts(request), budget - 1)
        if len(request.all_token_ids) - request.num_computed_tokens != 1 or num_drafts <= 0:
            request.draft_token_ids = []
            return None
        allocation = self.kv.allocate_slots(request, 1 + num_drafts)
        request.draft_token_ids = drafts[:num_drafts] if allocation is not None else []
        return allocation

    def max_drafts(self, request: Request) -> int:
        """The most drafts a decoding ``request`` may take this step: a step gives it at
        most one token past its drafts, and neither ``max_tokens`` nor ``max_model_len``
        may be passed (the last draft's slot is the position before the last token's)."""
        num_tokens = len(request.all_token_ids)
        left = self.max_tokens(request) - len(request.output_token_ids)
        return max(0, min(left, self.config.max_model_len - num_tokens + 1) - 1)

    def _allocate_or_preempt(
        self, request: Request, num_new: int, step: StepBatch
    ) -> tuple[tuple[int, int], ...] | None:
        while True:
            allocation = self.kv.allocate_slots(request, num_new)
            if allocation is not None:
                return allocation.block_copies
            if self._give_up_pins(None, self.kv.free_blocks_needed(request, num_new)):
                continue  # waiting requests' pins make the room: nobody is preempted
            victim = max(self.running, key=self._victim_key)
            self._preempt(victim, step)
            if victim is request:
                return None

    def _preempt(self, victim: Request, step: StepBatch) -> None:
        scheduled = step.scheduled.pop(victim.request_id, None)
        if scheduled is not None:
            step.budget += scheduled[1]
        self.running.remove(victim)
        step.preempted = True
        step.touched.add(victim.request_id)
        victim.num_preemptions += 1
        victim.draft_token_ids = []  # its draft slots go with its blocks
        # A pending copy-on-write targets one of the victim's blocks; a swap-out
        # (which runs before copies) would move the block before it is filled.
        if self._should_swap(victim) and victim.request_id not in step.copies:
            moves = self.kv.swap_out(victim)
            if moves is not None:
                step.swap_out.extend(moves)
                victim.status = RequestStatus.SWAPPED
                self.swapped.append(victim)
                self.num_preemptions["swap"] += 1
                return
        self._requeue(victim)

    def _requeue(self, victim: Request) -> None:
        """Preemption by recompute: free the blocks, back to the front of the queue."""
        self.kv.free(victim)
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.WAITING
        self.waiting.insert(0, victim)
        self.num_preemptions["recompute"] += 1

    def _should_swap(self, victim: Request) -> bool:
        mode = self.config.preemption_mode
        if mode == "recompute" or not self.kv.can_swap_out(victim):
            return False
        # auto: a request still in its first prompt mostly comes back through the
        # prefix cache, so recompute it; swap those that have generated tokens.
        return mode == "swap" or victim.num_output_tokens > 0

    # --------------------------------------------------------------- swapped

    def _schedule_swapped(self, step: StepBatch) -> None:
        # Swap in first, allocate after: requests swapped out together may come back
        # sharing a block, and one must not write into it before the other holds it
        # (allocate_slots then sees the share and copies on write).
        resumed = []
        for request in sorted(self.swapped, key=self._priority_key):
            if len(resumed) >= step.budget or len(self.running) >= self.config.max_num_seqs:
                break
            if not self.kv.can_swap_in(request) and not self._give_up_pins(
                None, self.kv.blocks_to_swap_in(request)
            ):
                break
            moves = self.kv.swap_in(request)
            if moves is None:
                break
            step.swap_in.extend(moves)
            step.touched.add(request.request_id)
            self.swapped.remove(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            resumed.append(request)
        for request in resumed:
            if step.budget <= 0:
                break
            num_new = min(request.num_tokens - request.num_computed_tokens, step.budget)
            allocation = self.kv.allocate_slots(request, num_new)
            if allocation is not None:  # else it is running and grows next step
                step.add(request, num_new, allocation.block_copies)

    # --------------------------------------------------------------- waiting

    def _schedule_waiting(self, step: StepBatch) -> None:
        inflight = self.inflight
        in_flight = inflight.hashes(self.running, bool(self.waiting))
        for request in sorted(self.waiting, key=self._priority_key):
            if step.budget <= 0:
                break
            num_seqs = num_samples(request) if will_fork(request) else 1
            if len(self.running) + num_seqs > self.config.max_num_seqs:
                break
            computed = self.kv.get_computed_blocks(request)
            event_seq = self.kv.events.next_seq  # before allocating evicts anything
            if in_flight is not None and inflight.waits_for(request, computed, in_flight):
                continue  # its next block is being computed; others may go first
            num_new = request.num_tokens - computed.num_tokens
            if num_new > step.budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(num_new, step.budget)
            allocation = self._admit(request, num_new, computed)
            if allocation is None:
                break  # first come, first served: nobody overtakes the head
            self.waiting.remove(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = computed.num_tokens
            if request.num_preemptions == 0:
                request.num_cached_tokens = computed.num_tokens
                request.cache_event_seq = event_seq
            inflight.count_share(request, computed.num_tokens)
            self.running.append(request)
            step.add(request, num_new, allocation.block_copies)
            if in_flight is not None:
                in_flight.update(inflight.uncomputed_hashes(request))

    def _admit(self, request: Request, num_new: int, computed: ComputedBlocks) -> Allocation | None:
        """``allocate_slots`` for a waiting request's first tokens; when the room is
        short, the pins of requests behind it give way first."""
        # With nothing running there is nobody to keep the watermark for, and
        # keeping it could leave a large request waiting forever.
        admission = bool(self.running)
        while True:
            allocation = self.kv.allocate_slots(request, num_new, computed, admission=admission)
            if allocation is not None:
                return allocation
            needed = self.kv.free_blocks_needed(request, num_new, computed, admission=admission)
            if not self._give_up_pins(request, needed):
                return None

    def _give_up_pins(self, request: Request | None, num_free_blocks: int) -> bool:
        """Make ``num_free_blocks`` blocks free by giving up the pins of waiting requests
        other than ``request``, of those admitted last first (they would wait longest;
        the next to run keep their prefix). False when it gave up none: the room was
        there already, or all their pins would not make it."""
        if not self.kv.num_pinned_requests:
            return False
        others = sorted(
            (r for r in self.waiting if r is not request), key=self._priority_key, reverse=True
        )
        released = self.kv.give_up_pins(others, num_free_blocks)
        self.num_pins_given_up += released
        return released > 0

    # ---------------------------------------------------------------- update

    def _apply_samples(
        self,
        request: Request,
        tokens: tuple[int, ...],
        logprobs: tuple[TokenLogprob, ...] | None,
    ) -> list[SequenceUpdate]:
        # Fork before the parent appends its own token: children copy its state.
        children = [
            self.fork(request, child_request_id(request.request_id, j), j)
            for j in range(1, len(tokens))
        ]
        updates = []
        for j, seq in enumerate([request, *children]):
            lp = logprobs[j] if logprobs else None
            parent_id = request.request_id if j > 0 else None
            updates.append(self._append(seq, tokens[j], lp, parent_id))
        return updates

    def _append(
        self,
        request: Request,
        token_id: int,
        logprob: TokenLogprob | None,
        parent_id: str | None = None,
    ) -> SequenceUpdate:
        """Append one sampled token, check the stops, say what happened."""
        request.append_output_token_ids(token_id)
        self._check_stop(request, token_id)
        lp = (logprob,) if logprob is not None else None
        return SequenceUpdate(request, (token_id,), lp, parent_id)

    def _check_stop(self, request: Request, token_id: int) -> None:
        status = stop_status(request, token_id, self.fit.max_tokens, self.config.max_model_len)
        if status is not None:
            self._finish(request, status)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.is_finished:
            return
        self.kv.free(request)  # a waiting request holds at most its pin
        for queue in (self.running, self.waiting, self.swapped):
            if request in queue:
                queue.remove(request)
        request.status = status
        self.requests.pop(request.request_id, None)
        self._arrival_order.pop(request.request_id, None)
        self.inflight.forget(request.request_id)
        self._finished_ids.add(request.request_id)

    # --------------------------------------------------------------- helpers

    def _enqueue(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self._arrival_order[request.request_id] = self._next_order
        self._next_order += 1

    def _priority_key(self, request: Request) -> tuple[int, float, int]:
        return (request.priority, request.arrival_time, self._arrival_order[request.request_id])

    def _victim_key(self, request: Request) -> tuple[int, float, int]:
        return self._priority_key(request)
