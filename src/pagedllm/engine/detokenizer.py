"""Incremental detokenization and stop strings matched across token boundaries.

Decoding token by token breaks multi-byte characters and word-initial spaces, and
decoding the whole output every step costs O(n^2). The usual middle way: decode a
short window that starts a few tokens back, and emit what it adds to the window's
text as last decoded::

    token_ids:  ... [prefix_offset ........ read_offset) [new tokens ...]
                     decoded already: prefix_text         emitted as the diff

``prefix_text`` is the previous window decode, kept, so a new token costs one
``decode`` call. Once the window holds more than ``_MAX_WINDOW`` tokens its start moves
up to ``_MOVE_CONTEXT`` tokens before ``read_offset`` (one extra short decode per move).
A decode ending in U+FFFD is an incomplete UTF-8 sequence: wait for the next token.

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
# Window length that triggers a move of its start, and the tokens kept before
# read_offset when it moves. A decode's cost grows with its length about as fast as
# with the number of calls, so the window stays short: windows of 2, 3 and 4 tokens,
# then a move (one extra 1-token decode), i.e. 4 decodes per 3 tokens against 6 for a
# decode of prefix and whole.
_MAX_WINDOW = 4
_MOVE_CONTEXT = 1


def _backend_decoder(tokenizer: Any) -> Any:
    """The Rust tokenizer's ``decode`` where it returns exactly what ``tokenizer.decode``
    returns: a plain Hugging Face fast tokenizer with no space clean-up. Skipping the
    Python wrapper makes a short decode much cheaper."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    if "decode" in vars(tokenizer) or "_decode" in vars(tokenizer):
        return None  # patched on the instance
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return None
    cls = type(tokenizer)
    plain = PreTrainedTokenizerFast
    if cls.decode is not plain.decode or cls._decode is not plain._decode:
        return None
    return backend.decode


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
        self._backend_decode = _backend_decoder(tokenizer)
        self.skip_special_tokens = skip_special_tokens
        self.stop = tuple(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._tokens: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text: str | None = None  # decode of [prefix_offset, read_offset)
        self.text = ""
        self.stop_reason: str | None = None
        self._max_stop = max((len(s) for s in self.stop), default=0)

    @classmethod
    def for_params(
        cls, tokenizer: Any, prompt_token_ids: Sequence[int], params: Any
    ) -> IncrementalDetokenizer:
        """A detokenizer with a request's ``SamplingParams`` text options (special tokens,
        stop strings and whether they stay in the output)."""
        return cls(
            tokenizer,
            prompt_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
        )

    @property
    def visible_text(self) -> str:
        """The text a running sequence may show (see the module docstring)."""
        if self.stop_reason is not None or self.include_stop_str_in_output or not self._max_stop:
            return self.text
        return self.text[: max(0, len(self.text) - (self._max_stop - 1))]

    def add_tokens(self, token_ids: Sequence[int], *, one_window: bool = False) -> str | None:
        """Append tokens; returns the stop string if one now appears (the text is then
        cut before it, or after it with ``include_stop_str_in_output``).

        ``one_window`` (no stop strings only): decode the tokens together, one decode for
        many tokens — for a caller that held them back until the text was wanted (the
        engine's offline steps). Without it each token is decoded in turn."""
        if self.tokenizer is None or self.stop_reason is not None:
            return self.stop_reason
        if one_window and not self.stop:
            self._decode_window(token_ids)
            return None
        for token_id in token_ids:
            self._tokens.append(token_id)
            new_text = self._decode_new()
            if new_text:  # no new text, no new stop string
                before = len(self.text)
                self.text += new_text
                if self.stop and self._find_stop(before):
                    return self.stop_reason
        return None

    def finish(self) -> str:
        """The final text: flush characters still waiting for more bytes."""
        pending = self._read_offset < len(self._tokens)
        if self.tokenizer is not None and self.stop_reason is None and pending:
            before = len(self.text)
            self.text += self._decode_new(final=True)
            if self.stop:
                self._find_stop(before)
        return self.text

    # ------------------------------------------------------------------ internals

    def _decode_window(self, token_ids: Sequence[int]) -> None:
        """Decode tokens in one window (no stop strings to look for). When the window ends
        inside a character, the tokens go one by one instead, so the complete characters
        before it still show (rare: non-ASCII text cut mid-character)."""
        if not token_ids:
            return
        self._tokens.extend(token_ids)
        new_text = self._decode_new()
        if new_text or self._read_offset == len(self._tokens):
            self.text += new_text
            return
        # Nothing read: the offsets and the cached prefix still describe the tokens before.
        del self._tokens[-len(token_ids) :]
        for token_id in token_ids:
            self._tokens.append(token_id)
            self.text += self._decode_new()

    def _decode(self, token_ids: Sequence[int]) -> str:
        if self._backend_decode is not None:
            return self._backend_decode(token_ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def _window_prefix(self) -> str:
        """The decode of ``[prefix_offset, read_offset)``, from the cache when known."""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        return self._prefix_text

    def _decode_new(self, *, final: bool = False) -> str:
        """What the newest tokens add to the text; ``final`` also emits an incomplete
        character instead of waiting for more bytes."""
        if len(self._tokens) - self._prefix_offset > _MAX_WINDOW:
            start = max(self._prefix_offset, self._read_offset - _MOVE_CONTEXT)
            if start != self._prefix_offset:
                self._prefix_offset = start
                self._prefix_text = None
        prefix = self._window_prefix()
        whole = self._decode(self._tokens[self._prefix_offset :])
        # Equal length with no U+FFFD: the tokens decoded to nothing (a skipped special
        # token); still move read_offset so the cached prefix stays the window's decode.
        if final or (len(whole) >= len(prefix) and not whole.endswith("\ufffd")):
            self._read_offset = len(self._tokens)
            self._prefix_text = whole
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
