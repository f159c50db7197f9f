"""One JSON object read a character at a time, as a model writes it.

``ObjectScanner`` follows the top level of an object (its keys, and where each value
starts and ends) and only the brackets and strings inside the values, which is all a
tool-call parser needs to stream a call: the ``name`` once its string is closed, the
``arguments`` value character by character as the model produces it. It never looks
ahead: ``scan`` consumes what it can decide and returns, and the next ``scan`` carries
on from there, so any split of the text into pieces gives the same result.

A character that cannot stand where it stands (``<`` outside a string, a ``]`` closing
a ``{``) makes the scanner ``broken`` at that character; the caller decides what the
text was instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

WHITESPACE = " \t\n\r"
# Characters of numbers and of true / false / null.
_LITERAL = frozenset("-+.0123456789eEtrufalsn")
_CLOSE = {"{": "}", "[": "]"}


@dataclass(slots=True)
class ObjectScanner:
    """The top level of one JSON object in ``text[start:]`` (whitespace first is skipped).

    ``spans`` maps each key whose value is complete to that value's ``(start, end)`` in
    the text (a repeated key keeps its first value); ``key`` and ``value_start`` describe
    the value being read, if any. ``done`` once the object's ``}`` is read (``pos`` is
    past it), ``broken`` at the first character that cannot be JSON there (``pos`` is
    on it).
    """

    pos: int
    spans: dict[str, tuple[int, int]] = field(default_factory=dict)
    key: str | None = None
    value_start: int | None = None
    done: bool = False
    broken: bool = False
    _state: str = "start"
    _key_start: int = 0
    _stack: list[str] = field(default_factory=list)
    _in_string: bool = False
    _escape: bool = False

    def scan(self, text: str) -> None:
        """Consume ``text[pos:]`` as far as it can be decided."""
        while self.pos < len(text) and not (self.done or self.broken):
            consumed = self._step(text)
            if consumed and not self.broken:
                self.pos += 1
        # A number or literal ends only at the character after it: until one comes, it
        # is still being read.

    def value_end(self, key: str) -> int | None:
        """Where ``key``'s value ends so far: its end once complete, ``pos`` while it is
        being read, None before it starts."""
        if key in self.spans:
            return self.spans[key][1]
        if self.key == key and self.value_start is not None:
            return self.pos
        return None

    def value_start_of(self, key: str) -> int | None:
        if key in self.spans:
            return self.spans[key][0]
        return self.value_start if self.key == key else None

    # ------------------------------------------------------------------ internals

    def _step(self, text: str) -> bool:
        """Read ``text[pos]``; False when it belongs to the next state (not consumed)."""
        ch, state = text[self.pos], self._state
        if state == "value":
            return self._value_char(ch)
        if state == "key":
            self._key_char(ch, text)
        elif ch in WHITESPACE:
            pass
        elif state == "start":
            self._expect(ch == "{", "key_or_end")
        elif state in ("key_or_end", "expect_key"):
            self._key_or_end(ch, allow_end=state == "key_or_end")
        elif state == "colon":
            self._expect(ch == ":", "value_start")
        elif state == "value_start":
            self._value_start(ch)
        elif state == "after_value":
            self._after_value(ch)
        return True

    def _expect(self, ok: bool, next_state: str) -> None:
        if ok:
            self._state = next_state
        else:
            self.broken = True

    def _key_or_end(self, ch: str, allow_end: bool) -> None:
        if ch == "}" and allow_end:
            self.done = True
        elif ch == '"':
            self._state, self._key_start, self._escape = "key", self.pos, False
        else:
            self.broken = True

    def _key_char(self, ch: str, text: str) -> None:
        if self._escape:
            self._escape = False
        elif ch == "\\":
            self._escape = True
        elif ch == '"' and self.pos > self._key_start:
            try:
                self.key = json.loads(text[self._key_start : self.pos + 1])
            except ValueError:  # a bad escape or a raw control character
                self.broken = True
                return
            self._state = "colon"

    def _value_start(self, ch: str) -> None:
        self.value_start = self.pos
        self._state = "value"
        if ch in "{[":
            self._stack = [ch]
        elif ch == '"':
            self._stack, self._in_string = [], True
        elif ch in _LITERAL:
            self._stack = []
        else:
            self.broken = True

    def _value_char(self, ch: str) -> bool:
        if self._in_string:
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                self._in_string = False
                if not self._stack:
                    self._value_done(self.pos + 1)
            return True
        if not self._stack:  # a number or a literal
            if ch in _LITERAL:
                return True
            self._value_done(self.pos)
            return False
        if ch == '"':
            self._in_string = True
        elif ch in "{[":
            self._stack.append(ch)
        elif ch in "}]":
            if _CLOSE[self._stack.pop()] != ch:
                self.broken = True
            elif not self._stack:
                self._value_done(self.pos + 1)
        elif not (ch in WHITESPACE or ch in ",:" or ch in _LITERAL):
            self.broken = True
        return True

    def _value_done(self, end: int) -> None:
        assert self.key is not None and self.value_start is not None
        self.spans.setdefault(self.key, (self.value_start, end))
        self.key, self.value_start = None, None
        self._state = "after_value"

    def _after_value(self, ch: str) -> None:
        if ch == ",":
            self._state = "expect_key"
        elif ch == "}":
            self.done = True
        else:
            self.broken = True
