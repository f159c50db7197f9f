"""SSE framing: every event is one line for any line reader, whatever its text holds."""

from __future__ import annotations

import json

from httpx._decoders import LineDecoder
from pydantic import BaseModel

from pagedllm.server.sse import sse_event


class Delta(BaseModel):
    text: str


def test_unicode_line_breaks_in_a_token_do_not_split_the_event():
    text = "a\u2028b\u2029c\u0085d\ne\rf\x0bg\x0ch\x1ci\x1dj\x1ek é"
    event = sse_event(Delta(text=text))
    lines = LineDecoder().decode(event.decode()) + LineDecoder().flush()
    # httpx splits as str.splitlines does: one data line, then the blank line ending it.
    data_lines = [line for line in lines if line]
    assert len(data_lines) == 1 and data_lines[0].startswith("data: ")
    assert json.loads(data_lines[0][len("data: ") :]) == {"text": text}
    assert event.endswith(b"\n\n") and event.count(b"\n") == 2
