"""AsyncEngine: an ``LLMEngine`` driven by one background thread, fed from asyncio.

::

    event loop (server)                         step thread (owns the LLMEngine)
    -------------------                         --------------------------------
    add_requests() --- command ----------->     engine.add_request(...)
    abort()        --- command ----------->     engine.abort_request(...)
    call(fn)       --- command ----------->     fn(engine)  (stats for /metrics)
                                                outputs = engine.step()
    RequestStream  <-- call_soon_threadsafe --  (one hand-off per step)

The ``LLMEngine`` is not thread-safe, so only the step thread ever touches it: every
other operation travels as a command that the thread runs between two steps. The event
loop never waits on a step; it awaits a future that the thread completes.

Outputs are cumulative (the whole text so far), so a stream keeps only the latest one:
a slow client gets bigger deltas instead of an unbounded backlog.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.engine.outputs import RequestOutput
    from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")

_Command = tuple[Callable[[], Any], "concurrent.futures.Future[Any] | None"]
OutputListener = Callable[[Sequence["RequestOutput"], float], None]


class QueueFullError(RuntimeError):
    """More requests are waiting for their first token than ``max_queued_requests``."""


class EngineClosedError(RuntimeError):
    """The engine is shutting down or its step loop has died."""


class RequestFailedError(RuntimeError):
    """The engine failed this request (an exception while running its step)."""


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request to add: what ``LLMEngine.add_request`` takes."""

    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None


class RequestStream:
    """The outputs of one request, as an async iterator of cumulative ``RequestOutput``.

    Iteration ends after the finished output; it raises ``RequestFailedError`` when the
    engine failed the request, and ``EngineClosedError`` when the engine shut down first.
    Leaving the iteration early (client gone) must be followed by ``abort()``;
    ``AsyncEngine.generate`` does that for you.
    """

    def __init__(self, request_id: str, owner: AsyncEngine, arrival_time: float) -> None:
        self.request_id = request_id
        self.arrival_time = arrival_time
        self.first_output_time: float | None = None
        self.finished = False
        self._got_final = False
        self._owner = owner
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        while True:
            if self._latest is not None:
                output, self._latest = self._latest, None
                return output
            if self._error is not None:
                raise self._error
            if self.finished:
                raise StopAsyncIteration
            self._ready.clear()
            await self._ready.wait()

    def abort(self) -> None:
        """Stop generating (a no-op once finished); the engine frees the blocks."""
        if not self.finished:
            self._owner.abort(self.request_id)

    # Called on the event loop by the AsyncEngine.
    def _put(self, output: RequestOutput) -> None:
        self._latest = output
        if output.finished:
            self.finished = self._got_final = True
        self._ready.set()

    def _fail(self, error: BaseException) -> None:
        if self._got_final:
            return
        self._error = error
        self.finished = True
        self._ready.set()


class AsyncEngine:
    """Serve an ``LLMEngine`` to asyncio code through a dedicated step thread.

    ``max_queued_requests`` bounds the requests that have been accepted but have not
    produced their first output yet; ``add_requests`` raises ``QueueFullError`` beyond it.
    The thread starts with the first request (or ``start()``), bound to the running loop.
    """

    def __init__(self, engine: LLMEngine, *, max_queued_requests: int | None = None) -> None:
        if max_queued_requests is not None and max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be at least 1, got {max_queued_requests}")
        self.engine = engine
        self.max_queued_requests = max_queued_requests
        self._streams: dict[str, RequestStream] = {}
        self._num_queued = 0
        # (command, its future or None); None as a whole means "stop".
        self._commands: queue.SimpleQueue[_Command | None] = queue.SimpleQueue()
        self._listeners: list[OutputListener] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._closing = False
        self._dead: BaseException | None = None
        self._engine_ids: set[str] = set()  # step thread only: requests inside the engine
        self.num_step_failures = 0

    # ------------------------------------------------------------------ public API

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def config(self) -> Any:
        return self.engine.config

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

    def add_listener(self, listener: OutputListener) -> None:
        """Call ``listener(outputs, step_end_time)`` on the loop after every step (metrics)."""
        self._listeners.append(listener)

    def start(self) -> None:
        """Start the step thread, bound to the running event loop (idempotent)."""
        if self._thread is not None:
            return
        self._check_open()
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="pagedllm-step", daemon=True)
        self._thread.start()

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
        now = time.monotonic()
        streams = [RequestStream(s.request_id, self, now) for s in specs]
        for stream in streams:
            if stream.request_id in self._streams:
                raise ValueError(f"request_id {stream.request_id!r} is already in flight")
        for stream in streams:
            self._streams[stream.request_id] = stream
        self._num_queued += len(streams)
        try:
            await self._submit(lambda: self._add_all(specs))
        except BaseException:
            # Refused, or the caller was cancelled while the add was queued: in the
            # latter case the add still runs, so abort after it (commands run in order).
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
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield cumulative outputs; leaving early (or being cancelled) aborts the request."""
        stream = await self.add_request(
            request_id, prompt, params, priority=priority, cache_salt=cache_salt
        )
        try:
            async for output in stream:
                yield output
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe; returns at once). Its blocks are freed by the
        step thread before its next step."""
        if self._loop is not None and not _on_loop(self._loop):
            self._call_on_loop(self._forget_id, request_id)
        else:
            self._forget_id(request_id)
        self._commands.put((lambda: self._abort_in_engine([request_id]), None))

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` between two steps (on the step thread when it runs)."""
        if self._thread is None or not self._thread.is_alive():
            return fn(self.engine)  # no thread: nobody else touches the engine
        return await self._submit(lambda: fn(self.engine))

    async def get_stats(self) -> Any:
        """``LLMEngine.get_stats()``, read safely between two steps."""
        return await self.call(lambda engine: engine.get_stats())

    async def shutdown(self, *, drain_timeout: float = 0.0) -> None:
        """Stop accepting; let in-flight requests finish for up to ``drain_timeout``
        seconds, abort the rest, and stop the step thread."""
        self._closing = True
        deadline = time.monotonic() + drain_timeout
        while self._streams and time.monotonic() < deadline and self._dead is None:
            await asyncio.sleep(0.02)
        ids = list(self._streams)
        for request_id in ids:
            stream = self._streams[request_id]
            self._forget(stream)
            stream._fail(EngineClosedError("the server is shutting down"))
        thread = self._thread
        if thread is not None:
            self._commands.put((lambda: self._abort_in_engine(ids), None))
            self._commands.put(None)  # a second shutdown adds another: never read, harmless
            await asyncio.to_thread(thread.join)
            self._thread = None
        await asyncio.to_thread(self.engine.close)  # the disk tier's queued writes

    # ------------------------------------------------------------------ event-loop side

    def _check_open(self) -> None:
        if self._dead is not None:
            raise EngineClosedError(f"the engine step loop has died: {self._dead!r}")
        if self._closing:
            raise EngineClosedError("the server is shutting down")

    async def _submit(self, fn: Callable[[], T]) -> T:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._commands.put((fn, future))
        return await asyncio.wrap_future(future)

    def _forget_id(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            self._forget(stream)

    def _forget(self, stream: RequestStream) -> None:
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]
            if stream.first_output_time is None:
                self._num_queued -= 1
        stream.finished = True
        stream._latest = None  # aborted: nothing more is delivered
        stream._ready.set()  # a waiting iterator ends instead of hanging

    def _deliver(self, outputs: Sequence[RequestOutput], step_time: float) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # aborted by its client meanwhile
            if stream.first_output_time is None:
                stream.first_output_time = step_time
                self._num_queued -= 1
            if output.finished:
                del self._streams[output.request_id]
            stream._put(output)
        for listener in self._listeners:
            try:
                listener(outputs, step_time)
            except Exception:
                logger.exception("output listener failed")

    def _fail_streams(self, request_ids: Sequence[str], error: BaseException) -> None:
        for request_id in request_ids:
            stream = self._streams.get(request_id)
            if stream is not None:
                self._forget(stream)
                stream._fail(error)

    def _mark_dead(self, error: BaseException) -> None:
        self._dead = error
        self._fail_streams(list(self._streams), EngineClosedError(f"engine failed: {error!r}"))

    # ------------------------------------------------------------------ step thread side

    def _add_all(self, specs: Sequence[RequestSpec]) -> None:
        added: list[str] = []
        try:
            for spec in specs:
                self.engine.add_request(
                    spec.request_id,
                    spec.prompt,
                    spec.params,
                    priority=spec.priority,
                    cache_salt=spec.cache_salt,
                )
                added.append(spec.request_id)
                self._engine_ids.add(spec.request_id)
        except BaseException:
            self._abort_in_engine(added)
            raise

    def _abort_in_engine(self, request_ids: Sequence[str]) -> None:
        if not request_ids:
            return
        self._engine_ids.difference_update(request_ids)
        try:
            self.engine.abort_request(list(request_ids))
        except Exception:
            logger.exception("abort_request(%s) failed", list(request_ids))

    def _run(self) -> None:
        assert self._loop is not None
        try:
            while self._run_commands(block=not self.engine.has_unfinished_requests()):
                if self.engine.has_unfinished_requests():
                    self._step_once()
        except BaseException as exc:  # the loop itself broke: fail everyone, say so
            logger.exception("engine step loop died")
            self._call_on_loop(self._mark_dead, exc)
        finally:
            self._refuse_pending()

    def _run_commands(self, *, block: bool) -> bool:
        """Run queued commands (waiting for one when idle). False means stop."""
        try:
            command = self._commands.get() if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if command is None:
                return False
            _run_command(*command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _refuse_pending(self) -> None:
        """After the loop ends, fail the futures of commands nobody will run."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command is not None and command[1] is not None:
                command[1].set_exception(EngineClosedError("the engine has stopped"))

    def _step_once(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            # The contract says step() fails single requests itself; if the step as a
            # whole raises, fail what is in flight and keep serving new requests.
            logger.exception("engine.step() raised; failing the requests in flight")
            self.num_step_failures += 1
            ids = sorted(self._engine_ids)
            self._abort_in_engine(ids)
            error = RequestFailedError(f"engine step failed: {exc!r}")
            self._call_on_loop(self._fail_streams, ids, error)
            if self.engine.has_unfinished_requests():
                raise RuntimeError("engine still busy after aborting a failed step") from exc
            return
        for output in outputs:
            if output.finished:
                self._engine_ids.discard(output.request_id)
        if outputs:
            self._call_on_loop(self._deliver, outputs, time.monotonic())

    def _call_on_loop(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        # RuntimeError: the loop is closed, so nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(fn, *args)


def _run_command(fn: Callable[[], Any], future: concurrent.futures.Future | None) -> None:
    if future is None:
        fn()
        return
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(fn())
    except BaseException as exc:
        future.set_exception(exc)


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False
