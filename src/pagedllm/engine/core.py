"""``EngineCore``: the scheduler, model runner and sampler (an ``LLMEngine``) behind a
message loop, and the wire format between it and the server.

::

    API server process (asyncio)               engine core (own process, or a thread)
    ----------------------------               -------------------------------------
    AsyncEngine   --- input socket (PUSH) -->  run_core_loop: between two steps, runs
                                                 ["add", call_id, specs]
                                                 ["abort", request_ids]
                                                 ["stop", request_id, [[index, stop]]]
                                                 ["utility", call_id, name, args]
                                                 ["shutdown"]
                  <-- output socket (PULL) --  ["ready", info]            (once, first)
                                               ["deltas", [request delta, ...]]  (per step)
                                               ["result", call_id, ok, value | error]
                                               ["events", batch]   (once watched: see below)
                                               ["dead", message]          (the loop broke)

Every message is one msgpack frame over ZeroMQ. A step sends each advanced request's
new token ids (``RequestDelta``); the server builds the outputs (``OutputProcessor``:
text, stop strings) and sends "stop" for the sequences a stop string ended. ``LLM``
(offline) drives the same ``LLMEngine`` in its own thread, with no loop and no sockets.

Utility calls: ``["utility", id, name, args]`` runs ``name(*args)`` on the core between two
steps -- one of ``EngineCore.UTILITIES`` or else a public method of the ``LLMEngine`` -- and
answers with its result made msgpack-able by ``to_wire`` (dataclasses become dicts, tuples
and sets lists). A new engine feature that the server must reach needs a method and a
route (``await engine.call_utility("name", arg)``), never a new message.

Cache events (a router's feed): after the utility ``watch_events``, the core pushes
``["events", batch]`` whenever the prefix cache's event log moved -- after the step's
schedule (the evictions its allocations made, before the model runs) and after the step
(the blocks it registered) -- so a reader's view lags the index by a message, not a poll.
``batch`` is ``events_report``'s answer (``GET /v1/cache/events``'s body, hashes as hex)
from where the last push ended; successive batches are contiguous (a new ``epoch`` means a
new log: read a snapshot).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import msgpack

from pagedllm.core.outputs import TokenLogprob
from pagedllm.engine.outputs import RequestDelta, SequenceDelta
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    import zmq

    from pagedllm.engine.config import EngineConfig
    from pagedllm.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

# How often an idle core looks whether its server process is still there (seconds).
_PARENT_CHECK_S = 1.0


class UtilityError(RuntimeError):
    """A utility call failed in the engine core with an error other than ValueError,
    TypeError or KeyError (those are raised as themselves)."""


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request to add: what ``LLMEngine.add_request`` takes."""

    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None


class EngineFactory(Protocol):
    """Builds the engine inside the core's process, and the tokenizer in the server's.

    It crosses to a spawned process, so it must pickle (a frozen dataclass of plain values).
    """

    def build_engine(self) -> LLMEngine: ...

    def load_tokenizer(self) -> Any: ...


@dataclass(frozen=True, slots=True)
class ConfigEngineFactory:
    """The engine of ``pagedllm serve``: ``LLMEngine.from_config(config)``."""

    config: EngineConfig

    def build_engine(self) -> LLMEngine:
        from pagedllm.engine.llm_engine import LLMEngine

        return LLMEngine.from_config(self.config)

    def load_tokenizer(self) -> Any:
        if self.config.skip_tokenizer_init:
            return None
        from pagedllm.model.loader import load_tokenizer

        return load_tokenizer(self.config.model)


# ---------------------------------------------------------------- the wire


def pack(message: Any) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(frame: bytes) -> Any:
    # Integer map keys: logit_bias is {token id: bias}.
    return msgpack.unpackb(frame, raw=False, strict_map_key=False)


def to_wire(value: Any) -> Any:
    """``value`` as msgpack-able data: dataclasses as dicts (their fields only), tuples,
    sets and frozensets as lists; anything else unchanged."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_wire(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {k: to_wire(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [to_wire(v) for v in value]
    return value


def encode_spec(spec: RequestSpec) -> list[Any]:
    params = {
        f.name: to_wire(getattr(spec.params, f.name))
        for f in dataclasses.fields(spec.params)
        if f.name != "all_stop_token_ids"  # the engine derives it
    }
    return [spec.request_id, spec.prompt, params, spec.priority, spec.cache_salt]


def decode_spec(data: list[Any]) -> RequestSpec:
    request_id, prompt, params, priority, cache_salt = data
    structured = params.pop("structured_outputs", None)
    if structured is not None:  # a nested record: to_wire made it a dict
        params["structured_outputs"] = StructuredOutputsParams.from_dict(structured)
    return RequestSpec(request_id, prompt, SamplingParams(**params), priority, cache_salt)


def encode_deltas(deltas: Sequence[RequestDelta]) -> list[Any]:
    return [
        [
            d.request_id, [_encode_seq(s) for s in d.seqs], d.finished, d.num_cached_tokens,
            d.error, d.cache_event_seq, _encode_logprobs(d.prompt_logprobs),
            d.arrival_event_seq,
        ]
        for d in deltas
    ]  # fmt: skip


def decode_deltas(data: list[Any]) -> list[RequestDelta]:
    return [
        RequestDelta(
            request_id, tuple(_decode_seq(s) for s in seqs), finished, cached, error, event_seq,
            _decode_logprobs(prompt_logprobs), arrival_seq,
        )
        for request_id, seqs, finished, cached, error, event_seq, prompt_logprobs, arrival_seq
        in data
    ]  # fmt: skip


def _encode_logprobs(logprobs: Sequence[TokenLogprob | None] | None) -> list[Any] | None:
    """``TokenLogprob``s as lists (None entries, as a prompt's first, stay None)."""
    if logprobs is None:
        return None
    return [
        None
        if lp is None
        else [lp.token_id, lp.logprob, lp.rank, lp.top_token_ids, lp.top_logprobs]
        for lp in logprobs
    ]


def _decode_logprobs(data: list[Any] | None) -> tuple[Any, ...] | None:
    if data is None:
        return None
    return tuple(
        None
        if entry is None
        else TokenLogprob(entry[0], entry[1], entry[2], tuple(entry[3]), tuple(entry[4]))
        for entry in data
    )


def _encode_seq(seq: SequenceDelta) -> list[Any]:
    logprobs = _encode_logprobs(seq.logprobs)
    return [seq.index, seq.token_ids, logprobs, seq.finish_reason, seq.stop_reason]


def _decode_seq(data: list[Any]) -> SequenceDelta:
    index, token_ids, logprobs, finish_reason, stop_reason = data
    return SequenceDelta(
        index, tuple(token_ids), _decode_logprobs(logprobs), finish_reason, stop_reason
    )


# ---------------------------------------------------------------- the core


class EngineCore:
    """An ``LLMEngine`` seen as the server sees it: requests added atomically, aborts,
    one step at a time with token deltas out, utility calls by name.

    A step that raises as a whole (the engine's own contract is to fail single requests)
    fails every request in flight with the error and the core goes on serving; if the
    engine is still busy after that, the error propagates and the loop ends.
    """

    # Core-level utilities; any other name is looked up on the LLMEngine.
    UTILITIES = frozenset(
        {"cache_report", "blocks_report", "events_report", "watch_events", "info"}
    )

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.num_step_failures = 0
        # (epoch, next_seq) of the cache events pushed so far; None: nobody watches.
        self._events_pushed: tuple[str, int] | None = None

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

    def stop_sequences(self, request_id: str, stopped: Sequence[Sequence[Any]]) -> None:
        """Finish the sequences the server's stop strings ended: (index, stop string)."""
        self.engine.stop_sequences(request_id, [(int(i), str(stop)) for i, stop in stopped])

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

    def call_utility(self, name: str, args: Sequence[Any]) -> Any:
        """``name(*args)`` (see the module docstring), its result made msgpack-able."""
        if not isinstance(name, str) or not name or name.startswith("_"):
            raise ValueError(f"no utility named {name!r}")
        target = getattr(self, name) if name in self.UTILITIES else getattr(self.engine, name, None)
        if not callable(target):
            raise ValueError(f"no utility named {name!r}")
        return to_wire(target(*args))

    # ------------------------------------------------------------------ utilities

    def info(self) -> dict[str, Any]:
        """What the server needs to know of the engine (sent first, with "ready")."""
        engine = self.engine
        return {
            "model": str(engine.config.model),
            "model_name": str(engine.model_name or engine.config.model),
            "max_model_len": int(engine.max_model_len),
            "vocab_size": int(engine.runner.vocab_size),
            "block_size": int(engine.runner.block_size),
            "num_blocks": engine.cache_capacity_blocks(),
            "max_num_tokens": engine.max_num_tokens(),
            "tool_call_parser": engine.config.tool_call_parser,
            "pid": os.getpid(),
        }

    def cache_report(self) -> dict[str, Any]:
        from pagedllm.engine.reports import cache_report

        return cache_report(self.engine.get_stats())

    def blocks_report(self) -> dict[str, Any]:
        from pagedllm.engine.reports import blocks_report

        return blocks_report(self.engine)

    def events_report(self, epoch: str | None, since: int) -> dict[str, Any]:
        from pagedllm.engine.reports import events_report

        return events_report(self.engine, epoch, since)

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
        return self.events_report(log.epoch, since)

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
    """Serve ``core`` over the two sockets until "shutdown" (or the parent process is
    gone). Sends "ready" first; if the loop breaks, sends "dead" and re-raises."""
    import zmq

    inbox = context.socket(zmq.PULL)
    outbox = context.socket(zmq.PUSH)
    inbox.connect(input_address)
    outbox.connect(output_address)
    try:
        outbox.send(pack(["ready", core.info()]))
        _serve(core, inbox, outbox, parent_pid)
    except ServerGone:
        logger.warning("the server process is gone; the engine core stops")
    except BaseException as exc:
        logger.exception("engine core loop died")
        outbox.send(pack(["dead", f"{type(exc).__name__}: {exc}"]))
        raise
    finally:
        try:
            core.close()
        except Exception:
            logger.exception("closing the engine failed")
        inbox.close(linger=0)
        outbox.close(linger=1000)  # let the last messages leave


def _serve(core: EngineCore, inbox: Any, outbox: Any, parent_pid: int | None) -> None:
    import zmq

    handlers: dict[str, Callable[..., bool]] = {
        "add": lambda call_id, specs: _answer(
            outbox, parent_pid, call_id, lambda: core.add_requests([decode_spec(s) for s in specs])
        ),
        "abort": lambda ids: core.abort_requests(ids) or True,
        "stop": lambda request_id, stopped: core.stop_sequences(request_id, stopped) or True,
        "utility": lambda call_id, name, args: _answer(
            outbox, parent_pid, call_id, lambda: core.call_utility(name, args)
        ),
        "shutdown": lambda: False,
    }
    while True:
        _check_parent(parent_pid)  # a step's cost next to a system call: every step
        busy = core.has_unfinished_requests()
        # Idle: wait for a message (looking now and then whether the server still lives).
        while not busy and not inbox.poll(int(_PARENT_CHECK_S * 1000)):
            _check_parent(parent_pid)
            core.engine.elastic_tick()  # the automatic elastic pool shrinks when idle
        while True:  # every waiting message, before the next step
            try:
                frame = inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            kind, *args = unpack(frame)
            if not handlers[kind](*args):
                return
        if core.has_unfinished_requests():
            deltas = core.step(on_scheduled=lambda: _push_events(core, outbox, None))
            if deltas:
                send(outbox, pack(["deltas", encode_deltas(deltas)]), parent_pid)
        _push_events(core, outbox, parent_pid)


def _push_events(core: EngineCore, outbox: Any, parent_pid: int | None) -> None:
    """Send the cache events logged since the last push, if anyone watches. With
    ``parent_pid`` None (mid-step) only if the socket takes it now: a reader that is
    behind gets them with the step's end instead of holding the step up."""
    import zmq

    batch = core.pending_events()
    if batch is None:
        return
    frame = pack(["events", batch])
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


def _answer(outbox: Any, parent_pid: int | None, call_id: int, fn: Callable[[], Any]) -> bool:
    try:
        message = ["result", call_id, True, fn()]
    except Exception as exc:
        message = ["result", call_id, False, [type(exc).__name__, str(exc)]]
    send(outbox, pack(message), parent_pid)
    return True


def core_process_main(factory: EngineFactory, input_address: str, output_address: str) -> None:
    """The entry point of the engine core's own process: build the engine, then serve."""
    import signal

    import zmq

    # Ctrl-C in a terminal reaches the whole process group: the server decides when
    # the core stops (it sends "shutdown" after draining).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parent = os.getppid()
    context = zmq.Context()
    try:
        try:
            with _exit_if_orphaned(parent):
                core = EngineCore(factory.build_engine())
        except BaseException as exc:
            outbox = context.socket(zmq.PUSH)
            outbox.connect(output_address)
            outbox.send(pack(["dead", f"engine start-up failed: {type(exc).__name__}: {exc}"]))
            outbox.close(linger=1000)
            raise
        run_core_loop(core, context, input_address, output_address, parent_pid=parent)
    finally:
        context.destroy(linger=1000)
