"""Tool-call parsers: each family's format read whole and streamed in any pieces.

The generated replies hold nested, empty (``{}``) and unicode arguments, text before,
between and after the calls; every split of a reply gives the same calls and content as
the whole, the streamed arguments concatenate to exactly the non-streamed string, and at
no point has a fragment gone past what the model had written."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.tool_calls.parsers import (
    FORMATS,
    ParsedDelta,
    ToolCall,
    parse_tool_calls,
    tool_call_stream,
)


def counter_ids():
    count = itertools.count()
    return lambda: f"call_{next(count)}"


def stream_pieces(fmt: str, pieces: list[str]) -> list[ParsedDelta]:
    stream = tool_call_stream(fmt, counter_ids())
    return [stream.feed(p) for p in pieces] + [stream.finish()]


def assemble(deltas: list[ParsedDelta]) -> tuple[str, list[ToolCall]]:
    """Concatenate streamed deltas as a client does; checks the id and name come first."""
    content = "".join(d.content for d in deltas)
    calls: dict[int, list[str]] = {}
    for delta in deltas:
        for call in delta.tool_calls:
            if call.index not in calls:
                assert call.id is not None and call.name is not None, "id and name first"
                assert call.index == len(calls), "calls arrive in order"
                calls[call.index] = [call.id, call.name, ""]
            else:
                assert call.id is None and call.name is None
            calls[call.index][2] += call.arguments
    return content, [ToolCall(*calls[i]) for i in sorted(calls)]


# ---------------------------------------------------------------- hand-made cases


@pytest.mark.parametrize(
    ("fmt", "text", "content", "calls"),
    [
        (
            "hermes",
            'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris", "days": [1, {"x": []}]}}\n</tool_call>\n'
            '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
            "Let me look.",
            [("get_weather", '{"city": "Paris", "days": [1, {"x": []}]}'), ("now", "{}")],
        ),
        ("hermes", "<tool_call>hello</tool_call> there", "<tool_call>hello</tool_call> there", []),
        ("hermes", "Plain answer.\n", "Plain answer.\n", []),
        ("hermes", '<tool_call>{"name": "f"}</tool_call>', None, [("f", "{}")]),
        (
            "hermes",
            '<tool_call>{"name": 3, "arguments": {}}',
            '<tool_call>{"name": 3, "arguments": {}}',
            [],
        ),
        (
            "hermes",
            '<tool_call>{"arguments": {"q": "ünï ☃ \\"x\\""}, "name": "search"}</tool_call>',
            None,
            [("search", '{"q": "ünï ☃ \\"x\\""}')],
        ),
        ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1', None, [("f", '{"a": 1')]),
        (
            "llama3_json",
            '{"name": "f", "parameters": {"x": -1.5e3, "ok": true, "n": null}}; '
            '{"name": "g", "parameters": {}}',
            None,
            [("f", '{"x": -1.5e3, "ok": true, "n": null}'), ("g", "{}")],
        ),
        ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {}}', None, [("f", "{}")]),
        ("llama3_json", "  The answer is 4.", "  The answer is 4.", []),
        ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
        (
            "mistral",
            'Checking. [TOOL_CALLS] [{"name": "f", "arguments": {"é": "ü"}}, '
            '{"name": "g", "arguments": "{\\"a\\": 1}"}]',
            "Checking.",
            [("f", '{"é": "ü"}'), ("g", '{"a": 1}')],
        ),
        ("mistral", "[TOOL_CALLS] not a list", "[TOOL_CALLS] not a list", []),
        ("generic", '<tool_call>{"name": "f", "arguments": {}}</tool_call>', None, [("f", "{}")]),
    ],
)
def test_replies_parse_whole_and_streamed(
    fmt: str, text: str, content: str | None, calls: list[tuple[str, str]]
) -> None:
    reply = parse_tool_calls(fmt, text, counter_ids())
    assert reply.content == content
    assert [(c.name, c.arguments) for c in reply.tool_calls] == calls
    assert [c.id for c in reply.tool_calls] == [f"call_{i}" for i in range(len(calls))]
    for pieces in ([text], list(text)):
        streamed_content, streamed_calls = assemble(stream_pieces(fmt, pieces))
        assert streamed_content == (content or "")
        assert streamed_calls == list(reply.tool_calls)


def test_arguments_of_a_call_are_json_of_the_model() -> None:
    text = (
        '<tool_call>\n{"name": "f", "arguments": {"a": {"b": [1, 2, {"c": "}]"}]}}}\n</tool_call>'
    )
    [call] = parse_tool_calls("hermes", text).tool_calls
    assert json.loads(call.arguments) == {"a": {"b": [1, 2, {"c": "}]"}]}}
    assert call.id.startswith("call_") and len(call.id) == 29
    assert call.to_dict() == {
        "id": call.id,
        "type": "function",
        "function": {"name": "f", "arguments": call.arguments},
    }


def test_a_partial_tag_is_held_back_until_it_is_decided() -> None:
    stream = tool_call_stream("hermes", counter_ids())
    assert stream.feed("Hi <tool").content == "Hi"
    assert stream.feed("box>").content == " <toolbox>"
    assert stream.feed(" <tool_c").content == ""
    assert not stream.feed('all>{"name": "f')
    header = stream.feed('", ')
    assert header.content == ""
    assert [(d.id, d.name, d.arguments) for d in header.tool_calls] == [("call_0", "f", "")]
    first = stream.feed('"arguments": {"x"')
    assert [(d.id, d.name, d.arguments) for d in first.tool_calls] == [(None, None, '{"x"')]
    assert stream.feed(": 1}}").tool_calls[0].arguments == ": 1}"
    assert not stream.finish()
    assert stream.reply().content == "Hi <toolbox>"


def test_a_finished_stream_takes_no_more_text() -> None:
    stream = tool_call_stream("hermes")
    stream.finish()
    with pytest.raises(ValueError, match="finished"):
        stream.feed("x")
    with pytest.raises(ValueError, match="format"):
        tool_call_stream("xml")


# ---------------------------------------------------------------- generated replies

JSON_TEXT = st.text(
    alphabet=st.sampled_from(list('abc xyz"\\/{}[]:,\n\t') + ["é", "☃", "😀", "\u2028", "日"]),
    max_size=8,
)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**6), 10**6) | st.floats(-1e6, 1e6) | JSON_TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(JSON_TEXT, inner, max_size=3),
    max_leaves=8,
)
ARGUMENTS = st.dictionaries(JSON_TEXT, JSON_VALUES, max_size=4)
NAMES = st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_.-]{0,12}", fullmatch=True)
# Text around calls: no markers in it (they are what the family reads).
PROSE = st.text(
    alphabet=st.sampled_from(list("Hello, it's 20°C!\n ") + ["é", "{", "[", "<"]), max_size=12
)


@dataclass
class Reply:
    text: str
    content: str | None
    calls: list[tuple[str, str]]  # (name, arguments as written)


def _args_text(arguments: dict, style: int) -> str:
    if style == 0:
        return json.dumps(arguments)
    if style == 1:
        return json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))
    return json.dumps(arguments, ensure_ascii=False, indent=1)


@st.composite
def replies(draw: st.DrawFn, fmt: str) -> Reply:
    calls = [
        (draw(NAMES), _args_text(draw(ARGUMENTS), draw(st.integers(0, 2))))
        for _ in range(draw(st.integers(0, 3)))
    ]
    objects = [
        json.dumps({"name": name})[:-1] + f', "{_args_key(fmt)}": {args}}}' for name, args in calls
    ]
    before, after = draw(PROSE).strip(), draw(PROSE).strip()
    if fmt == "llama3_json":
        text = "; ".join(objects) if calls else before
        return Reply(text, None if calls else before, calls)
    if not calls:
        return Reply(before, before, calls)
    if fmt == "mistral":
        text = f"{before} [TOOL_CALLS] [{', '.join(objects)}] {after}"
    else:
        blocks = "\n".join(f"<tool_call>\n{obj}\n</tool_call>" for obj in objects)
        text = f"{before}\n{blocks}\n{after}"
    # Whitespace next to a call is not content; the text on either side is.
    return Reply(text, before + after or None, calls)


def _args_key(fmt: str) -> str:
    return "parameters" if fmt == "llama3_json" else "arguments"


@st.composite
def split(draw: st.DrawFn, text: str) -> list[str]:
    """Token-sized pieces: cuts anywhere, pieces of 1 to 6 characters (or empty)."""
    pieces, pos = [], 0
    while pos < len(text):
        size = draw(st.integers(0, 6))
        pieces.append(text[pos : pos + size])
        pos += size
    return pieces


@pytest.mark.parametrize("fmt", FORMATS)
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_any_split_streams_the_calls_of_the_whole(fmt: str, data: st.DataObject) -> None:
    reply = data.draw(replies(fmt))
    whole = parse_tool_calls(fmt, reply.text, counter_ids())
    assert [(c.name, c.arguments) for c in whole.tool_calls] == reply.calls
    assert whole.content == reply.content
    for call in whole.tool_calls:
        json.loads(call.arguments)

    pieces = data.draw(split(reply.text))
    stream = tool_call_stream(fmt, counter_ids())
    deltas, fed = [], ""
    for piece in pieces:
        deltas.append(stream.feed(piece))
        fed += piece
        _check_nothing_ahead_of_the_model(fed, deltas, whole.tool_calls, reply)
    deltas.append(stream.finish())
    content, calls = assemble(deltas)
    assert calls == list(whole.tool_calls)
    assert content == (whole.content or "")


def _check_nothing_ahead_of_the_model(
    fed: str, deltas: list[ParsedDelta], final: tuple[ToolCall, ...], reply: Reply
) -> None:
    """Every call's arguments so far are the start of its final arguments, and that much
    of them is already in the text fed (no bracket closed early, nothing invented)."""
    _, calls = assemble([*deltas])
    search_from = 0
    for call, done in zip(calls, final, strict=False):
        assert done.arguments.startswith(call.arguments)
        at = reply.text.index(done.arguments, search_from)
        assert not call.arguments or at + len(call.arguments) <= len(fed)
        search_from = at + len(done.arguments)
