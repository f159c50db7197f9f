"""``EngineCore``: the scheduler, model runner and sampler (an ``LLMEngine``) behind a
message loop.

::

    API server process (asyncio)               engine core (own process, or a thread)
    ----------------------------               -------------------------------------
    AsyncEngine   --- input socket (PUSH) -->  run_core_loop: between two steps, runs
                                                 the calls (AddRequests, GetStats, ...)
                                                 AbortRequests, StopSequences, Shutdown
                  <-- output socket (PULL) --  Ready(info)                (once, first)
                                               Deltas(request deltas)     (per step)
                                               Returned / Raised          (a call's answer)
                                               CacheEvents(batch)   (once watched: see below)
                                               Dead(reason)               (the loop broke)

Every message is one frame over ZeroMQ, a record of ``engine/messages.py`` encoded by its
``Codec``. A step sends each advanced request's new token ids (``RequestDelta``); the
server builds the outputs (``OutputProcessor``: text, stop strings) and sends
``StopSequences`` for the sequences a stop string ended. ``LLM`` (offline) drives the
same ``LLMEngine`` in its own thread, with no loop and no sockets.

Calls: the core answers the calls ``messages.py`` declares, each with its handler in
``EngineCore.handlers``, and nothing else: a frame naming anything else is answered
with a ValueError. A new engine feature that the server must reach is a new ``Call``,
its handler here and its method on ``AsyncEngine``.

Cache events (a router's feed): after ``WatchEvents``, the core pushes ``CacheEvents``
whenever the prefix cache's event log moved -- after the step's schedule (the
evictions its allocations made, before the model runs) and after the step (the blocks
it registered) -- so a reader's view lags the index by a message, not a poll. A batch
is ``events_report``'s answer (``GET /v1/cache/events``'s body, hashes as hex) from
where the last push ended; successive batches are contiguous (a new ``epoch`` means a
new log: read a snapshot).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from pagedllm.engine import messages as m
from pagedllm.engine.messages import Codec, EngineInfo, MessageError, RequestSpec
from pagedllm.engine.outputs import RequestDelta, SequenceDelta
from pagedllm.engine.reports import blocks_report, cache_report, events_report

if TYPE_CHECKING:
    import zmq

    from pagedllm.engine.config import EngineConfig
    from pagedllm.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

# How often an idle core looks whether its server process is still there (seconds).
_PARENT_CHECK_S = 1.0


class UtilityError(RuntimeError):
    """A call failed in the engine core with an error other than ValueError, TypeError or
    KeyError (those are raised as themselves)."""


class EngineFactory(Protocol):
    """Builds the engine inside the core's process, and the tokenizer in the server's.

    It crosses to a spawned process, so it must pickle (a frozen dataclass of plain values).
    """

    def build_engine(self) -> LLMEngine: ...

    def load_tokenizer(self) -> Any: ...

    def beside(self, tokenizer: Any) -> EngineFactory:
        """This factory, for a core beside a server that holds ``tokenizer`` (from
        ``load_tokenizer``)."""
        ...


@dataclass(frozen=True, slots=True)
class ConfigEngineFactory:
    """The engine of ``pagedllm serve``: ``LLMEngine.from_config(config)``.

    ``deferred``: the core's tokenizer is loaded only when a request needs one
    (``DeferredTokenizer``: a structured-output grammar), its EOS id ``eos_token_id``
    taken from the server's; set by ``beside``, only for a server that has a tokenizer."""

    config: EngineConfig
    deferred: bool = False
    eos_token_id: int | None = None

    def build_engine(self) -> LLMEngine:
        from pagedllm.engine.llm_engine import LLMEngine

        if not self.deferred:
            return LLMEngine.from_config(self.config)
        from pagedllm.model.tokenizer import DeferredTokenizer

        tokenizer = DeferredTokenizer(self.load_tokenizer, self.eos_token_id)
        return LLMEngine.from_config(self.config, tokenizer=tokenizer)

    def beside(self, tokenizer: Any) -> ConfigEngineFactory:
        if tokenizer is None:
            return self
        eos = getattr(tokenizer, "eos_token_id", None)
        return ConfigEngineFactory(self.config, deferred=True, eos_token_id=eos)

    def load_tokenizer(self) -> Any:
        if self.config.skip_tokenizer_init:
            return None
        from pagedllm.model.loader import load_tokenizer

        return load_tokenizer(self.config.model)


# ---------------------------------------------------------------- the core


class EngineCore:
    """An ``LLMEngine`` seen as the server sees it: requests added atomically, aborts,
    one step at a time with token deltas out, the calls of ``engine/messages.py``.

    A step that raises as a whole (the engine's own contract is to fail single requests)
    fails every request in flight with the error and the core goes on serving; if the
    engine is still busy after that, the error propagates and the loop ends.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.num_step_failures = 0
        # (epoch, next_seq) of the cache events pushed so far; None: nobody watches.
        self._events_pushed: tuple[str, int] | None = None
        self.handlers = self._handlers()

    def _handlers(self) -> dict[type, Callable[[Any], Any]]:
        """What each message of the server runs (``Shutdown`` is the loop's); nothing else
        runs."""
        engine = self.engine
        return {
            m.AbortRequests: lambda message: self.abort_requests(message.request_ids),
            m.StopSequences: lambda message: self.stop_sequences(
                message.request_id, message.stopped
            ),
            m.AddRequests: lambda call: self.add_requests(call.specs),
            m.GetStats: lambda call: engine.get_stats(),
            m.GetCacheReport: lambda call: cache_report(engine.get_stats()),
            m.GetBlocksReport: lambda call: blocks_report(engine),
            m.GetEventsReport: lambda call: events_report(engine, call.epoch, call.since),
            m.WatchEvents: lambda call: self.watch_events(),
            m.StartResize: lambda call: engine.elastic.start(call.num_bytes, preempt=call.preempt),
            m.GetResizeReport: lambda call: engine.elastic.report_for(call.resize_id),
            m.GetCacheCapacityBlocks: lambda call: engine.elastic.capacity_blocks(),
            m.GetMaxNumTokens: lambda call: engine.scheduler.max_num_tokens(),
            m.GetNumUnfinishedRequests: lambda call: engine.get_num_unfinished_requests(),
            m.FlushDiskTier: lambda call: engine.flush_disk_tier(),
            m.ResetPrefixCache: lambda call: engine.reset_prefix_cache(),
        }

    def handle(self, message: Any) -> Any:
        """Run one message of the server; a call's result (``ValueError`` for a message
        the core does not take)."""
        handler = self.handlers.get(type(message))
        if handler is None:
            raise ValueError(f"the engine core takes no {type(message).__name__} message")
        return handler(message)

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def add_requests(self, specs: Sequence[RequestSpec]) -> None:
        """Add all or none (the error of the first refused one is raised)."""
        added: list[str] = []
        try:
            for spec in specs:
                self.engine.add_request(
                    spec.request_id, spec.prompt, spec.params,
                    priority=spec.priority, cache_salt=spec.cache_salt,
                )  # fmt: skip
                added.append(spec.request_id)
        except BaseException:
            self.engine.abort_request(added)
            raise

    def abort_requests(self, request_ids: Sequence[str]) -> None:
        self.engine.abort_request(list(request_ids))

    def stop_sequences(self, request_id: str, stopped: Sequence[tuple[int, str]]) -> None:
        """Finish the sequences the server's stop strings ended: (index, stop string)."""
        self.engine.stop_sequences(request_id, stopped)

    def close(self) -> None:
        """Let the engine finish what must not be lost (the disk tier's queued writes)."""
        self.engine.close()

    def step(self, on_scheduled: Callable[[], None] | None = None) -> list[RequestDelta]:
        """One step; ``on_scheduled()`` runs after the schedule, before the model."""
        try:
            return self.engine.step_deltas(on_scheduled=on_scheduled)
        except Exception as exc:
            logger.exception("engine step raised; failing the requests in flight")
            self.num_step_failures += 1
            ids = self.engine.unfinished_request_ids()
            self.engine.abort_request(ids)
            if self.engine.has_unfinished_requests():
                raise RuntimeError("engine still busy after aborting a failed step") from exc
            error = f"engine step failed: {type(exc).__name__}: {exc}"
            failed = (SequenceDelta(0, (), finish_reason="error"),)
            return [RequestDelta(i, failed, True, error=error) for i in ids]

    def info(self) -> EngineInfo:
        """What the server needs to know of the engine (sent first, with ``Ready``)."""
        engine = self.engine
        return EngineInfo(
            model=str(engine.config.model),
            model_name=str(engine.model_name or engine.config.model),
            max_model_len=int(engine.max_model_len),
            vocab_size=int(engine.runner.vocab_size),
            block_size=int(engine.runner.block_size),
            num_blocks=engine.elastic.capacity_blocks(),
            max_num_tokens=engine.scheduler.max_num_tokens(),
            tool_call_parser=engine.config.tool_call_parser,
            grammar_compile_limit_s=engine.config.grammar_compile_limit_s,
            pid=os.getpid(),
        )

    def watch_events(self) -> int:
        """Push the cache events from now on (``pending_events``); the log's ``next_seq``."""
        log = self.engine.kv.events
        if self._events_pushed is None:
            self._events_pushed = (log.epoch, log.next_seq)
        return log.next_seq

    def pending_events(self) -> dict[str, Any] | None:
        """The batch of events logged since the last push (``events_pushed``), or None:
        nothing new, or nobody watches."""
        if self._events_pushed is None:
            return None
        log = self.engine.kv.events
        epoch, seq = self._events_pushed
        if epoch == log.epoch and seq == log.next_seq:
            return None
        # another epoch (a new log) starts from its oldest event; a reader resyncs anyway
        since = max(seq, log.first_seq) if epoch == log.epoch else log.first_seq
        return events_report(self.engine, log.epoch, since)

    def events_pushed(self, batch: dict[str, Any]) -> None:
        self._events_pushed = (batch["epoch"], batch["next_seq"])


# ---------------------------------------------------------------- the loop


def run_core_loop(
    core: EngineCore,
    context: zmq.Context,
    input_address: str,
    output_address: str,
    *,
    parent_pid: int | None = None,
) -> None:
    """Serve ``core`` over the two sockets until ``Shutdown`` (or the parent process is
    gone). Sends ``Ready`` first; if the loop breaks, sends ``Dead`` and re-raises."""
    import zmq

    codec = Codec()
    inbox = context.socket(zmq.PULL)
    outbox = context.socket(zmq.PUSH)
    inbox.connect(input_address)
    outbox.connect(output_address)
    try:
        outbox.send(codec.encode(m.Ready(core.info())))
        _serve(core, codec, inbox, outbox, parent_pid)
    except ServerGone:
        logger.warning("the server process is gone; the engine core stops")
    except BaseException as exc:
        logger.exception("engine core loop died")
        outbox.send(codec.encode(m.Dead(f"{type(exc).__name__}: {exc}")))
        raise
    finally:
        try:
            core.close()
        except Exception:
            logger.exception("closing the engine failed")
        inbox.close(linger=0)
        outbox.close(linger=1000)  # let the last messages leave


def _serve(core: EngineCore, codec: Codec, inbox: Any, outbox: Any, parent_pid: int | None) -> None:
    import zmq

    while True:
        _check_parent(parent_pid)  # a step's cost next to a system call: every step
        # Idle: wait for a message (looking now and then whether the server still lives).
        # The idle work (a shrink left under way completes; the automatic elastic pool
        # shrinks) comes before each wait: messages may come faster than any quiet spell,
        # as a route polling for that shrink's report does.
        while not core.has_unfinished_requests():
            core.engine.elastic.idle_tick()
            if inbox.poll(int(_PARENT_CHECK_S * 1000)):
                break
            _check_parent(parent_pid)
        while True:  # every waiting message, before the next step
            try:
                frame = inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            if not _run_message(core, codec, frame, outbox, parent_pid):
                return
        if core.has_unfinished_requests():
            deltas = core.step(on_scheduled=lambda: _push_events(core, codec, outbox, None))
            if deltas:
                send(outbox, codec.encode(m.Deltas(tuple(deltas))), parent_pid)
        _push_events(core, codec, outbox, parent_pid)


def _run_message(
    core: EngineCore, codec: Codec, frame: bytes, outbox: Any, parent_pid: int | None
) -> bool:
    """Run one frame's message, answering it if it is a call; False for ``Shutdown``."""
    try:
        message, call_id = codec.decode(frame)
    except MessageError as exc:
        logger.error("a message from the server could not be read: %s", exc)
        if exc.call_id is not None:
            send(outbox, codec.encode(m.raised(exc), exc.call_id), parent_pid)
        return True
    if isinstance(message, m.Shutdown):
        return False
    if call_id is None:  # one-way: an error ends the loop, as a failed step's would
        core.handle(message)
        return True
    try:
        answer: Any = codec.returned(core.handle(message))
    except Exception as exc:
        answer = m.raised(exc)
    send(outbox, codec.encode(answer, call_id), parent_pid)
    return True


def _push_events(core: EngineCore, codec: Codec, outbox: Any, parent_pid: int | None) -> None:
    """Send the cache events logged since the last push, if anyone watches. With
    ``parent_pid`` None (mid-step) only if the socket takes it now: a reader that is
    behind gets them with the step's end instead of holding the step up."""
    import zmq

    batch = core.pending_events()
    if batch is None:
        return
    frame = codec.encode(m.CacheEvents(batch))
    if parent_pid is None:
        try:
            outbox.send(frame, zmq.NOBLOCK)
        except zmq.ZMQError:  # Again: full; anything else the step's end will meet
            return
    else:
        send(outbox, frame, parent_pid)
    core.events_pushed(batch)


class ServerGone(Exception):
    """The server process is gone (the core was reparented)."""


def send(outbox: Any, frame: bytes, parent_pid: int | None) -> None:
    """Send ``frame``; raise ``ServerGone`` if the server process dies meanwhile (with
    no reader left, the PUSH socket would block forever and the core outlive it)."""
    import zmq

    while not outbox.poll(int(_PARENT_CHECK_S * 1000), zmq.POLLOUT):
        _check_parent(parent_pid)
    outbox.send(frame)


def _check_parent(parent_pid: int | None) -> None:
    if parent_pid is not None and os.getppid() != parent_pid:
        raise ServerGone


@contextlib.contextmanager
def _exit_if_orphaned(parent_pid: int) -> Iterator[None]:
    """While the engine starts (a model load or a kernel build: up to minutes, with no loop
    to look), a thread ends the process if the server dies: nothing is in flight yet, and a
    core whose server was killed must not live on, loading a model for nobody."""
    done = threading.Event()

    def watch() -> None:
        while not done.wait(_PARENT_CHECK_S):
            if os.getppid() != parent_pid:
                logger.warning("the server process died while the engine core started; exiting")
                os._exit(1)

    thread = threading.Thread(target=watch, name="pagedllm-orphan-watch", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def core_process_main(
    factory: EngineFactory, input_address: str, output_address: str, parent_pid: int
) -> None:
    """The entry point of the engine core's own process: build the engine, then serve.
    ``parent_pid``: the server's pid, from the server (read here, after this process's
    imports, it may already be init's: a server killed meanwhile would go unnoticed)."""
    import signal

    import zmq

    # Ctrl-C in a terminal reaches the whole process group: the server decides when
    # the core stops (it sends Shutdown after draining).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parent = parent_pid
    if os.getppid() != parent:
        logger.warning("the server process died while the engine core started; exiting")
        return
    context = zmq.Context()
    try:
        try:
            with _exit_if_orphaned(parent):
                core = EngineCore(factory.build_engine())
        except BaseException as exc:
            outbox = context.socket(zmq.PUSH)
            outbox.connect(output_address)
            reason = f"engine start-up failed: {type(exc).__name__}: {exc}"
            outbox.send(Codec().encode(m.Dead(reason)))
            outbox.close(linger=1000)
            raise
        run_core_loop(core, context, input_address, output_address, parent_pid=parent)
    finally:
        context.destroy(linger=1000)
