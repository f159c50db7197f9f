"""Incremental detokenization and stop strings matched across token boundaries.

Decoding token by token breaks multi-byte characters and word-initial spaces, and
decoding the whole output every step costs O(n^2). The usual middle way: decode a
short window twice, with and without the new tokens, and emit the difference::

    token_ids:  ... [prefix_offset ........ read_offset) [new tokens ...]
                     decoded already (context only)      emitted as the diff

A diff ending in U+FFFD is an incomplete UTF-8 sequence: wait for the next token.

Stop strings are searched in the text around the boundary (the last
``len(stop) - 1`` characters before the new text, plus the new text), so a stop
string split over several tokens is found. While running, the visible text holds
back the last ``max(len(stop)) - 1`` characters, so a cumulative output never
shows text that a later stop string would take back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# Context tokens decoded before the window: enough for word-initial spaces.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns one sequence's output tokens into text as they arrive."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = tuple(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._tokens: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.text = ""
        self.stop_reason: str | None = None
        self._max_stop = max((len(s) for s in self.stop), default=0)

    @property
    def visible_text(self) -> str:
        """The text a running sequence may show (see the module docstring)."""
        if self.stop_reason is not None or self.include_stop_str_in_output or not self._max_stop:
            return self.text
        return self.text[: max(0, len(self.text) - (self._max_stop - 1))]

    def add_tokens(self, token_ids: Sequence[int]) -> str | None:
        """Append tokens; returns the stop string if one now appears (the text is then
        cut before it, or after it with ``include_stop_str_in_output``)."""
        if self.tokenizer is None or self.stop_reason is not None:
            return self.stop_reason
        for token_id in token_ids:
            self._tokens.append(token_id)
            before = len(self.text)
            self.text += self._decode_new()
            if self.stop and self._find_stop(before):
                return self.stop_reason
        return None

    def finish(self) -> str:
        """The final text: flush characters still waiting for more bytes."""
        pending = self._read_offset < len(self._tokens)
        if self.tokenizer is not None and self.stop_reason is None and pending:
            prefix = self._decode(self._tokens[self._prefix_offset : self._read_offset])
            whole = self._decode(self._tokens[self._prefix_offset :])
            before = len(self.text)
            if len(whole) > len(prefix):
                self.text += whole[len(prefix) :]
            self._prefix_offset = self._read_offset = len(self._tokens)
            if self.stop:
                self._find_stop(before)
        return self.text

    # ------------------------------------------------------------------ internals

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_new(self) -> str:
        prefix = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        whole = self._decode(self._tokens[self._prefix_offset :])
        if len(whole) > len(prefix) and not whole.endswith("\ufffd"):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._tokens)
            return whole[len(prefix) :]
        return ""

    def _find_stop(self, new_start: int) -> bool:
        """Search stop strings that end in the new text; cut the text at the first."""
        best: tuple[int, str] | None = None
        for stop in self.stop:
            begin = max(0, new_start - len(stop) + 1)
            index = self.text.find(stop, begin)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return False
        index, stop = best
        self.text = self.text[: index + len(stop) if self.include_stop_str_in_output else index]
        self.stop_reason = stop
        return True
