"""``LLMEngine``: requests in, one step at a time, cumulative outputs out.

The loop is three verbs::

    scheduler.schedule() -> runner.execute() -> scheduler.update()

``step_deltas`` reports each advanced request's new tokens (``RequestDelta``); ``step``
hands them to the ``OutputProcessor`` (text, stop strings, ``RequestOutput``), which the
server runs in its own process instead.

A request of ``n`` samples is one group: the parent computes the prompt once and
the scheduler forks ``n - 1`` children sharing its blocks. The engine never raises
out of ``step()`` because the runner failed. A step runs its block moves (swaps,
copy-on-write copies) first, as a runner call with nothing scheduled, then the
forward. If the moves fail, every request of the step finishes with
``finish_reason="error"`` (the cache can no longer be trusted). If the forward
fails, each sequence is re-run alone and only those that raise again fail (their
whole group, with the error text); the others get their normal outputs. The retry
cost is paid only on failure.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field, replace
from typing import Any

from pagedllm.core.accounting import WasteReport, group_wastes, waste
from pagedllm.core.hybrid_kv import HybridKVCacheManager
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_groups import kv_cache_layout
from pagedllm.core.outputs import ModelRunnerOutput, SchedulerOutput, TokenLogprob
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import (
    Scheduler,
    SchedulerConfig,
    SequenceUpdate,
    child_request_id,
)
from pagedllm.core.tiers import DiskTier
from pagedllm.engine.builder import start_model, startup_report
from pagedllm.engine.config import EngineConfig
from pagedllm.engine.elastic import ElasticPolicy, ElasticPool, ResizeReport
from pagedllm.engine.kv_plan import KVPlan, plan_of_runner
from pagedllm.engine.output_processor import OutputProcessor, RequestState
from pagedllm.engine.outputs import RequestDelta, RequestOutput, SequenceDelta
from pagedllm.engine.prefill_slice import SMALLEST_CAP, PrefillSliceTuner
from pagedllm.engine.reports import EngineStats
from pagedllm.engine.structured_outputs import (
    Grammar,
    GrammarCompiler,
    Match,
    SequenceMatchers,
)
from pagedllm.routes import Routes
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.base import ModelRunner, ResizableRunner, SupportsDiskTier
from pagedllm.worker.disk_store import DiskKVStore

# How long a step with nothing to run waits for a grammar being compiled (seconds): an
# idle loop then sleeps instead of spinning; a step with work never waits for one.
_IDLE_COMPILE_WAIT_S = 0.01
# Why a text prompt (or a stop string) is refused by an engine without a tokenizer.
NO_TOKENIZER = (
    "this engine has no tokenizer (skip_tokenizer_init / --skip-tokenizer-init): "
    "give prompts as token ids"
)
logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Sequence:
    """One completion of a group (internal): what ``step_deltas`` has reported of it."""

    index: int
    request: Request
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_sent: int = 0
    num_logprobs_sent: int = 0
    delta_finished: bool = False


@dataclass(slots=True)
class _Group:
    """One user request: its ``n`` sequences (internal)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]  # a tuple once: every step's output shares it
    params: SamplingParams
    seq_ids: list[str]
    seqs: dict[int, _Sequence] = field(default_factory=dict)
    error: str | None = None
    num_finished: int = 0  # sequences with a finish_reason (kept by `finish`)
    # prompt_logprobs by prompt position (1 ..), when asked for; a recomputed prompt
    # (after preemption) writes the same positions again.
    prompt_logprobs: dict[int, TokenLogprob] | None = None
    prompt_logprobs_sent: bool = False  # in a RequestDelta (step_deltas)

    @property
    def finished(self) -> bool:
        return self.error is not None or self.num_finished == self.params.n

    def prompt_logprobs_tuple(self) -> tuple[TokenLogprob | None, ...] | None:
        """vLLM's shape: one entry per prompt token, None for the first (nothing predicts
        it) and for positions not computed yet; None when not asked for."""
        if self.prompt_logprobs is None:
            return None
        found = self.prompt_logprobs.get
        return (None, *(found(p) for p in range(1, len(self.prompt_token_ids))))

    def take_prompt_logprobs(self) -> tuple[TokenLogprob | None, ...] | None:
        """The prompt logprobs once all positions are in (or the request ended), the first
        time only."""
        if self.prompt_logprobs is None or self.prompt_logprobs_sent:
            return None
        if len(self.prompt_logprobs) < len(self.prompt_token_ids) - 1 and not self.finished:
            return None
        self.prompt_logprobs_sent = True
        return self.prompt_logprobs_tuple()

    def finish(self, seq: _Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """Give ``seq`` its finish reason (once; a later call is ignored)."""
        if seq.finish_reason is None:
            seq.finish_reason, seq.stop_reason = reason, stop_reason
            self.num_finished += 1


class LLMEngine:
    """Continuous batching over one ``ModelRunner`` (real or fake).

    ``tokenizer`` may be None when prompts are token ids (text is then empty).
    ``model_config`` (a ``ModelConfig``) gives the default ``max_model_len`` and the
    cache's groups. ``plan``: the sizes the runner's cache was made with
    (``engine/kv_plan.py``); without one, the runner's own sizes are taken as given.
    """

    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        tokenizer: Any = None,
        *,
        model_config: Any = None,
        plan: KVPlan | None = None,
        dtype_reason: str = "",
    ) -> None:
        if config.block_size != runner.block_size:
            raise ValueError(
                f"block_size {config.block_size} differs from the runner's {runner.block_size}"
            )
        self.config = config
        self.runner = runner
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.plan = plan or plan_of_runner(config, runner)
        self.max_model_len = self._resolve_max_model_len(model_config)
        self.disk_store, disk = self._open_disk_tier(config, runner, self.plan)
        # A finalizer, not __del__: it holds the parts, not the engine, so it runs when
        # the engine is collected (a cycle through it included) and at interpreter exit.
        self._finalizer = weakref.finalize(self, _release, self.disk_store, runner)
        self.kv = _kv_manager(config, self.plan, model_config, disk)
        self._slice_tuner = _slice_tuner(config, self.max_model_len)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.resolved_max_num_batched_tokens(self.max_model_len),
                max_prefill_tokens_while_decoding=config.max_prefill_tokens_while_decoding,
                max_model_len=self.max_model_len,
                preemption_mode=config.preemption_mode,
                enable_chunked_prefill=config.enable_chunked_prefill,
                enable_inflight_sharing=config.enable_inflight_sharing,
                pin_waiting_prefixes=config.pin_waiting_prefixes,
                num_scheduler_steps=config.num_scheduler_steps,
            ),
            self.kv,
        )
        if config.num_scheduler_steps > 1 and not runner.supports_multi_step:
            raise ValueError(
                f"num_scheduler_steps={config.num_scheduler_steps} needs a runner that runs "
                f"several decode steps per schedule ({type(runner).__name__} does not)"
            )
        self.eos_token_id, self._extra_eos_ids = self._eos_ids(tokenizer, model_config)
        self._groups: dict[str, _Group] = {}
        # Structured outputs: the compiler (made for the first constrained request), one
        # matcher per constrained sequence, and the requests whose grammar is compiling.
        self._grammars: GrammarCompiler | None = None
        self.matchers = SequenceMatchers()
        self._compiling: dict[str, tuple[Request, Future[Grammar]]] = {}
        # The outputs of ``step``; a request has a state once ``step`` has advanced it.
        self.output_processor = OutputProcessor(tokenizer)
        self._seq_owner: dict[str, tuple[_Group, int]] = {}
        self._counters = dict.fromkeys(
            ("steps", "prompt", "generation", "computed", "finished", "failed", "aborted"), 0
        )
        self.routes = _with_dtype(runner.routes(), dtype_reason)
        self.startup_report: str | None = None  # set by from_config
        self.model_name: str | None = None  # set by from_config
        self.elastic = ElasticPool(
            self.kv,
            self.scheduler,
            runner,
            step_fraction=config.compaction_step_fraction,
            policy=_elastic_policy(config, runner, self.plan),
            free_bytes=lambda: _free_memory_bytes(config.device),
        )
        if self.elastic.policy is not None:
            self.scheduler.max_num_blocks = self.elastic.policy.max_blocks
        if config.preemption_mode == "swap" and runner.num_host_blocks == 0:
            logger.warning(
                "preemption_mode='swap' without a host tier (swap_memory=0): "
                "preempted requests will be recomputed"
            )

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        """Load the model, plan the cache once, start the runner (``engine/builder.py``)."""
        loaded, runner, plan = start_model(config, _attention_backend(config))
        try:
            engine = cls(
                config,
                runner,
                loaded.tokenizer,
                model_config=loaded.config,
                plan=plan,
                dtype_reason=loaded.dtype_reason,
            )
        except BaseException:
            _release(None, runner)  # the ranks started above; nobody else will stop them
            raise
        engine.model_name = loaded.name
        engine.startup_report = startup_report(engine)
        logger.info("%s", engine.startup_report)
        return engine

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        prompt_text: str | None = None,
    ) -> None:
        """Queue a request. ``ValueError``/``TypeError`` for bad input, a request id
        in use, or a request that can never fit (prompt + max_tokens too long).

        ``prompt_text``: when ``prompt`` is token ids, the text its outputs report
        as ``prompt`` (for example a rendered chat template); never tokenized."""
        if not isinstance(request_id, str) or not request_id:
            raise TypeError(f"request_id must be a non-empty string, got {request_id!r}")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if self.tokenizer is None and params.stop:
            raise ValueError(f"{NO_TOKENIZER}; stop strings need one (use stop_token_ids)")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise TypeError(f"priority must be an integer, got {priority!r}")
        text, token_ids = self._tokenize(prompt)
        if prompt_text is not None:
            if not isinstance(prompt_text, str):
                raise TypeError(f"prompt_text must be a string, got {prompt_text!r}")
            if text is not None:
                raise ValueError("prompt_text is only for prompts given as token ids")
            text = prompt_text
        params = self._complete_params(params, len(token_ids))
        seq_ids = [request_id] + [child_request_id(request_id, j) for j in range(1, params.n)]
        for seq_id in seq_ids:
            if request_id in self._groups or seq_id in self._seq_owner:
                raise ValueError(f"request_id {request_id!r} is already in use")
        request = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            priority=priority,
            cache_salt=cache_salt,
        )
        self._queue(request)
        group = _Group(request_id, text, tuple(token_ids), params, seq_ids)
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = {}
        self._groups[request_id] = group
        for j, seq_id in enumerate(seq_ids):
            self._seq_owner[seq_id] = (group, j)
        self._counters["prompt"] += len(token_ids)

    def _queue(self, request: Request) -> None:
        """To the scheduler; a constrained request whose grammar is still compiling waits
        beside it (``_admit_compiled``), so no step waits for a compile. A grammar the
        engine refuses raises ``ValueError`` here when its compile is already done."""
        structured = request.sampling_params and request.sampling_params.structured_outputs
        if not structured:
            self.scheduler.add_request(request)
            return
        future = self.grammar_compiler().submit(structured)
        if not future.done():
            params = request.sampling_params
            self.scheduler.check_fits(request.num_prompt_tokens, params.max_tokens, params.n)
            self._compiling[request.request_id] = (request, future)
            return
        grammar = future.result()
        self.scheduler.add_request(request)
        self.matchers.add(request.request_id, grammar)

    def grammar_compiler(self) -> GrammarCompiler:
        """The structured-outputs compiler of this engine's tokenizer (made on first use);
        ``ValueError`` without a tokenizer."""
        if self._grammars is None:
            eos = [i for i in (self.eos_token_id, *self._extra_eos_ids) if i is not None]
            self._grammars = GrammarCompiler(self.tokenizer, self.runner.vocab_size, eos)
        return self._grammars

    def check_structured_outputs(self, params: SamplingParams) -> None:
        """Compile ``params.structured_outputs`` now (at most the compiler's time limit):
        ``ValueError`` naming the field and the unsupported feature, before any request
        is added (``LLM`` calls it: offline, the caller's thread is the API's)."""
        structured = getattr(params, "structured_outputs", None)  # add_request checks the type
        if structured is not None:
            self.grammar_compiler().compile(structured)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Stop requests (unknown or finished ids are ignored); frees their blocks."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for request_id in request_ids:
            group = self._groups.get(request_id)
            if group is None:
                continue
            self.scheduler.finish_requests(group.seq_ids, RequestStatus.FINISHED_ABORTED)
            self._forget(group)
            self._counters["aborted"] += 1
            self.output_processor.abort_request(request_id)

    def stop_sequences(self, request_id: str, stopped: Iterable[tuple[int, str]]) -> None:
        """Finish the sequences a stop string ended, as (index, stop string): the output
        processor finds them (in the server's process on the server path, a step or so
        later). Unknown requests and finished sequences are ignored."""
        group = self._groups.get(request_id)
        if group is None:
            return
        for index, stop in stopped:
            self.scheduler.finish_requests([group.seq_ids[index]], RequestStatus.FINISHED_STOPPED)
            self.matchers.release([group.seq_ids[index]])
            seq = group.seqs.get(index)
            if seq is not None and seq.finish_reason is None:
                group.finish(seq, "stop", stop)
                seq.delta_finished = True  # the processor finished it: no delta says so again
        self._maybe_forget(group)

    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        """A prompt's token ids, validated as ``add_request`` does."""
        return self._tokenize(prompt)[1]

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    def get_num_unfinished_requests(self) -> int:
        return len(self._groups)

    def unfinished_request_ids(self) -> list[str]:
        return list(self._groups)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt block, so the next prompts are computed in full (vLLM's
        name; for benchmarks that repeat a workload, and after changing weights). Refused
        (False, nothing changed) while requests are unfinished: their blocks are indexed
        too, and they would go on being found."""
        if self.has_unfinished_requests():
            return False
        self.kv.evict_cached_blocks()
        return True

    # ------------------------------------------------------------------ the elastic pool

    def resize_kv_cache(self, num_bytes: int, *, preempt: bool = False) -> ResizeReport:
        """Resize the KV cache's device tier to ``num_bytes`` now (compaction, then the
        tail given back; or grown in place). A shrink stops above what running requests
        hold (plus a block each) and the largest unfinished request's need, unless
        ``preempt``; the report says so. See ``engine/elastic.py``."""
        return self.elastic.resize(num_bytes, preempt=preempt)

    def start_resize(
        self,
        num_bytes: int,
        preempt: bool = False,
        *,
        on_done: Callable[[ResizeReport], None] | None = None,
    ) -> int:
        """Begin a resize carried out between the next steps in bounded slices, so running
        requests keep generating; ``on_done`` gets the report. Returns the resize's id."""
        return self.elastic.start(num_bytes, preempt=preempt, on_done=on_done)

    def resize_report(self, resize_id: int) -> dict[str, Any] | None:
        """The report of a resize ``start_resize`` began, as a dict, once it is done
        (None while under way): for a server that polls across a process boundary."""
        report = self.elastic.report_for(resize_id)
        return None if report is None else report.to_dict()

    def max_num_tokens(self) -> int:
        """The most tokens (prompt + ``max_tokens``) one request may have now
        (``Scheduler.max_num_tokens``: the server checks requests against it)."""
        return self.scheduler.max_num_tokens()

    def cache_capacity_blocks(self) -> int:
        """The most device blocks one request may count on: the pool's size (the target
        of a shrink under way), or the automatic elastic pool's MAX."""
        return max(self.kv.usable_blocks, self.scheduler.max_num_blocks or 0)

    def elastic_tick(self) -> None:
        """Let the automatic elastic policy act while no step runs (an idle server's
        timer calls this); a shrink under way with nothing running completes."""
        if self.elastic.resizing and not self.scheduler.has_unfinished_requests():
            self.elastic.finish_now()
        self.elastic.tick(time.monotonic())

    # ------------------------------------------------------------------ the step

    def step(self, *, finished_only: bool = False) -> list[RequestOutput]:
        """Run one step; returns the outputs of the requests it advanced, or with
        ``finished_only`` only of those it finished (or failed): offline generation needs no
        others, and building one per running request every step costs a good share of a
        decode step's Python time. A shrink under way takes a bounded slice of compaction
        first. The sequences a stop string ended are finished before the next step."""
        outputs = []
        for group in self._timed_step():
            state = self._output_state(group)
            self.output_processor.process(self._delta_and_maybe_forget(group))
            stopped = state.take_stopped()
            if stopped:
                self.stop_sequences(state.request_id, stopped)
            if state.finished or not finished_only:
                outputs.append(state.output())
        return outputs

    def step_deltas(self, on_scheduled: Callable[[], None] | None = None) -> list[RequestDelta]:
        """Run one step; per advanced request, the token ids and logprobs new since the
        last call and the finish reasons. No text is decoded here: stop strings are the
        output processor's (``step``'s, or the server's in its own process).
        ``on_scheduled()`` runs once the step is scheduled, before the model runs (the
        core pushes the cache events of the schedule's evictions then)."""
        return [self._delta_and_maybe_forget(g) for g in self._timed_step(on_scheduled)]

    def _timed_step(self, on_scheduled: Callable[[], None] | None = None) -> list[_Group]:
        """The step between the elastic pool's hooks: the groups it failed, then those it
        advanced."""
        self.elastic.before_step()
        failed = self._admit_compiled()
        if not self.scheduler.has_unfinished_requests():
            return failed
        started = time.perf_counter()
        groups = self._step(on_scheduled)
        self.elastic.after_step(time.perf_counter() - started, time.monotonic())
        return failed + groups

    def _admit_compiled(self) -> list[_Group]:
        """Hand the requests whose grammar has compiled to the scheduler; fail those whose
        grammar was refused. Waits briefly only when there is nothing else to run."""
        if not self._compiling:
            return []
        if not self.scheduler.has_unfinished_requests():
            futures = [future for _, future in self._compiling.values()]
            wait(futures, timeout=_IDLE_COMPILE_WAIT_S, return_when=FIRST_COMPLETED)
        failed: list[_Group] = []
        for request_id, (request, future) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[request_id]
            try:
                grammar = future.result()
                self.scheduler.add_request(request)
            except ValueError as exc:
                failed.extend(self._fail([request], exc))
                continue
            self.matchers.add(request_id, grammar)
        return failed

    def _output_state(self, group: _Group) -> RequestState:
        """The output processor's state of ``group``, made the first time ``step`` meets it
        (``step_deltas`` alone, the server's path, keeps none here)."""
        state = self.output_processor.requests.get(group.request_id)
        if state is None:
            state = self.output_processor.add_request(
                group.request_id, group.prompt, group.prompt_token_ids, group.params
            )
        return state

    def _step(self, on_scheduled: Callable[[], None] | None = None) -> list[_Group]:
        scheduler_output = self.scheduler.schedule()
        if len(self.matchers):
            masks = self.matchers.bitmasks(scheduler_output.scheduled)
            scheduler_output = replace(scheduler_output, token_bitmasks=masks)
        if on_scheduled is not None:
            on_scheduled()
        forward = scheduler_output
        if scheduler_output.has_block_moves:
            # The moves run alone first: if they fail, nobody's cache can be trusted
            # and every request of the step fails; if they succeed, a failing forward
            # can be retried sequence by sequence without repeating them.
            try:
                moved = self.runner.execute(replace(scheduler_output, scheduled=()))
            except Exception as exc:  # one bad step must not take the engine down
                logger.exception("block moves failed; failing the step's requests")
                return self._fail(self.scheduler.fail_last_step(), exc)
            forward = SchedulerOutput(
                scheduled=scheduler_output.scheduled,
                num_steps=scheduler_output.num_steps,
                token_bitmasks=scheduler_output.token_bitmasks,
            )
            if moved.failed_loads:
                # Their holders go back to waiting and are recomputed: a miss, not an error.
                logger.warning("%d KV blocks failed to load from disk", len(moved.failed_loads))
                forward = self.scheduler.reject_loads(forward, moved.failed_loads)
        failed: list[_Group] = []
        culprits: dict[str, Exception] = {}
        if self._slice_tuner is not None:
            self._slice_tuner.start_step()
        try:
            result = self.runner.execute(forward)
        except Exception as exc:
            logger.warning("step failed (%s); retrying its sequences one by one", _describe(exc))
            result, culprits = self._retry_alone(forward)
            failed = self._fail_culprits(culprits)
        else:  # a retried step's time says nothing of one forward's
            self._time_prompt_slice(forward)
        self._counters["steps"] += forward.num_steps
        num_computed = forward.num_batched_tokens
        if culprits:
            num_computed -= sum(
                len(s.token_ids) for s in forward.scheduled if s.request_id in culprits
            )
        self._counters["computed"] += num_computed * forward.num_steps
        if result.prompt_logprobs:
            self._record_prompt_logprobs(forward, result)
        touched = {g.request_id: g for g in failed}
        for update in self.scheduler.update(forward, result):
            if len(self.matchers):
                for group in self._advance_grammar(update):
                    touched[group.request_id] = group
            group = self._apply(update)
            if group is not None:
                touched[group.request_id] = group
        return list(touched.values())

    def _advance_grammar(self, update: SequenceUpdate) -> list[_Group]:
        """Feed a constrained sequence's new tokens to its matcher; finish it ("stop") when
        its grammar is complete. A parallel sample forked this step gets a matcher rebuilt
        from its own output tokens. A token the grammar refuses fails the request (the
        mask makes that a bug, never a guess); returns the groups it failed."""
        request = update.request
        seq_id = request.request_id
        params = request.sampling_params
        if params is None or params.structured_outputs is None:
            return []
        if request.is_finished:
            self.matchers.release([seq_id])
            return []
        grammar = None
        if seq_id not in self.matchers and update.parent_id is not None:
            grammar = self.matchers.grammar_of(update.parent_id)
        state = self.matchers.advance(seq_id, request.output_token_ids, grammar)
        if state is Match.COMPLETE:
            self.scheduler.finish_requests([seq_id], RequestStatus.FINISHED_STOPPED)
            self.matchers.release([seq_id])
        elif state is Match.REJECTED:
            reason = self.matchers.error(seq_id)
            return self._fail([request], RuntimeError(f"the grammar refused a token: {reason}"))
        return []

    def _time_prompt_slice(self, forward: SchedulerOutput) -> None:
        """With ``max_prefill_time_while_decoding_s``: the step's end to the tuner, and the
        scheduler's prompt-token cap to what it answers."""
        if self._slice_tuner is None:
            return
        prompt_tokens = sum(len(s.token_ids) for s in forward.scheduled if len(s.token_ids) > 1)
        self._slice_tuner.end_step(prompt_tokens, forward.num_steps)
        cap = self._slice_tuner.cap()
        config = self.scheduler.config
        if cap is not None and cap != config.max_prefill_tokens_while_decoding:
            logger.debug("prompt tokens in a decoding step: %d", cap)
            self.scheduler.config = replace(config, max_prefill_tokens_while_decoding=cap)

    @property
    def max_prefill_tokens_while_decoding(self) -> int | None:
        """The scheduler's prompt-token cap for a step that also decodes, as it is now."""
        return self.scheduler.config.max_prefill_tokens_while_decoding

    @property
    def num_steps(self) -> int:
        """Model steps run so far (``get_stats().num_steps`` without the rest of the stats:
        a multi-step schedule counts each of its steps)."""
        return self._counters["steps"]

    def get_stats(self) -> EngineStats:
        s = self.scheduler.stats()
        c = self._counters
        waste_inputs = self._waste_inputs()  # one pass over the live tokens for both wastes
        return EngineStats(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            num_swapped=s.num_swapped,
            num_unfinished_requests=len(self._groups),
            num_preemptions=s.num_preemptions,
            num_preemptions_recompute=s.num_preemptions_recompute,
            num_preemptions_swap=s.num_preemptions_swap,
            num_steps=c["steps"],
            num_prompt_tokens=c["prompt"],
            num_generation_tokens=c["generation"],
            num_computed_tokens=c["computed"],
            num_requests_finished=c["finished"],
            num_requests_failed=c["failed"],
            num_requests_aborted=c["aborted"],
            kv_cache_usage=self.kv.usage,
            max_prefill_tokens_while_decoding=self.max_prefill_tokens_while_decoding,
            max_model_len=self.max_model_len,
            cache=self.kv.stats(),
            num_inflight_shared_tokens=s.num_inflight_shared_tokens,
            num_inflight_waits=s.num_inflight_waits,
            num_pins_given_up=s.num_pins_given_up,
            waste=waste(self.kv, *waste_inputs),
            group_waste=self._group_waste(waste_inputs),
            disk=self.disk_store.stats() if self.disk_store is not None else None,
            elastic=self.elastic.stats() if isinstance(self.runner, ResizableRunner) else None,
            routes=self.routes,
            kv_cache_dtype=self.plan.kv_cache_dtype,
            kv_bytes_per_token=self.plan.bytes_per_token,
        )

    def flush_disk_tier(self) -> None:
        """Wait until every block queued for the disk tier is written."""
        if self.disk_store is not None:
            self.disk_store.flush()

    def close(self) -> None:
        """Finish the disk tier's writes and stop its writer (idempotent). The engine's
        requests are untouched. A tensor-parallel runner stops its ranks. Done by itself
        when the engine is garbage-collected or the interpreter exits."""
        self._finalizer()
        if self._grammars is not None:
            self._grammars.close()

    # ------------------------------------------------------------------ internals

    @staticmethod
    def _open_disk_tier(
        config: EngineConfig, runner: ModelRunner, plan: KVPlan
    ) -> tuple[DiskKVStore | None, DiskTier | None]:
        """The store in ``config.kv_offload_dir`` (attached to the runner) and the core's
        books of it, the plan's size; (None, None) without a directory."""
        if config.kv_offload_dir is None:
            return None, None
        if not isinstance(runner, SupportsDiskTier):
            raise ValueError(f"{type(runner).__name__} cannot run a disk tier (kv_offload_dir)")
        store = DiskKVStore(
            config.kv_offload_dir,
            runner.kv_fingerprint(),
            block_size=runner.block_size,
            payload_nbytes=runner.block_nbytes,
            first_payload_nbytes=runner.first_block_nbytes,
        )
        runner.attach_disk_store(store)
        return store, DiskTier(plan.num_disk_blocks, store.scan())

    def _group_waste(
        self, waste_inputs: tuple[dict[str, Any] | None, int | None]
    ) -> tuple[WasteReport, ...]:
        if not isinstance(self.kv, HybridKVCacheManager):
            return ()
        return tuple(group_wastes(self.kv, *waste_inputs))

    def _waste_inputs(self) -> tuple[dict[str, Any] | None, int | None]:
        """What the cache's three wastes are measured from (``core.accounting.waste``): the
        live requests' tokens and the next waiting request's length (linear in the live
        tokens; only ``get_stats`` pays for it)."""
        requests = self.scheduler.requests
        tables = self.kv.live_block_tables()
        token_ids = None
        if all(rid in requests for rid in tables):
            token_ids = {rid: requests[rid].all_token_ids for rid in tables}
        next_len = None
        if self.scheduler.waiting:
            # Admission order (see Scheduler): priority, then arrival.
            first = min(self.scheduler.waiting, key=lambda r: (r.priority, r.arrival_time))
            next_len = first.num_prompt_tokens + self.scheduler.max_tokens(first)
        return token_ids, next_len

    def _record_prompt_logprobs(self, forward: SchedulerOutput, result: ModelRunnerOutput) -> None:
        for seq, logprobs in zip(forward.scheduled, result.prompt_logprobs, strict=True):
            owner = self._seq_owner.get(seq.request_id)
            if logprobs and owner is not None and owner[0].prompt_logprobs is not None:
                by_position = owner[0].prompt_logprobs
                for j, logprob in enumerate(logprobs):
                    by_position[seq.start_position + 1 + j] = logprob

    def _apply(self, update: SequenceUpdate) -> _Group | None:
        """Record a sequence's new tokens and logprobs, and its finish."""
        request = update.request
        owner = self._seq_owner.get(request.request_id)
        if owner is None:
            return None
        group, index = owner
        seq = group.seqs.get(index)
        if seq is None:
            wants = group.params.logprobs is not None
            seq = group.seqs[index] = _Sequence(index, request, [] if wants else None)
        self._counters["generation"] += len(update.new_token_ids)
        if seq.logprobs is not None and update.new_logprobs:
            seq.logprobs.extend(update.new_logprobs)
        if request.is_finished:
            group.finish(seq, request.status.value, request.stop_reason)
        return group

    def _delta_and_maybe_forget(self, group: _Group) -> RequestDelta:
        deltas = [self._sequence_delta(group.seqs[i]) for i in sorted(group.seqs)]
        if group.error is not None and not deltas:
            deltas = [SequenceDelta(0, (), finish_reason="error")]
        first = group.seqs.get(0)
        self._maybe_forget(group)
        return RequestDelta(
            request_id=group.request_id,
            seqs=tuple(d for d in deltas if d.token_ids or d.finish_reason or d.logprobs),
            finished=group.finished,
            num_cached_tokens=first.request.num_cached_tokens if first else 0,
            error=group.error,
            cache_event_seq=first.request.cache_event_seq if first else None,
            prompt_logprobs=group.take_prompt_logprobs(),
            arrival_event_seq=first.request.arrival_event_seq if first else None,
        )

    @staticmethod
    def _sequence_delta(seq: _Sequence) -> SequenceDelta:
        """``seq``'s tokens and logprobs since the last delta (then marked sent)."""
        tokens = seq.request.output_token_ids
        new_ids = tuple(tokens[seq.num_sent :])
        seq.num_sent = len(tokens)
        logprobs = None
        if seq.logprobs is not None:
            logprobs = tuple(seq.logprobs[seq.num_logprobs_sent :])
            seq.num_logprobs_sent = len(seq.logprobs)
        finish = seq.finish_reason
        if finish is not None and seq.delta_finished:
            finish = None  # reported once
        seq.delta_finished = finish is not None or seq.delta_finished
        return SequenceDelta(seq.index, new_ids, logprobs, finish, seq.stop_reason)

    def _maybe_forget(self, group: _Group) -> None:
        if group.finished:
            self._forget(group)
            self._counters["failed" if group.error else "finished"] += 1

    def _retry_alone(
        self, forward: SchedulerOutput
    ) -> tuple[ModelRunnerOutput, dict[str, Exception]]:
        """Re-run each sequence of a failed forward on its own; returns the outputs
        aligned with ``forward.scheduled`` (empty for a culprit) and the culprits.

        Rewriting a sequence's new-token slots is safe: the retry writes the same
        tokens at the same positions (so the same K/V), and those slots lie only in
        blocks the sequence holds alone. A block shared by several sequences is
        either full (prefix-cache hits and fork ancestors; full blocks are never
        written again, and a cache hit stops one token short of the prompt so the
        recomputed last token lands in a fresh block) or the partial last block of
        a fork, which copy-on-write duplicated in this step's block moves, already
        done. Blocks written this step are registered in the prefix cache only
        after the step succeeds (``scheduler.update``), so no other sequence can
        have read them. A parent of ``n`` samples is retried with the same
        ``num_samples``; children are forked only once its sampling succeeded.

        Limit: a seeded request's generator advances when the sampler draws. If the
        batched attempt failed *after* its draws (an error in the sampler's last
        stages or a deferred device error), the retry draws the next values and the
        seeded request's token differs from an undisturbed run. Forward-pass errors
        and ``FakeModelRunner``'s injected failures come before any draw, so for
        them the retry reproduces the exact tokens.
        """
        n = len(forward.scheduled)
        sampled: list[tuple[int, ...]] = [()] * n
        logprobs: list[tuple[TokenLogprob, ...] | None] = [None] * n
        prompt_logprobs: list[tuple[TokenLogprob, ...] | None] = [None] * n
        culprits: dict[str, Exception] = {}
        finished_ids = forward.finished_request_ids  # releasing twice is harmless
        for i, seq in enumerate(forward.scheduled):
            mask = forward.token_bitmasks.get(seq.request_id)
            alone = SchedulerOutput(
                scheduled=(seq,),
                finished_request_ids=finished_ids,
                token_bitmasks={seq.request_id: mask} if mask is not None else {},
            )
            try:
                result = self.runner.execute(alone)
            except Exception as exc:
                logger.error("request %r failed: %s", seq.request_id, _describe(exc))
                culprits[seq.request_id] = exc
                continue
            if result.sampled_token_ids:
                sampled[i] = tuple(result.sampled_token_ids[0])
            if result.logprobs:
                logprobs[i] = result.logprobs[0]
            if result.prompt_logprobs:
                prompt_logprobs[i] = result.prompt_logprobs[0]
        output = ModelRunnerOutput(tuple(sampled), tuple(logprobs), tuple(prompt_logprobs))
        return output, culprits

    def _fail_culprits(self, culprits: dict[str, Exception]) -> list[_Group]:
        """Fail the groups of the sequences that raised, each with its own error."""
        failed: list[_Group] = []
        for request_id, exc in culprits.items():
            request = self.scheduler.requests.get(request_id)
            if request is not None:
                failed.extend(self._fail([request], exc))
        return failed

    def _fail(self, requests: list[Request], exc: Exception) -> list[_Group]:
        """Finish the groups of ``requests`` with ``exc`` (the caller reports and forgets
        them)."""
        groups: dict[str, _Group] = {}
        for request in requests:
            owner = self._seq_owner.get(request.request_id)
            if owner is not None:
                groups[owner[0].request_id] = owner[0]
        for group in groups.values():
            # A group is one answer: if one of its samples failed, so did it.
            self.scheduler.finish_requests(group.seq_ids, RequestStatus.FINISHED_ERROR)
            group.error = _describe(exc)
            for seq in group.seqs.values():
                group.finish(seq, "error")
        return list(groups.values())

    def _forget(self, group: _Group) -> None:
        self._groups.pop(group.request_id, None)
        for seq_id in group.seq_ids:
            self._seq_owner.pop(seq_id, None)
            self._compiling.pop(seq_id, None)
        self.matchers.release(group.seq_ids)

    def _tokenize(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(NO_TOKENIZER)
            token_ids = list(self.tokenizer.encode(prompt))
            text: str | None = prompt
        elif isinstance(prompt, Sequence) and not isinstance(prompt, bytes | bytearray):
            token_ids = list(prompt)
            text = None
        else:
            raise TypeError(f"prompt must be a string or a list of token ids, got {prompt!r}")
        if not token_ids:
            raise ValueError("prompt must contain at least one token")
        vocab = self.runner.vocab_size
        for token in token_ids:
            if isinstance(token, bool) or not isinstance(token, int):
                raise TypeError(f"prompt token ids must be integers, got {token!r}")
            if not 0 <= token < vocab:
                raise ValueError(f"prompt token id {token} is outside the vocabulary [0, {vocab})")
        return text, token_ids

    def _complete_params(self, params: SamplingParams, num_prompt_tokens: int) -> SamplingParams:
        params.check_vocabulary(self.runner.vocab_size)
        if params.max_tokens is None:
            params = params.with_max_tokens(self.scheduler.default_max_tokens(num_prompt_tokens))
        if self._extra_eos_ids and not params.ignore_eos:
            extra = tuple(i for i in self._extra_eos_ids if i not in params.stop_token_ids)
            if extra:
                params = replace(params, stop_token_ids=params.stop_token_ids + extra)
        return params.with_eos(self.eos_token_id)

    def _resolve_max_model_len(self, model_config: Any) -> int:
        cache_tokens = self.plan.max_num_blocks * self.plan.block_size
        model_limit = getattr(model_config, "max_position_embeddings", None)
        window = None if model_config is None else model_config.uniform_sliding_window
        requested = self.config.max_model_len
        if requested is None and window is not None:
            # Blocks out of the window are released: the cache does not bound the length.
            return model_limit
        if requested is None:
            return min(model_limit or cache_tokens, cache_tokens)
        if model_limit is not None and requested > model_limit:
            raise ValueError(
                f"max_model_len ({requested}) exceeds the model's limit ({model_limit})"
            )
        if window is None and requested > cache_tokens:
            raise ValueError(
                f"max_model_len ({requested} tokens) exceeds the whole KV cache "
                f"({cache_tokens} tokens): raise --kv-cache-memory or lower --max-model-len"
            )
        return requested

    @staticmethod
    def _eos_ids(tokenizer: Any, model_config: Any) -> tuple[int | None, tuple[int, ...]]:
        eos = getattr(tokenizer, "eos_token_id", None)
        config_ids = tuple(getattr(model_config, "eos_token_ids", ()) or ())
        if eos is None and config_ids:
            eos = config_ids[0]
        return eos, tuple(i for i in config_ids if i != eos)


def _with_dtype(routes: Routes | None, dtype_reason: str) -> Routes | None:
    """The runner's routes with the model's dtype and why it runs in it."""
    if routes is None or not dtype_reason:
        return routes
    return replace(routes, dtype_reason=dtype_reason)


def _elastic_policy(
    config: EngineConfig, runner: ModelRunner, plan: KVPlan
) -> ElasticPolicy | None:
    """The automatic policy of ``--kv-cache-memory MIN:MAX`` (MIN is the start size)."""
    if config.kv_cache_memory_max is None:
        return None
    if not isinstance(runner, ResizableRunner):
        raise ValueError(f"kv_cache_memory_max: {type(runner).__name__} cannot resize")
    return ElasticPolicy(plan.num_blocks, plan.max_num_blocks, idle_s=config.elastic_idle_s)


def _release(disk_store: DiskKVStore | None, runner: ModelRunner) -> None:
    """What ``LLMEngine.close`` releases: the disk tier's writer, the runner's ranks."""
    if disk_store is not None:
        disk_store.close()
    runner.close()


def _kv_manager(
    config: EngineConfig, plan: KVPlan, model_config: Any, disk: DiskTier | None
) -> KVCacheManager | HybridKVCacheManager:
    """The block manager for the model: one per KV cache group (``core/kv_groups.py``)
    when it mixes attention kinds (Gemma's local and global layers), else one."""
    windows = None if model_config is None else model_config.sliding_windows
    layout = None if windows is None else kv_cache_layout(windows)
    if layout is not None and len(layout.groups) > 1:
        if disk is not None:
            raise ValueError(
                "the disk tier does not take models mixing sliding-window and "
                "full-attention layers yet"
            )
        return HybridKVCacheManager(
            plan.num_blocks,
            plan.block_size,
            layout.windows,
            enable_prefix_caching=config.enable_prefix_caching,
            watermark=config.watermark,
        )
    return KVCacheManager(
        plan.num_blocks,
        plan.block_size,
        enable_prefix_caching=config.enable_prefix_caching,
        num_host_blocks=plan.num_host_blocks,
        watermark=config.watermark,
        disk=disk,
        sliding_window=None if layout is None else layout.windows[0],
        # Each cached-free first block keeps a staging slot: as many as running sequences.
        max_cached_first_blocks=config.max_num_seqs if config.unquantized_first_block else None,
    )


def _free_memory_bytes(device: str) -> int:
    from pagedllm.worker.kv_cache import available_memory_bytes

    return available_memory_bytes(device)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _attention_backend(config: EngineConfig) -> Any:
    """The backend named by ``config.attention_backend`` ("auto" picks the fastest)."""
    from pagedllm.attention.select import get_backend

    name = config.attention_backend
    return get_backend("auto" if name is None else name)


def _slice_tuner(config: EngineConfig, max_model_len: int) -> PrefillSliceTuner | None:
    if config.max_prefill_time_while_decoding_s is None or not config.enable_chunked_prefill:
        return None
    # A token cap given too is the most the tuner picks (and the cap until it has timed a step).
    largest = config.resolved_max_num_batched_tokens(max_model_len)
    if config.max_prefill_tokens_while_decoding is not None:
        largest = min(largest, config.max_prefill_tokens_while_decoding)
    largest = max(largest, SMALLEST_CAP)
    return PrefillSliceTuner(config.max_prefill_time_while_decoding_s, largest)
