"""AsyncEngine: the server's handle on an engine core that runs elsewhere.

::

    server process (asyncio event loop)              engine core (core.py)
    -----------------------------------              ---------------------
    add_requests() -- AddRequests(specs) ------->    own process (``launch``: `pagedllm serve`)
    abort()        -- AbortRequests(ids) ------->      or a thread (``in_thread``: tests,
    get_stats(), blocks_report(), start_resize(),      ``create_app(LLMEngine)``)
      ...          -- GetStats(), ... ---------->    runs the call between two steps
                   <-- Returned / Raised --------    its answer, decoded into its type
    a stop string  -- StopSequences(id, ...) --->    finishes those sequences
    reader task    <-- Deltas(...) --------------    one message per step: new token ids
                   <-- CacheEvents(batch) -------    cache events, once watch_cache_events
       RequestStream: its OutputProcessor state (text, stop strings: "stop" to the
       core) hands out what is new
    core watcher   <-- the process/thread ended      every stream fails, /health says 503

The core never shares this interpreter's lock when it runs in its own process: HTTP,
JSON, tokenization, detokenization and SSE happen here while it steps. Both hosts speak
the same messages (``engine/messages.py``) over the same ZeroMQ sockets, so tests of the
thread exercise the process's code path. Each call the server makes is a method here
sending a declared ``Call``; there is no call by name.

A stream keeps every token and hands out, per read, everything new since the last read:
a slow client gets bigger deltas, never an unbounded queue of small ones.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import itertools
import logging
import os
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import zmq
import zmq.asyncio

from pagedllm.engine import messages as m
from pagedllm.engine.core import (
    EngineCore,
    EngineFactory,
    UtilityError,
    core_process_main,
    run_core_loop,
)
from pagedllm.engine.elastic import ResizeReport
from pagedllm.engine.messages import Codec, EngineInfo, RequestSpec
from pagedllm.engine.output_processor import (
    ChoiceDelta,
    OutputProcessor,
    RequestState,
    StreamDelta,
)
from pagedllm.engine.outputs import PromptLogprobs, RequestDelta, RequestOutput
from pagedllm.engine.reports import EngineStats

if TYPE_CHECKING:
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.sampling_params import SamplingParams

__all__ = [
    "AsyncEngine",
    "ChoiceDelta",
    "EngineClosedError",
    "QueueFullError",
    "RequestSpec",
    "RequestStream",
    "StreamDelta",
    "UtilityError",
]

logger = logging.getLogger(__name__)

OutputListener = Callable[[Sequence[RequestDelta], float], None]
EventsListener = Callable[[dict[str, Any]], None]
# Seconds the engine core may take to load its model and say "ready".
DEFAULT_READY_TIMEOUT_S = 600.0
# Seconds a stopping core gets to exit (its disk tier finishes queued writes) before it
# is killed.
_STOP_TIMEOUT_S = 60.0
# Messages that only end work: sent (or dropped) quietly when the core is gone.
_ALWAYS_SENT = (m.AbortRequests, m.StopSequences, m.Shutdown)
_ERRORS: dict[str, type[Exception]] = {t.__name__: t for t in m.PASSED_ERRORS}
R = TypeVar("R")


class QueueFullError(RuntimeError):
    """More requests are waiting for their first token than ``max_queued_requests``."""


class EngineClosedError(RuntimeError):
    """The engine is shutting down, or its core has died."""


class RequestStream:
    """One request's outputs, as an async iterator of ``StreamDelta``.

    Iteration ends after the delta that finishes the request; it raises
    ``EngineClosedError`` when the engine shut down or died first. A failed request
    ends with choices whose ``finish_reason`` is "error" and the delta's ``error``.
    Leaving the iteration early (client gone) must be followed by ``abort()``.
    ``output()`` is everything so far, cumulative (the non-streaming answer).
    """

    def __init__(self, state: RequestState, owner: AsyncEngine, arrival_time: float) -> None:
        self.request_id = state.request_id
        self.params = state.params
        self.arrival_time = arrival_time
        self.first_output_time: float | None = None
        self.finished = False
        self._state = state
        self._owner = owner
        self._failure: BaseException | None = None
        self._closed = False  # aborted: nothing more is delivered
        self._ready = asyncio.Event()

    @property
    def prompt_token_ids(self) -> tuple[int, ...]:
        return self._state.prompt_token_ids

    @property
    def num_cached_tokens(self) -> int:
        return self._state.num_cached_tokens

    @property
    def error(self) -> str | None:
        return self._state.error

    @property
    def prompt_logprobs(self) -> PromptLogprobs | None:
        return self._state.prompt_logprobs()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StreamDelta:
        while True:
            delta = None if self._failure or self._closed else self._state.read()
            if delta is not None:
                return delta
            if self._failure is not None:
                raise self._failure
            if self.finished:
                raise StopAsyncIteration
            self._ready.clear()
            await self._ready.wait()

    def abort(self) -> None:
        """Stop generating (a no-op once finished); the engine frees the blocks."""
        if not self.finished:
            self._owner.abort(self.request_id)

    def output(self) -> RequestOutput:
        return self._state.output()

    # Called on the event loop by the AsyncEngine.
    def _put(self, delta: RequestDelta) -> list[tuple[int, str]]:
        """Apply a core delta; returns the sequences a stop string ended."""
        self._owner.output_processor.process(delta)
        self.finished = self._state.finished
        self._ready.set()
        return self._state.take_stopped()

    def _fail(self, error: BaseException) -> None:
        if self._state.finished:
            return
        self._failure = error
        self.finished = True
        self._ready.set()


# ---------------------------------------------------------------- where the core runs


class _CoreHost(Protocol):
    """A place where the core loop runs: a thread or a process."""

    def start(self, input_address: str, output_address: str) -> None: ...

    def is_alive(self) -> bool: ...

    def join(self, timeout: float | None = None) -> None: ...

    def kill(self) -> None: ...

    def describe_exit(self) -> str: ...


class _CoreThread:
    """The core loop in a thread of this process (tests; a server around an engine
    object that cannot be rebuilt elsewhere)."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self._thread: threading.Thread | None = None

    def start(self, input_address: str, output_address: str) -> None:
        def run() -> None:
            context = zmq.Context()
            try:
                run_core_loop(self.core, context, input_address, output_address)
            except BaseException:  # logged and reported as "dead" by the loop
                pass
            finally:
                context.destroy(linger=1000)

        self._thread = threading.Thread(target=run, name="pagedllm-core", daemon=True)
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def kill(self) -> None:
        """A thread cannot be killed; it ends with the process (it is a daemon)."""

    def describe_exit(self) -> str:
        return "the engine core thread ended"


class _CoreProcess:
    """The core loop in a process of its own (``pagedllm serve``)."""

    def __init__(self, factory: EngineFactory) -> None:
        self.factory = factory
        self.process: Any = None

    def start(self, input_address: str, output_address: str) -> None:
        import multiprocessing

        # spawn: a fork of a process that has started threads (tokenizers, torch) can hang.
        context = multiprocessing.get_context("spawn")
        self.process = context.Process(
            target=core_process_main,
            args=(self.factory, input_address, output_address, os.getpid()),
            name="pagedllm-core",
        )
        self.process.start()
        atexit.register(self.kill)  # never outlive the server, however it ends

    def is_alive(self) -> bool:
        return self.process is not None and self.process.is_alive()

    def join(self, timeout: float | None = None) -> None:
        if self.process is not None:
            self.process.join(timeout)

    def kill(self) -> None:
        if self.is_alive():
            self.process.kill()
            self.process.join(5)

    def describe_exit(self) -> str:
        code = None if self.process is None else self.process.exitcode
        return f"the engine core process (pid {self.pid}) exited with code {code}"

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid


# ---------------------------------------------------------------- the client


class AsyncEngine:
    """The asyncio side of an engine core (see the module docstring).

    Build it with ``AsyncEngine.launch(factory)`` (core in its own process) or
    ``AsyncEngine.in_thread(engine)``. ``max_queued_requests`` bounds the requests that
    have been accepted but have not produced their first token yet; ``add_requests``
    raises ``QueueFullError`` beyond it. ``info`` (``EngineInfo``) describes the engine
    (model name, ``max_model_len``, vocabulary and cache sizes).
    """

    def __init__(
        self,
        host: _CoreHost,
        tokenizer: Any,
        *,
        max_queued_requests: int | None = None,
        ready_timeout: float = DEFAULT_READY_TIMEOUT_S,
    ) -> None:
        if max_queued_requests is not None and max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be at least 1, got {max_queued_requests}")
        self.tokenizer = tokenizer
        self.output_processor = OutputProcessor(tokenizer)
        self.codec = Codec()
        self.max_queued_requests = max_queued_requests
        self.host = host
        self._streams: dict[str, RequestStream] = {}
        self._num_queued = 0
        self._listeners: list[OutputListener] = []
        self._events_listeners: list[EventsListener] = []
        # call id -> (its future, the type its answer decodes into)
        self._calls: dict[int, tuple[asyncio.Future[Any], Any]] = {}
        self._call_ids = itertools.count()
        self._closing = False
        self._stopped = False
        self._dead: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: asyncio.Task[None] | None = None
        self._context = zmq.asyncio.Context()
        self._to_core = self._context.socket(zmq.PUSH)
        self._from_core = self._context.socket(zmq.PULL)
        self._sync_to_core = zmq.Socket.shadow(self._to_core.underlying)
        addresses = [_ipc_address(kind) for kind in ("in", "out")]
        self._to_core.bind(addresses[0])
        self._from_core.bind(addresses[1])
        self._paths = [a.removeprefix("ipc://") for a in addresses]
        try:
            host.start(*addresses)
            self.info: EngineInfo = self._wait_ready(ready_timeout)
        except BaseException:
            host.kill()
            self._close_sockets()
            raise

    @classmethod
    def launch(cls, factory: EngineFactory, **kw: Any) -> AsyncEngine:
        """Start the engine core in a process of its own and wait until it is ready
        (``RuntimeError`` with its reason if it fails to start)."""
        tokenizer = factory.load_tokenizer()
        return cls(_CoreProcess(factory.beside(tokenizer)), tokenizer, **kw)

    @classmethod
    def in_thread(cls, engine: LLMEngine, **kw: Any) -> AsyncEngine:
        """Run ``engine``'s core loop in a thread of this process (same messages)."""
        return cls(_CoreThread(EngineCore(engine)), engine.tokenizer, **kw)

    # ------------------------------------------------------------------ public API

    @property
    def num_in_flight(self) -> int:
        """Requests accepted and not finished, aborted or failed."""
        return len(self._streams)

    @property
    def num_queued(self) -> int:
        """Accepted requests still waiting for their first output."""
        return self._num_queued

    @property
    def is_running(self) -> bool:
        return not self._closing and self._dead is None

    @property
    def dead_reason(self) -> str | None:
        return None if self._dead is None else str(self._dead)

    def add_listener(self, listener: OutputListener) -> None:
        """Call ``listener(deltas, arrival_time)`` on the loop after every step (metrics)."""
        self._listeners.append(listener)

    async def watch_cache_events(self, listener: EventsListener) -> Callable[[], None]:
        """Call ``listener(batch)`` on the loop with every batch of prefix-cache events the
        core pushes (``EngineCore.pending_events``: contiguous, the poll's shape) from now
        on; returns the function that stops it. The core keeps pushing once asked."""
        self._events_listeners.append(listener)
        try:
            await self.call(m.WatchEvents())
        except BaseException:
            self._events_listeners.remove(listener)
            raise

        def stop() -> None:
            with contextlib.suppress(ValueError):
                self._events_listeners.remove(listener)

        return stop

    def start(self) -> None:
        """Start reading the core's messages on the running loop (idempotent)."""
        if self._reader is not None:
            return
        self._check_open()
        self._loop = asyncio.get_running_loop()
        self._reader = self._loop.create_task(self._read_messages())
        threading.Thread(target=self._watch_core, name="pagedllm-core-watch", daemon=True).start()

    def check_capacity(self, count: int = 1) -> None:
        """Raise ``QueueFullError`` / ``EngineClosedError`` if ``count`` requests would not be taken."""
        self._check_open()
        limit = self.max_queued_requests
        if limit is not None and self._num_queued + count > limit:
            raise QueueFullError(
                f"{self._num_queued} requests are already waiting "
                f"(max_queued_requests={limit}); retry later"
            )

    async def add_requests(self, specs: Sequence[RequestSpec]) -> list[RequestStream]:
        """Add several requests atomically: all are accepted, or none (and the error is raised).

        Raises ``QueueFullError``, ``EngineClosedError``, or the ``ValueError``/``TypeError``
        of ``LLMEngine.add_request`` for bad input.
        """
        self.check_capacity(len(specs))
        self.start()
        specs = [self._with_token_ids(s) for s in specs]
        ids = [s.request_id for s in specs]
        for request_id in ids:
            if request_id in self._streams or ids.count(request_id) > 1:
                raise ValueError(f"request_id {request_id!r} is already in flight")
        now = time.monotonic()
        processor = self.output_processor
        streams = [
            RequestStream(processor.add_request(s.request_id, None, s.prompt, s.params), self, now)
            for s in specs
        ]
        for stream in streams:
            self._streams[stream.request_id] = stream
        self._num_queued += len(streams)
        try:
            await self.call(m.AddRequests(tuple(specs)))
        except BaseException:
            # Refused, or the caller was cancelled while the add was on its way: in the
            # latter case the add still runs, so abort after it (messages run in order).
            for stream in streams:
                self.abort(stream.request_id)
            raise
        return streams

    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Add one request; see ``add_requests``."""
        spec = RequestSpec(request_id, prompt, params, priority, cache_salt)
        return (await self.add_requests([spec]))[0]

    async def generate(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, **kw: Any
    ) -> AsyncIterator[StreamDelta]:
        """Yield a request's deltas; leaving early (or being cancelled) aborts it."""
        stream = await self.add_request(request_id, prompt, params, **kw)
        try:
            async for delta in stream:
                yield delta
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Abort a request (returns at once; callable from any thread). The core frees
        its blocks before its next step."""
        if self._loop is not None and not _on_loop(self._loop):
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody listens
                self._loop.call_soon_threadsafe(self.abort, request_id)
            return
        stream = self._streams.get(request_id)
        if stream is not None:
            self._forget(stream)
        self._send(m.AbortRequests((request_id,)))

    async def call(self, call: m.Call[R]) -> R:
        """Run ``call`` in the engine core between two steps; its answer, decoded into the
        call's result type. ValueError, TypeError and KeyError raised there are raised
        here; other errors as ``UtilityError``."""
        self._check_alive()
        self.start()
        assert self._loop is not None
        call_id = next(self._call_ids)
        future: asyncio.Future[Any] = self._loop.create_future()
        self._calls[call_id] = (future, m.result_type(type(call)))
        try:
            self._send(call, call_id)
            return await future
        finally:
            self._calls.pop(call_id, None)

    # The calls the server makes (``engine/messages.py``), one method each.

    async def get_stats(self) -> EngineStats:
        """``LLMEngine.get_stats()``, taken in the core between two steps."""
        return await self.call(m.GetStats())

    async def cache_report(self) -> dict[str, Any]:
        """The ``/v1/cache`` report (``engine/reports.py``)."""
        return await self.call(m.GetCacheReport())

    async def blocks_report(self) -> dict[str, Any]:
        """The dashboard's per-block report (``engine/reports.py``)."""
        return await self.call(m.GetBlocksReport())

    async def events_report(self, epoch: str | None, since: int) -> dict[str, Any]:
        """``GET /v1/cache/events``'s body: the prefix cache's events after ``since``."""
        return await self.call(m.GetEventsReport(epoch, since))

    async def start_resize(self, num_bytes: int, preempt: bool = False) -> int:
        """Begin resizing the KV cache's device tier between steps; the resize's id."""
        return await self.call(m.StartResize(num_bytes, preempt))

    async def resize_report(self, resize_id: int) -> ResizeReport | None:
        """The report of a resize ``start_resize`` began, once done (None before)."""
        return await self.call(m.GetResizeReport(resize_id))

    async def cache_capacity_blocks(self) -> int:
        """The most device blocks one request may count on now."""
        return await self.call(m.GetCacheCapacityBlocks())

    async def max_num_tokens(self) -> int:
        """The most tokens (prompt + ``max_tokens``) one request may have now."""
        return await self.call(m.GetMaxNumTokens())

    async def num_unfinished_requests(self) -> int:
        """Requests the engine core has not finished."""
        return await self.call(m.GetNumUnfinishedRequests())

    async def flush_disk_tier(self) -> None:
        """Wait until every block queued for the disk tier is written."""
        await self.call(m.FlushDiskTier())

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached block (False, nothing done, while requests run)."""
        return await self.call(m.ResetPrefixCache())

    async def shutdown(self, *, drain_timeout: float = 0.0) -> None:
        """Stop accepting; let in-flight requests finish for up to ``drain_timeout``
        seconds, abort the rest, and stop the engine core."""
        self._closing = True
        deadline = time.monotonic() + drain_timeout
        while self._streams and time.monotonic() < deadline and self._dead is None:
            await asyncio.sleep(0.02)
        ids = list(self._streams)
        for request_id in ids:
            stream = self._streams[request_id]
            self._forget(stream)
            stream._fail(EngineClosedError("the server is shutting down"))
        if self._stopped:
            return
        self._stopped = True
        self._send(m.AbortRequests(tuple(ids)))
        self._send(m.Shutdown())
        await asyncio.to_thread(self.host.join, _STOP_TIMEOUT_S)
        if self.host.is_alive():
            logger.warning("the engine core did not stop in %.0f s; killing it", _STOP_TIMEOUT_S)
            await asyncio.to_thread(self.host.kill)
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        self._fail_calls(EngineClosedError("the engine has stopped"))
        self._close_sockets()

    # ------------------------------------------------------------------ internals

    def _wait_ready(self, timeout: float) -> EngineInfo:
        """Block until the core says ``Ready`` (the first message); ``RuntimeError`` if it
        dies or says ``Dead`` first, ``TimeoutError`` after ``timeout`` seconds."""
        sync = zmq.Socket.shadow(self._from_core.underlying)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if sync.poll(100):
                message = self.codec.decode(sync.recv()).message
                if isinstance(message, m.Ready):
                    return message.info
                reason = message.reason if isinstance(message, m.Dead) else message
                raise RuntimeError(f"the engine core failed to start: {reason}")
            if not self.host.is_alive():
                raise RuntimeError(f"{self.host.describe_exit()} while starting")
        raise TimeoutError(f"the engine core was not ready after {timeout:.0f} s")

    def _check_open(self) -> None:
        if self._dead is not None:
            raise EngineClosedError(str(self._dead))
        if self._closing:
            raise EngineClosedError("the server is shutting down")

    def _with_token_ids(self, spec: RequestSpec) -> RequestSpec:
        """Text prompts are tokenized here, so the core gets ids and the stream has context."""
        if not isinstance(spec.prompt, str):
            return spec
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer: give prompt token ids")
        ids = list(self.tokenizer.encode(spec.prompt))
        return RequestSpec(spec.request_id, ids, spec.params, spec.priority, spec.cache_salt)

    def _send(self, message: Any, call_id: int | None = None) -> None:
        always = isinstance(message, _ALWAYS_SENT)
        if self._stopped and not always:
            raise EngineClosedError("the engine has stopped")
        try:
            self._sync_to_core.send(self.codec.encode(message, call_id), zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # the core is gone and its queue is full, or closed
            if not always:
                raise EngineClosedError(f"the engine core is unreachable: {exc}") from None

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineClosedError(str(self._dead))
        if self._stopped:
            raise EngineClosedError("the engine has stopped")

    async def _read_messages(self) -> None:
        while True:
            frame = await self._from_core.recv()
            try:
                self._handle(frame)
            except Exception:
                # The reader must outlive a bad message: if it stopped, every request and
                # call would wait forever, and the core, its output queue full, would
                # block sending and never see "shutdown".
                logger.exception("a message from the engine core could not be handled")

    def _handle(self, frame: bytes) -> None:
        message, call_id = self.codec.decode(frame)
        if isinstance(message, m.Deltas):
            self._deliver(message.deltas, time.monotonic())
        elif isinstance(message, m.Returned | m.Raised):
            self._resolve(call_id, message)
        elif isinstance(message, m.CacheEvents):
            for listener in list(self._events_listeners):
                try:
                    listener(message.batch)
                except Exception:
                    logger.exception("cache events listener failed")
        elif isinstance(message, m.Dead):
            self._mark_dead(EngineClosedError(f"the engine core failed: {message.reason}"))

    def _resolve(self, call_id: int | None, answer: m.Returned | m.Raised) -> None:
        entry = None if call_id is None else self._calls.get(call_id)
        if entry is None or entry[0].done():
            return  # its caller was cancelled
        future, value_type = entry
        if isinstance(answer, m.Raised):
            future.set_exception(_ERRORS.get(answer.error_type, UtilityError)(answer.message))
            return
        try:
            future.set_result(self.codec.decode_value(answer.value, value_type))
        except ValueError as exc:  # the answer does not fit the call's type
            future.set_exception(UtilityError(f"the engine core's answer: {exc}"))

    def _watch_core(self) -> None:
        """Thread: wait for the core to end; if nobody stopped it, it died."""
        self.host.join()
        loop = self._loop
        if loop is not None and not self._stopped:
            with contextlib.suppress(RuntimeError):  # the loop is closed
                loop.call_soon_threadsafe(self._on_core_exit)

    def _on_core_exit(self) -> None:
        if not self._stopped and self._dead is None:
            message = f"{self.host.describe_exit()}; the requests in flight failed"
            logger.error("%s", message)
            self._mark_dead(EngineClosedError(message))

    def _mark_dead(self, error: BaseException) -> None:
        if self._dead is None:
            self._dead = error
        for request_id in list(self._streams):
            stream = self._streams[request_id]
            self._forget(stream)
            stream._fail(error)
        self._fail_calls(error)

    def _fail_calls(self, error: BaseException) -> None:
        for future, _ in self._calls.values():
            if not future.done():
                future.set_exception(error)

    def _forget(self, stream: RequestStream) -> None:
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]
            if stream.first_output_time is None:
                self._num_queued -= 1
        self.output_processor.abort_request(stream.request_id)
        stream.finished = stream._closed = True
        stream._ready.set()  # a waiting iterator ends instead of hanging

    def _deliver(self, deltas: Sequence[RequestDelta], now: float) -> None:
        seen = []  # as the streams saw them: a stop string finishes a request here
        for delta in deltas:
            stream = self._streams.get(delta.request_id)
            if stream is None:
                continue  # aborted by its client meanwhile, or ended by a stop string
            if stream.first_output_time is None:
                stream.first_output_time = now
                self._num_queued -= 1
            try:
                stopped = stream._put(delta)
            except Exception as exc:  # fails this stream only (detokenizing, say)
                logger.exception("stream %s failed", delta.request_id)
                stream._fail(exc)
                self.abort(delta.request_id)
                seen.append(delta)
                continue
            if stream.finished:
                del self._streams[delta.request_id]
            if stopped and not delta.finished:
                self._send(m.StopSequences(delta.request_id, tuple(stopped)))
            if delta.finished != stream.finished:
                delta = dataclasses.replace(delta, finished=stream.finished)
            seen.append(delta)
        for listener in self._listeners:
            try:
                listener(seen, now)
            except Exception:
                logger.exception("output listener failed")

    def _close_sockets(self) -> None:
        self._sync_to_core.close(linger=0)
        self._to_core.close(linger=0)
        self._from_core.close(linger=0)
        self._context.term()
        for path in self._paths:
            with contextlib.suppress(OSError):
                os.unlink(path)


def _ipc_address(kind: str) -> str:
    name = f"pagedllm-{os.getpid()}-{uuid.uuid4().hex[:12]}-{kind}"
    return f"ipc://{os.path.join(tempfile.gettempdir(), name)}"


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False
