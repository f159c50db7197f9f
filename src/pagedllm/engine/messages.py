"""Every message between the server process and the engine core, and the one codec.

::

    server (AsyncEngine)                               engine core (core.py)
    --------------------                               ---------------------
    calls, answered by Returned / Raised:              Ready(EngineInfo)        once, first
      AddRequests(specs)            -> None            Deltas(deltas)           per step
      GetStats()                    -> EngineStats     CacheEvents(batch)       once watched
      GetCacheReport(), ...         -> dict            Returned / Raised        a call's answer
    one-way:                                           Dead(reason)             the loop broke
      AbortRequests, StopSequences, Shutdown

A message is a frozen dataclass; a frame is ``[name, call_id, message]`` in msgpack, the
message a map of its fields, decoded by msgspec straight into its class from the type
hints (nested dataclasses, tuples, optional fields: ``SamplingParams``, ``RequestDelta``
and whatever they hold). So a new field of a request or a delta needs no codec code: a
field with a default decodes from a frame without it, and an unknown field is ignored.
A field's annotation is what it holds once built (normalize inputs in ``__post_init__``),
and a union in it holds at most one array type (list, tuple, set) and at most one map type
(a dict or a dataclass): msgspec decodes by the annotation and refuses other unions when
the ``Codec`` is made, so every test that starts a core says so at once.

A call is a message whose sender waits for an answer: a subclass of ``Call[R]`` where
``R`` is the type of its result, which the answer is decoded into. A new thing the server
asks of the core is a new ``Call`` here, its handler in ``EngineCore`` and its method on
``AsyncEngine``; the core answers only the calls declared here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, TypeVar, get_args

import msgspec

from pagedllm.engine.config import DEFAULT_GRAMMAR_COMPILE_LIMIT_S
from pagedllm.engine.elastic import ResizeReport
from pagedllm.engine.outputs import RequestDelta
from pagedllm.engine.reports import EngineStats
from pagedllm.sampling_params import SamplingParams

R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request to add: what ``LLMEngine.add_request`` takes."""

    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the server needs to know of the engine, sent once with ``Ready``."""

    model: str
    model_name: str
    max_model_len: int
    vocab_size: int
    block_size: int
    num_blocks: int  # the most device blocks one request may count on
    max_num_tokens: int  # the most tokens (prompt + max_tokens) one request may have
    pid: int
    tool_call_parser: str = "auto"  # --tool-call-parser: how the server reads tool calls
    grammar_compile_limit_s: float = DEFAULT_GRAMMAR_COMPILE_LIMIT_S  # the server compiles too


class Call(Generic[R]):
    """A message the core answers with a value of type ``R`` (``result_type``)."""

    __slots__ = ()


# ---------------------------------------------------------------- server -> core: calls


@dataclass(frozen=True, slots=True)
class AddRequests(Call[None]):
    """Add all of them or none (the first refusal is raised)."""

    specs: tuple[RequestSpec, ...]


@dataclass(frozen=True, slots=True)
class GetStats(Call[EngineStats]):
    """``LLMEngine.get_stats()`` between two steps."""


@dataclass(frozen=True, slots=True)
class GetCacheReport(Call[dict[str, Any]]):
    """The ``/v1/cache`` report (``engine/reports.py``)."""


@dataclass(frozen=True, slots=True)
class GetBlocksReport(Call[dict[str, Any]]):
    """The dashboard's per-block report (``engine/reports.py``)."""


@dataclass(frozen=True, slots=True)
class GetEventsReport(Call[dict[str, Any]]):
    """The prefix cache's events after ``since`` in log ``epoch`` (a snapshot when the
    log is another): ``GET /v1/cache/events``'s body."""

    epoch: str | None
    since: int


@dataclass(frozen=True, slots=True)
class WatchEvents(Call[int]):
    """Push ``CacheEvents`` from now on; answers the log's ``next_seq``."""


@dataclass(frozen=True, slots=True)
class StartResize(Call[int]):
    """Begin resizing the device tier to ``num_bytes`` between steps; answers its id."""

    num_bytes: int
    preempt: bool = False


@dataclass(frozen=True, slots=True)
class GetResizeReport(Call[ResizeReport | None]):
    """The report of resize ``resize_id`` once it is done (None while under way)."""

    resize_id: int


@dataclass(frozen=True, slots=True)
class GetCacheCapacityBlocks(Call[int]):
    """The most device blocks one request may count on now."""


@dataclass(frozen=True, slots=True)
class GetMaxNumTokens(Call[int]):
    """The most tokens (prompt + ``max_tokens``) one request may have now."""


@dataclass(frozen=True, slots=True)
class GetNumUnfinishedRequests(Call[int]):
    """Requests the engine has not finished."""


@dataclass(frozen=True, slots=True)
class FlushDiskTier(Call[None]):
    """Wait until every block queued for the disk tier is written."""


@dataclass(frozen=True, slots=True)
class ResetPrefixCache(Call[bool]):
    """Forget every cached block; False (nothing done) while requests are unfinished."""


# ---------------------------------------------------------------- server -> core: one-way


@dataclass(frozen=True, slots=True)
class AbortRequests:
    request_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class StopSequences:
    """The sequences of a request that the server's stop strings ended: (index, stop)."""

    request_id: str
    stopped: tuple[tuple[int, str], ...]


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Stop the loop (after the messages before it)."""


# ---------------------------------------------------------------- core -> server


@dataclass(frozen=True, slots=True)
class Ready:
    info: EngineInfo


@dataclass(frozen=True, slots=True)
class Deltas:
    """One step's new tokens, one ``RequestDelta`` per request it advanced."""

    deltas: tuple[RequestDelta, ...]


@dataclass(frozen=True, slots=True)
class CacheEvents:
    """A batch of prefix-cache events (``GetEventsReport``'s shape), contiguous with the
    last one pushed."""

    batch: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Returned:
    """A call's result, still encoded: the caller decodes it into the call's type."""

    value: msgspec.Raw


@dataclass(frozen=True, slots=True)
class Raised:
    """A call failed: ``error_type`` is "ValueError", "TypeError" or "KeyError" for those
    (and their subclasses), else the exception's class name."""

    error_type: str
    message: str


@dataclass(frozen=True, slots=True)
class Dead:
    """The core's loop broke (or it failed to start): why."""

    reason: str


CALLS: tuple[type[Call[Any]], ...] = (
    AddRequests, GetStats, GetCacheReport, GetBlocksReport, GetEventsReport, WatchEvents,
    StartResize, GetResizeReport, GetCacheCapacityBlocks, GetMaxNumTokens,
    GetNumUnfinishedRequests, FlushDiskTier, ResetPrefixCache,
)  # fmt: skip
MESSAGES: tuple[type, ...] = (
    *CALLS, AbortRequests, StopSequences, Shutdown,
    Ready, Deltas, CacheEvents, Returned, Raised, Dead,
)  # fmt: skip
# The errors a call raises at its caller as themselves; any other becomes a UtilityError.
PASSED_ERRORS: tuple[type[Exception], ...] = (ValueError, TypeError, KeyError)


def result_type(call: type[Call[Any]]) -> Any:
    """``R`` of a ``Call[R]`` subclass."""
    for base in getattr(call, "__orig_bases__", ()):
        args = get_args(base)
        if args:
            return args[0]
    raise TypeError(f"{call.__name__} does not name its result type (Call[R])")


def raised(exc: BaseException) -> Raised:
    """The answer of a call that raised ``exc``."""
    passed = next((t for t in PASSED_ERRORS if isinstance(exc, t)), type(exc))
    return Raised(passed.__name__, str(exc))


class Envelope(NamedTuple):
    """A decoded frame: the message, and the call id (None for a one-way message)."""

    message: Any
    call_id: int | None


class MessageError(ValueError):
    """A frame that is no message declared here, or whose fields do not fit its class
    (``call_id``: the caller waiting for an answer, if it could be read)."""

    def __init__(self, reason: str, call_id: int | None = None) -> None:
        super().__init__(reason)
        self.call_id = call_id


class Codec:
    """Frames to messages and back (one per side of the wire; it keeps its decoders)."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._frame = msgspec.msgpack.Decoder(tuple[str, int | None, msgspec.Raw])
        self._messages = {m.__name__: msgspec.msgpack.Decoder(m) for m in MESSAGES}
        self._values: dict[Any, msgspec.msgpack.Decoder[Any]] = {}

    def encode(self, message: Any, call_id: int | None = None) -> bytes:
        return self._encoder.encode((type(message).__name__, call_id, message))

    def decode(self, frame: bytes) -> Envelope:
        """The message of ``frame``; ``MessageError`` for an undeclared name or fields
        that do not fit (a value the class's own checks refuse included)."""
        try:
            name, call_id, raw = self._frame.decode(frame)
        except msgspec.DecodeError as exc:
            raise MessageError(f"not a message frame: {exc}") from None
        decoder = self._messages.get(name)
        if decoder is None:
            raise MessageError(f"no message named {name!r}", call_id)
        try:
            return Envelope(decoder.decode(raw), call_id)
        except msgspec.DecodeError as exc:
            raise MessageError(f"{name}: {exc}", call_id) from None

    def returned(self, value: Any) -> Returned:
        """The answer of a call that returned ``value``."""
        return Returned(msgspec.Raw(self._encoder.encode(value)))

    def encode_value(self, value: Any) -> bytes:
        """``value`` (dataclasses, tuples, dicts, ... nested) as msgpack."""
        return self._encoder.encode(value)

    def decode_value(self, data: bytes | msgspec.Raw, value_type: Any = Any) -> Any:
        """``data`` as a ``value_type`` (a dataclass, a ``dict[str, Any]``, ...)."""
        decoder = self._values.get(value_type)
        if decoder is None:
            decoder = self._values[value_type] = msgspec.msgpack.Decoder(value_type)
        return decoder.decode(data)
