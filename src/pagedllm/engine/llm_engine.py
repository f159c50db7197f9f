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
whole group, with the error text: ``engine/retry.py``); the others get their normal
outputs. The retry cost is paid only on failure.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any

from pagedllm.core.outputs import ModelRunnerOutput, SchedulerOutput
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler, SequenceUpdate, child_request_id
from pagedllm.engine import builder
from pagedllm.engine.config import EngineConfig
from pagedllm.engine.constrained import ConstrainedRequests
from pagedllm.engine.elastic import elastic_pool
from pagedllm.engine.groups import RequestGroup
from pagedllm.engine.kv_plan import KVPlan, plan_of_runner
from pagedllm.engine.output_processor import OutputProcessor, RequestState
from pagedllm.engine.outputs import RequestDelta, RequestOutput
from pagedllm.engine.prompts import NO_TOKENIZER, tokenize_prompt
from pagedllm.engine.reports import EngineCounters, EngineStats, engine_stats
from pagedllm.engine.retry import describe, retry_alone
from pagedllm.engine.scoring import Scores, ScoringRequests
from pagedllm.engine.speculator import speculative_route, speculator_of
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams
from pagedllm.util.memory import release_freed_memory
from pagedllm.worker.base import ModelRunner

logger = logging.getLogger(__name__)


class LLMEngine:
    """Continuous batching over one ``ModelRunner`` (real or fake).

    ``tokenizer`` may be None when prompts are token ids (text is then empty).
    ``model_config`` (a ``ModelConfig``) gives the default ``max_model_len`` and the
    cache's groups. ``plan``: the sizes the runner's cache was made with
    (``engine/kv_plan.py``); without one, the runner's own sizes are taken as given.

    Its parts, each with its own job: ``scheduler`` (and ``kv``, its block manager),
    ``runner``, ``output_processor`` (the outputs of ``step``), ``elastic`` (resizes of
    the device tier between steps: ``engine/elastic.py``), ``disk_store`` (the disk tier,
    or None), ``counters`` (the totals ``get_stats`` reports: ``engine/reports.py``).
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
        self.max_model_len = builder.resolve_max_model_len(config, self.plan, model_config)
        self.disk_store, disk = builder.open_disk_tier(config, runner, self.plan)
        # A finalizer, not __del__: it holds the parts, not the engine, so it runs when
        # the engine is collected (a cycle through it included) and at interpreter exit.
        self._finalizer = weakref.finalize(self, builder.release, self.disk_store, runner)
        self.kv = builder.kv_manager(config, self.plan, model_config, disk)
        self._slice_tuner = builder.slice_tuner(config, self.max_model_len)
        self.scheduler = Scheduler(builder.scheduler_config(config, self.max_model_len), self.kv)
        # Speculative decoding (None: off): drafts before each schedule (engine/speculator.py).
        self.speculator = speculator_of(config, runner)
        if config.num_scheduler_steps > 1 and not runner.supports_multi_step:
            raise ValueError(
                f"num_scheduler_steps={config.num_scheduler_steps} needs a runner that runs "
                f"several decode steps per schedule ({type(runner).__name__} does not)"
            )
        self.eos_token_id, self._extra_eos_ids = builder.eos_ids(tokenizer, model_config)
        self._groups: dict[str, RequestGroup] = {}
        eos = [i for i in (self.eos_token_id, *self._extra_eos_ids) if i is not None]
        # Structured outputs: the compiler, the matchers, the requests waiting for a grammar.
        self.structured = ConstrainedRequests(
            self.scheduler, tokenizer, runner.vocab_size, eos, config.grammar_compile_limit_s
        )
        # The outputs of ``step``; a request has a state once ``step`` has advanced it.
        self.output_processor = OutputProcessor(tokenizer)
        # Requests a client extends itself (beam search): engine/scoring.py.
        self.scoring = ScoringRequests(self.scheduler, self.structured)
        self._seq_owner: dict[str, tuple[RequestGroup, int]] = {}
        self.counters = EngineCounters()
        self.routes = builder.with_dtype(runner.routes(), dtype_reason)
        if self.routes is not None:
            speculative = speculative_route(config.speculative_config)
            self.routes = replace(self.routes, speculative=speculative)
        self.startup_report: str | None = None  # set by from_config
        self.model_name: str | None = None  # set by from_config
        self.weight_bytes: int | None = None  # set by from_config: the model's, as held
        self.elastic = elastic_pool(config, self.kv, self.scheduler, runner, self.plan)
        if config.preemption_mode == "swap" and runner.num_host_blocks == 0:
            logger.warning(
                "preemption_mode='swap' without a host tier (swap_memory=0): "
                "preempted requests will be recomputed"
            )

    @classmethod
    def from_config(cls, config: EngineConfig, tokenizer: Any = None) -> LLMEngine:
        """Load the model, plan the cache once, start the runner (``engine/builder.py``).
        ``tokenizer``: the one to use rather than loading the model's (the core's
        ``DeferredTokenizer`` beside a server)."""
        backend = builder.attention_backend(config)
        loaded, runner, plan = builder.start_model(config, backend, tokenizer is None)
        try:
            engine = cls(
                config,
                runner,
                loaded.tokenizer if tokenizer is None else tokenizer,
                model_config=loaded.config,
                plan=plan,
                dtype_reason=loaded.dtype_reason,
            )
        except BaseException:
            builder.release(None, runner)  # the ranks started above; nobody else will stop them
            raise
        engine.model_name = loaded.name
        engine.weight_bytes = loaded.weight_bytes
        engine.startup_report = builder.startup_report(engine, loaded.weight_bytes)
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
        text, token_ids = tokenize_prompt(prompt, self.tokenizer, self.runner.vocab_size)
        if prompt_text is not None:
            if not isinstance(prompt_text, str):
                raise TypeError(f"prompt_text must be a string, got {prompt_text!r}")
            if text is not None:
                raise ValueError("prompt_text is only for prompts given as token ids")
            text = prompt_text
        params = self._complete_params(params, len(token_ids))
        seq_ids = [request_id] + [child_request_id(request_id, j) for j in range(1, params.n)]
        self._check_unused(request_id, seq_ids)
        request = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            priority=priority,
            cache_salt=cache_salt,
        )
        self.structured.queue(request)
        group = RequestGroup(request_id, text, tuple(token_ids), params, seq_ids)
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = {}
        self._groups[request_id] = group
        for j, seq_id in enumerate(seq_ids):
            self._seq_owner[seq_id] = (group, j)
        self.counters.prompt_tokens += len(token_ids)

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
            self.counters.aborted += 1
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
            self.structured.release([group.seq_ids[index]])
            seq = group.seqs.get(index)
            if seq is not None and seq.finish_reason is None:
                group.finish(seq, "stop", stop)
                seq.delta_finished = True  # the processor finished it: no delta says so again
        self._maybe_forget(group)

    # ------------------------------------------------------------- scoring requests

    def add_scoring_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        structured: StructuredOutputsParams | None = None,
    ) -> None:
        """Queue a request that is scored, never extended (``engine/scoring.py``): each
        ``step`` that computes its last token reports the top ``params.logprobs`` of the
        next one (``take_scores``) and appends nothing. ``structured``: a grammar masking
        its candidates (compiled now). ``ValueError`` for a request that can never fit or
        an id in use."""
        token_ids = self.tokenize(prompt_token_ids)
        self._check_unused(request_id)  # the scheduler checks live requests and the fit
        request = Request(request_id, token_ids, params, eos_token_id=self.eos_token_id)
        self.scoring.add(request, structured)

    def fork_scoring_request(self, parent_id: str, child_id: str, token_id: int) -> None:
        """A new scoring request: ``parent_id``'s tokens and ``token_id``, sharing the
        parent's blocks (a copy of its grammar state consumes the token)."""
        self._check_unused(child_id)
        self.scoring.fork(parent_id, child_id, token_id)

    def completes_grammar(self, request_id: str, token_id: int) -> bool:
        """Whether ``token_id`` would complete scoring request ``request_id``'s grammar."""
        return self.scoring.completes_grammar(request_id, token_id)

    def finish_scoring_requests(self, request_ids: Iterable[str], *, aborted: bool = False) -> None:
        """Finish scoring requests (unknown ids are ignored); frees their blocks."""
        status = RequestStatus.FINISHED_ABORTED if aborted else RequestStatus.FINISHED_STOPPED
        self.scoring.finish(request_ids, status)

    def take_scores(self) -> Scores:
        """The scores (and failures) of the scoring requests since the last call."""
        return self.scoring.take()

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """``ValueError`` (with both numbers) for a request that can never fit."""
        self.scheduler.check_fits(num_prompt_tokens, max_tokens)

    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        """A prompt's token ids, validated as ``add_request`` does."""
        return tokenize_prompt(prompt, self.tokenizer, self.runner.vocab_size)[1]

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups or self.scoring.live)

    def get_num_unfinished_requests(self) -> int:
        return len(self._groups) + len(self.scoring.live)

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

    def get_stats(self) -> EngineStats:
        """A snapshot for metrics and tests (``engine/reports.py``)."""
        return engine_stats(self)

    @property
    def max_prefill_tokens_while_decoding(self) -> int | None:
        """The scheduler's prompt-token cap for a step that also decodes, as it is now."""
        return self.scheduler.config.max_prefill_tokens_while_decoding

    @property
    def num_steps(self) -> int:
        """Model steps run so far (``get_stats().num_steps`` without the rest of the stats:
        a multi-step schedule counts each of its steps)."""
        return self.counters.steps

    def flush_disk_tier(self) -> None:
        """Wait until every block queued for the disk tier is written."""
        if self.disk_store is not None:
            self.disk_store.flush()

    def close(self) -> None:
        """Finish the disk tier's writes and stop its writer (idempotent). The engine's
        requests are untouched. A tensor-parallel runner stops its ranks. Done by itself
        when the engine is garbage-collected or the interpreter exits."""
        self._finalizer()
        self.structured.close()

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
            self.output_processor.process(self._take_delta(group))
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
        return [self._take_delta(g) for g in self._timed_step(on_scheduled)]

    def _timed_step(self, on_scheduled: Callable[[], None] | None = None) -> list[RequestGroup]:
        """The step between the elastic pool's hooks: the groups it failed, then those it
        advanced."""
        self.elastic.before_step()
        failed = [g for r, exc in self.structured.admit_compiled() for g in self._fail([r], exc)]
        if self.speculator is not None:
            self.speculator.forget_finished(self.scheduler)
        if not self.scheduler.has_unfinished_requests():
            return failed
        started = time.perf_counter()
        groups = self._step(on_scheduled)
        self.elastic.after_step(time.perf_counter() - started, time.monotonic())
        if not self.scheduler.has_unfinished_requests():
            # Idle: the steps' freed buffers back to the system, not held while nothing
            # runs (the next prompt step faults them in again: SmolLM2's 14 MiB, +2.6 ms).
            release_freed_memory()
        return failed + groups

    def _output_state(self, group: RequestGroup) -> RequestState:
        """The output processor's state of ``group``, made the first time ``step`` meets it
        (``step_deltas`` alone, the server's path, keeps none here)."""
        state = self.output_processor.requests.get(group.request_id)
        if state is None:
            state = self.output_processor.add_request(
                group.request_id, group.prompt, group.prompt_token_ids, group.params
            )
        return state

    def _step(self, on_scheduled: Callable[[], None] | None = None) -> list[RequestGroup]:
        single_step = False
        if self.speculator is not None:
            check = self.structured.allowed_drafts if len(self.structured.matchers) else None
            single_step = self.speculator.propose(self.scheduler, check)
        scheduler_output = self.structured.with_masks(
            self.scheduler.schedule(single_step=single_step)
        )
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
        failed: list[RequestGroup] = []
        culprits: dict[str, Exception] = {}
        if self._slice_tuner is not None:
            self._slice_tuner.start_step()
        started = time.perf_counter()
        try:
            result = self.runner.execute(forward)
        except Exception as exc:
            logger.warning("step failed (%s); retrying its sequences one by one", describe(exc))
            result, culprits = retry_alone(self.runner, forward)
            failed = self._fail_culprits(culprits)
        else:  # a retried step's time says nothing of one forward's
            self._time_prompt_slice(forward)
            if self.speculator is not None:
                self.speculator.time_step(forward, time.perf_counter() - started)
        if self.speculator is not None:
            self.speculator.observe(forward, result)
        self.counters.steps += forward.num_steps
        num_computed = forward.num_batched_tokens
        if culprits:
            num_computed -= sum(
                len(s.token_ids) for s in forward.scheduled if s.request_id in culprits
            )
        self.counters.computed_tokens += num_computed * forward.num_steps
        if result.prompt_logprobs:
            self._record_prompt_logprobs(forward, result)
        touched = {g.request_id: g for g in failed}
        for update in self.scheduler.update(forward, result):
            if update.request.score_only:
                self.scoring.record(update)
                continue
            refused = self.structured.advance(update)
            if refused is not None:
                error = RuntimeError(f"the grammar refused a token: {refused}")
                touched.update((g.request_id, g) for g in self._fail([update.request], error))
            group = self._apply(update)
            if group is not None:
                touched[group.request_id] = group
        return list(touched.values())

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

    # ------------------------------------------------------------------ internals

    def _record_prompt_logprobs(self, forward: SchedulerOutput, result: ModelRunnerOutput) -> None:
        for seq, logprobs in zip(forward.scheduled, result.prompt_logprobs, strict=True):
            owner = self._seq_owner.get(seq.request_id)
            if logprobs and owner is not None and owner[0].prompt_logprobs is not None:
                by_position = owner[0].prompt_logprobs
                for j, logprob in enumerate(logprobs):
                    by_position[seq.start_position + 1 + j] = logprob

    def _apply(self, update: SequenceUpdate) -> RequestGroup | None:
        """Record a sequence's new tokens and logprobs, and its finish."""
        request = update.request
        owner = self._seq_owner.get(request.request_id)
        if owner is None:
            return None
        group, index = owner
        seq = group.sequence(index, request)
        self.counters.generation_tokens += len(update.new_token_ids)
        if seq.logprobs is not None and update.new_logprobs:
            seq.logprobs.extend(update.new_logprobs)
        if request.is_finished:
            group.finish(seq, request.status.value, request.stop_reason)
        return group

    def _take_delta(self, group: RequestGroup) -> RequestDelta:
        """``group``'s delta; a finished group is forgotten."""
        delta = group.take_delta()
        self._maybe_forget(group)
        return delta

    def _maybe_forget(self, group: RequestGroup) -> None:
        if group.finished:
            self._forget(group)
            if group.error:
                self.counters.failed += 1
            else:
                self.counters.finished += 1

    def _fail_culprits(self, culprits: dict[str, Exception]) -> list[RequestGroup]:
        """Fail the groups of the sequences that raised, each with its own error."""
        failed: list[RequestGroup] = []
        for request_id, exc in culprits.items():
            request = self.scheduler.requests.get(request_id)
            if request is not None:
                failed.extend(self._fail([request], exc))
        return failed

    def _fail(self, requests: list[Request], exc: Exception) -> list[RequestGroup]:
        """Finish the groups of ``requests`` with ``exc`` (the caller reports and forgets
        them)."""
        groups: dict[str, RequestGroup] = {}
        for request in requests:
            if request.score_only and self.scoring.fail(request, describe(exc)):
                continue
            owner = self._seq_owner.get(request.request_id)
            if owner is not None:
                groups[owner[0].request_id] = owner[0]
        for group in groups.values():
            # A group is one answer: if one of its samples failed, so did it.
            self.scheduler.finish_requests(group.seq_ids, RequestStatus.FINISHED_ERROR)
            group.error = describe(exc)
            for seq in group.seqs.values():
                group.finish(seq, "error")
        return list(groups.values())

    def _forget(self, group: RequestGroup) -> None:
        self._groups.pop(group.request_id, None)
        for seq_id in group.seq_ids:
            self._seq_owner.pop(seq_id, None)
        self.structured.release(group.seq_ids)

    def _check_unused(self, request_id: str, seq_ids: Sequence[str] = ()) -> None:
        """``ValueError`` when ``request_id`` (or a sample id of it) names a request whose
        outputs are still held (the scheduler refuses ids of requests it still runs)."""
        if request_id in self._groups or any(i in self._seq_owner for i in (request_id, *seq_ids)):
            raise ValueError(f"request_id {request_id!r} is already in use")

    def _complete_params(self, params: SamplingParams, num_prompt_tokens: int) -> SamplingParams:
        params.check_vocabulary(self.runner.vocab_size)
        if params.max_tokens is None:
            params = params.with_max_tokens(self.scheduler.default_max_tokens(num_prompt_tokens))
        if self._extra_eos_ids and not params.ignore_eos:
            extra = tuple(i for i in self._extra_eos_ids if i not in params.stop_token_ids)
            if extra:
                params = replace(params, stop_token_ids=params.stop_token_ids + extra)
        return params.with_eos(self.eos_token_id)
