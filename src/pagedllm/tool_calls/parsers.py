"""Tool calls in a model's own words, read as the text streams: one parser per family.

=============  ============================================================================
hermes         ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, repeated
               (Hermes, Qwen2.5); ``generic`` is the same format, for models whose template
               cannot show tools (``tool_calls/render.py`` describes it in a system prompt)
llama3_json    the whole reply is ``{"name": ..., "parameters": {...}}`` (``<|python_tag|>``
               before it optional, further calls after ``;``), as Llama 3.1-3.3 answer
mistral        ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``
=============  ============================================================================

``ToolCallStream.feed(text)`` takes each new piece of a completion and answers what is now
certain (``ParsedDelta``): content, and per call its id and name first, then fragments of
its arguments. A call's ``arguments`` are the model's own characters for that JSON value,
as it wrote them (no re-serialisation), so the fragments concatenate to exactly the
non-streamed string, and no bracket is ever sent before the model wrote it. The parse of
a whole text (``parse_tool_calls``) is the same machine fed once, so any split of the
text into pieces gives the same calls and content.

Whitespace next to a call is not content; text around calls is. A block that turns out
not to be a call before its name is read (``<tool_call>hello``) is content after all; one
whose name was sent stays a call, with the arguments the model got to write (``{}`` when
it wrote none).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagedllm.tool_calls.json_scan import WHITESPACE, ObjectScanner

FORMATS = ("hermes", "llama3_json", "mistral", "generic")
# ``--tool-call-parser``: a format, or "auto" (read from the chat template).
TOOL_CALL_PARSERS = ("auto", *FORMATS)


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call: ``arguments`` is JSON text (an object, as the model wrote it)."""

    id: str
    name: str
    arguments: str

    def to_dict(self) -> dict[str, Any]:
        """The OpenAI shape (an assistant message's ``tool_calls`` entry)."""
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """What is new in call ``index``: its ``id`` and ``name`` in its first delta, then
    fragments of its ``arguments``."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True, slots=True)
class ParsedDelta:
    content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


@dataclass(frozen=True, slots=True)
class ParsedReply:
    """A whole reply: ``content`` None when the reply is only calls."""

    content: str | None
    tool_calls: tuple[ToolCall, ...]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call_stream(fmt: str, make_id: Callable[[], str] = new_call_id) -> ToolCallStream:
    """The incremental parser of format ``fmt`` (one of ``FORMATS``)."""
    streams: dict[str, type[ToolCallStream]] = {
        "hermes": HermesStream,
        "generic": HermesStream,
        "llama3_json": Llama3JsonStream,
        "mistral": MistralStream,
    }
    if fmt not in streams:
        raise ValueError(f"tool call format must be one of {FORMATS}, got {fmt!r}")
    return streams[fmt](make_id)


def parse_tool_calls(fmt: str, text: str, make_id: Callable[[], str] = new_call_id) -> ParsedReply:
    """The calls and content of a whole reply in format ``fmt``."""
    stream = tool_call_stream(fmt, make_id)
    stream.feed(text)
    stream.finish()
    return stream.reply()


@dataclass(slots=True)
class _ContentGate:
    """Whitespace next to a call is not content: a run of whitespace waits until text
    follows it (then it is content) or a call does (then it is dropped)."""

    pending: str = ""
    parked: str = ""  # the run before a block that may still turn out to be text
    after_call: bool = False

    def add(self, text: str) -> str:
        if self.after_call:
            text = text.lstrip(WHITESPACE)
            if not text:
                return ""
            self.after_call = False
        body = text.rstrip(WHITESPACE)
        if not body:
            self.pending += text
            return ""
        out, self.pending = self.pending + body, text[len(body) :]
        return out

    def block_started(self) -> None:
        self.parked, self.pending = self.pending, ""

    def block_kept(self) -> None:
        self.parked = ""

    def block_dropped(self) -> None:
        self.pending, self.parked = self.parked + self.pending, ""

    def call_ended(self) -> None:
        self.after_call = True

    def finish(self) -> str:
        out = "" if self.after_call else self.pending
        self.pending = ""
        return out


@dataclass(slots=True)
class _Call:
    """The call being read: its block starts at ``start`` (where its text would begin
    as content, should it not be a call)."""

    index: int
    start: int
    scanner: ObjectScanner
    id: str | None = None
    name: str | None = None
    args_key: str | None = None
    args_sent: int | None = None  # text index the arguments were sent up to
    arguments: list[str] = field(default_factory=list)


class ToolCallStream:
    """The machinery every family shares: the text so far, the calls, what to send.

    A family (subclass) reads its markers in ``_advance`` and hands each JSON object to
    ``_begin_call`` / ``_read_call``."""

    ARG_KEYS: tuple[str, ...] = ("arguments",)

    def __init__(self, make_id: Callable[[], str] = new_call_id) -> None:
        self._make_id = make_id
        self._text = ""
        self._pos = 0
        self._state = "start"
        self._gate = _ContentGate()
        self._call: _Call | None = None
        self._calls: list[ToolCall] = []
        self._content: list[str] = []
        self._new_content: list[str] = []
        self._new_calls: dict[int, ToolCallDelta] = {}
        self._finished = False

    def feed(self, text: str, *, last: bool = False) -> ParsedDelta:
        """Add the next piece of the reply (``last``: the reply ends with it); what is
        now certain."""
        if self._finished:
            raise ValueError("this reply has finished")
        self._text += text
        self._advance(final=False)
        if last:
            self._finish()
        return self._take()

    def finish(self) -> ParsedDelta:
        """The reply has ended: what was held back, and the last call closed."""
        if not self._finished:
            self._finish()
        return self._take()

    def reply(self) -> ParsedReply:
        """Everything so far as one reply (call it after ``finish``)."""
        content = "".join(self._content)
        calls = tuple(self._calls)
        return ParsedReply(None if calls and not content else content, calls)

    def _finish(self) -> None:
        self._finished = True
        self._advance(final=True)
        if self._call is not None:  # the text ended inside a call
            self._end_call(len(self._text))
        self._send_content(self._gate.finish())

    # ------------------------------------------------------------------ for families

    def _advance(self, final: bool) -> None:
        raise NotImplementedError

    def _content_until(self, end: int) -> None:
        """``text[pos:end]`` is content."""
        self._send_content(self._gate.add(self._text[self._pos : end]))
        self._pos = end

    def _begin_call(self, start: int, object_start: int, new_block: bool = True) -> None:
        """A call's block starts at ``start`` and its JSON object at ``object_start``
        (``new_block``: the family has not already started the block at ``start``)."""
        if new_block:
            self._gate.block_started()
        self._call = _Call(len(self._calls), start, ObjectScanner(object_start))

    def _read_call(self) -> str:
        """Read the call on: "open" (more text needed), "done" (its object closed) or
        "text" (it was not a call: its text went to content); ``pos`` is then past what
        it took."""
        call = self._call
        assert call is not None
        scanner = call.scanner
        scanner.scan(self._text)
        if call.name is None and not self._read_name(call):
            # Text up to the end of the bad name: the same place however the text came.
            return self._drop_call(scanner.spans["name"][1])
        self._send_arguments(call)
        if scanner.broken or scanner.done:  # pos: on the bad character, or past the "}"
            if call.id is None:  # never a name: text
                return self._drop_call(scanner.pos)
            self._end_call(scanner.pos)
            return "done"
        return "open"

    def _skip_whitespace(self) -> int | None:
        """Move ``pos`` past whitespace; the index of the next character, None at the end."""
        text = self._text
        while self._pos < len(text) and text[self._pos] in WHITESPACE:
            self._pos += 1
        return self._pos if self._pos < len(text) else None

    def _waits_for(self, marker: str, final: bool) -> bool:
        """True when the text from ``pos`` may still become ``marker``."""
        rest = self._text[self._pos :]
        return not final and len(rest) < len(marker) and marker.startswith(rest)

    # ------------------------------------------------------------------ internals

    def _read_name(self, call: _Call) -> bool:
        """Send the call's id and name once its name string is complete; False when
        the name is not a string."""
        span = call.scanner.spans.get("name")
        if span is None:
            return True
        try:
            name = json.loads(self._text[span[0] : span[1]])
        except ValueError:
            return False
        if not isinstance(name, str) or not name:
            return False
        call.name, call.id = name, self._make_id()
        self._gate.block_kept()
        self._send_call(ToolCallDelta(call.index, call.id, name))
        return True

    def _send_arguments(self, call: _Call) -> None:
        """Send the arguments' characters the model has written since the last send
        (a string value, encoded JSON, goes whole once it is closed)."""
        scanner = call.scanner
        if call.args_key is None:
            call.args_key = next(
                (k for k in self.ARG_KEYS if scanner.value_start_of(k) is not None), None
            )
        if call.args_key is None or call.id is None:
            return
        start = scanner.value_start_of(call.args_key)
        end = scanner.value_end(call.args_key)
        assert start is not None and end is not None
        if self._text[start] == '"':
            if call.args_key in scanner.spans and call.args_sent is None:
                self._send_fragment(call, _decoded_string(self._text[start:end]))
                call.args_sent = end
            return
        sent = start if call.args_sent is None else call.args_sent
        if end > sent:
            self._send_fragment(call, self._text[sent:end])
            call.args_sent = end

    def _send_fragment(self, call: _Call, fragment: str) -> None:
        call.arguments.append(fragment)
        self._send_call(ToolCallDelta(call.index, arguments=fragment))

    def _end_call(self, end: int) -> None:
        """Close the current call (``pos`` moves to ``end``); one that never got its name
        is text."""
        call = self._call
        assert call is not None
        if call.id is None:
            self._drop_call(end)
            return
        if not call.arguments:
            self._send_fragment(call, "{}")
        assert call.name is not None
        self._calls.append(ToolCall(call.id, call.name, "".join(call.arguments)))
        self._call = None
        self._gate.call_ended()
        self._pos = end

    def _drop_call(self, end: int) -> str:
        """The block from the call's start to ``end`` was text after all."""
        call = self._call
        assert call is not None and call.id is None
        self._call = None
        self._gate.block_dropped()
        self._pos = call.start
        self._content_until(end)
        return "text"

    def _send_content(self, text: str) -> None:
        if text:
            self._content.append(text)
            self._new_content.append(text)

    def _send_call(self, delta: ToolCallDelta) -> None:
        old = self._new_calls.get(delta.index)
        if old is not None:
            delta = ToolCallDelta(
                delta.index, old.id or delta.id, old.name or delta.name,
                old.arguments + delta.arguments,
            )  # fmt: skip
        self._new_calls[delta.index] = delta

    def _take(self) -> ParsedDelta:
        delta = ParsedDelta("".join(self._new_content), tuple(self._new_calls.values()))
        self._new_content, self._new_calls = [], {}
        return delta


def _decoded_string(raw: str) -> str:
    """Arguments a model wrote as a JSON string (encoded JSON): the string's text."""
    try:
        value = json.loads(raw)
    except ValueError:
        return raw
    return value if isinstance(value, str) else raw


class HermesStream(ToolCallStream):
    """``<tool_call>{...}</tool_call>`` blocks among text."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def _advance(self, final: bool) -> None:
        while True:
            if self._state in ("start", "text"):
                if not self._read_text(final):
                    return
            elif self._state == "call":
                status = self._read_call()
                if status == "open":
                    return
                self._state = "close" if status == "done" else "text"
            elif not self._read_close(final):
                return

    def _read_text(self, final: bool) -> bool:
        """Content up to the next block (True: a block starts) or the end (False; the
        start of what may be an opening tag is held back)."""
        text = self._text
        found = text.find(self.OPEN, self._pos)
        if found < 0:
            keep = 0 if final else _marker_prefix_len(text, self._pos, self.OPEN)
            self._content_until(len(text) - keep)
            return False
        self._content_until(found)
        self._begin_call(found, found + len(self.OPEN))
        self._state = "call"
        return True

    def _read_close(self, final: bool) -> bool:
        if self._skip_whitespace() is None and not final:
            return False
        if self._text.startswith(self.CLOSE, self._pos):
            self._pos += len(self.CLOSE)
        elif self._waits_for(self.CLOSE, final):
            return False
        self._state = "text"  # a missing closing tag: what follows is text, or a block
        return True


class Llama3JsonStream(ToolCallStream):
    """A reply that starts with ``{`` (or ``<|python_tag|>``) is calls separated by
    ``;``; any other reply is content."""

    ARG_KEYS = ("parameters", "arguments")
    TAG = "<|python_tag|>"

    def _advance(self, final: bool) -> None:
        while True:
            if self._state == "start":
                if not self._read_start(final):
                    return
            elif self._state == "call":
                status = self._read_call()
                if status == "open":
                    return
                self._state = "between" if status == "done" else "text"
            elif self._state == "between":
                if not self._read_between(final):
                    return
            else:
                self._content_until(len(self._text))
                return

    def _read_start(self, final: bool) -> bool:
        text, start = self._text, self._pos
        first = self._skip_whitespace()
        self._pos = start  # leading whitespace is content if this is no call
        if first is None:
            if final:
                self._state = "text"
            return final
        if text.startswith(self.TAG, first):
            self._begin_call(start, first + len(self.TAG))
        elif text[first] == "{":
            self._begin_call(start, first)
        elif self.TAG.startswith(text[first:]) and not final:
            return False
        else:
            self._state = "text"
            return True
        self._state = "call"
        return True

    def _read_between(self, final: bool) -> bool:
        first = self._skip_whitespace()
        if first is None:
            return False
        if self._text[first] == ";":
            self._pos += 1
            return True
        if self._text[first] == "{":
            self._begin_call(first, first)
            self._state = "call"
        else:
            self._state = "text"
        return True


class MistralStream(ToolCallStream):
    """Text, then ``[TOOL_CALLS]`` and a JSON list of calls (more such lists may follow)."""

    MARKER = "[TOOL_CALLS]"

    def __init__(self, make_id: Callable[[], str] = new_call_id) -> None:
        super().__init__(make_id)
        self._block_start = 0  # the marker of the list being read
        self._first_item = True

    def _advance(self, final: bool) -> None:
        while True:
            state = self._state
            if state in ("start", "text"):
                progressed = self._read_text(final)
            elif state == "list":
                progressed = self._read_list_start(final)
            elif state == "call":
                status = self._read_call()
                progressed = status != "open"
                if progressed:
                    self._state = "after_item" if status == "done" else "text"
            else:
                progressed = self._read_item(final)
            if not progressed:
                return

    def _read_text(self, final: bool) -> bool:
        text = self._text
        found = text.find(self.MARKER, self._pos)
        if found < 0:
            keep = 0 if final else _marker_prefix_len(text, self._pos, self.MARKER)
            self._content_until(len(text) - keep)
            return False
        self._content_until(found)
        self._gate.block_started()
        self._block_start, self._first_item = found, True
        self._pos = found + len(self.MARKER)
        self._state = "list"
        return True

    def _read_list_start(self, final: bool) -> bool:
        first = self._skip_whitespace()
        if first is None:
            if final:
                self._not_a_list()
            return final
        if self._text[first] == "[":
            self._pos += 1
            self._state = "item"
        else:
            self._not_a_list()
        return True

    def _not_a_list(self) -> None:
        """The marker did not start a list: it is text."""
        self._gate.block_dropped()
        end, self._pos = self._pos, self._block_start
        self._content_until(end)
        self._state = "text"

    def _read_item(self, final: bool) -> bool:
        first = self._skip_whitespace()
        if first is None:
            return False
        ch = self._text[first]
        if self._state == "after_item" and ch == ",":
            self._pos += 1
            self._state = "item"
        elif ch == "{" and self._state == "item":
            # The list's first call, should it be text, takes the marker with it.
            opened = self._block_start if self._first_item else first
            self._begin_call(opened, first, new_block=not self._first_item)
            self._first_item = False
            self._state = "call"
        else:
            if ch == "]":
                self._pos += 1
            self._gate.call_ended()
            self._state = "text"
        return True


def _marker_prefix_len(text: str, start: int, marker: str) -> int:
    """The length of the longest end of ``text[start:]`` that begins ``marker``."""
    for size in range(min(len(marker) - 1, len(text) - start), 0, -1):
        if marker.startswith(text[len(text) - size :]):
            return size
    return 0
