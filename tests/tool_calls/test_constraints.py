"""The grammar of a reply that must be calls accepts each family's calls of the given
tools, with valid arguments, and refuses anything else: JSON Schema forms checked with
``jsonschema``, Lark forms with llguidance's matcher over the tiny byte-level tokenizer
(one token per byte, so a text is accepted exactly when the grammar accepts it) and one
with Qwen2.5's tags as added tokens; compiled by the engine's own ``GrammarCompiler``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.tool_calls.constraints import call_schema, lark_grammar, tool_call_constraint
from pagedllm.tool_calls.parsers import parse_tool_calls
from pagedllm.tool_calls.render import ToolPlan, tag_token_ids
from pagedllm.tool_calls.tools import check_tools

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"enum": ["C", "F"]},
                "days": {"type": "array", "items": {"type": "integer"}},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
NOW = {"type": "function", "function": {"name": "now"}}


def plan(fmt: str, choice: Any = "required", parallel: bool = True) -> ToolPlan:
    tools, checked = check_tools([WEATHER, NOW], choice)
    return ToolPlan(fmt, tools, checked, parallel)


def test_auto_and_none_are_not_constrained() -> None:
    assert tool_call_constraint(plan("hermes", "auto")) is None
    assert tool_call_constraint(plan("hermes", "none")) is None


def test_llama3_calls_are_a_json_schema() -> None:
    schema = json.loads(tool_call_constraint(plan("llama3_json")).spec_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    good = [
        {"name": "get_weather", "parameters": {"city": "Paris", "days": [1, 2]}},
        {"name": "now", "parameters": {}},
    ]
    bad = [
        {"name": "get_weather", "parameters": {"city": 3}},
        {"name": "get_weather", "parameters": {"unit": "C"}},
        {"name": "get_time", "parameters": {}},
        {"name": "now", "parameters": {"x": 1}},
        {"name": "now", "parameters": {}, "extra": 1},
        {"name": "now"},
    ]
    for call in good:
        jsonschema.validate(call, schema)
        assert parse_tool_calls("llama3_json", json.dumps(call)).tool_calls[0].name == call["name"]
    for call in bad:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(call, schema)
    named = tool_call_constraint(
        plan("llama3_json", {"type": "function", "function": {"name": "now"}})
    )
    assert named.json == call_schema(check_tools([NOW])[0][0], "parameters")


def test_each_call_object_is_held_to_its_tool() -> None:
    tools, _ = check_tools([WEATHER])
    schema = call_schema(tools[0])
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "Oslo"}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "get_weather", "arguments": {"city": "Oslo", "x": 1}}, schema)


# ---------------------------------------------------------------- Lark forms


class Matcher:
    """Whether the engine's own compiled grammar (``GrammarCompiler``) takes a text,
    tokenized as the model would write it."""

    def __init__(self, path: Path, added: tuple[str, ...] = (), special: tuple[str, ...] = ()):
        from pagedllm.engine.structured_outputs import GrammarCompiler

        from .templates import tiny_tokenizer

        self.tokenizer = tiny_tokenizer(path, "", special=special)
        if added:
            self.tokenizer.add_tokens(list(added))
        self.compiler = GrammarCompiler(self.tokenizer)

    def tag_ids(self, fmt: str) -> dict[str, int]:
        return tag_token_ids(self.tokenizer, fmt)

    def __call__(self, params: StructuredOutputsParams, text: str) -> bool:
        matcher = self.compiler.compile(params).matcher()
        token_ids = self.tokenizer.encode(text, add_special_tokens=False)
        return all(matcher.consume_token(t) for t in token_ids) and matcher.is_accepting()


@pytest.fixture(scope="module")
def matcher(tmp_path_factory: pytest.TempPathFactory) -> Matcher:
    """Tags spelled in bytes (the tiny byte tokenizer); [TOOL_CALLS] a special token."""
    return Matcher(tmp_path_factory.mktemp("bytes"), special=("[TOOL_CALLS]",))


@pytest.fixture(scope="module")
def qwen_like(tmp_path_factory: pytest.TempPathFactory) -> Matcher:
    """``<tool_call>`` and ``</tool_call>`` added tokens (not special), as Qwen2.5 has them."""
    return Matcher(tmp_path_factory.mktemp("added"), added=("<tool_call>", "</tool_call>"))


def hermes(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


@pytest.mark.parametrize("fmt", ["hermes", "generic"])
def test_hermes_grammar_takes_only_valid_calls(matcher: Matcher, fmt: str) -> None:
    grammar = tool_call_constraint(plan(fmt))
    one = hermes("get_weather", '{"city": "Paris", "unit": "C"}')
    two = one + "\n" + hermes("now", "{}")
    for text in (one, two, hermes("now", "{}")):
        assert matcher(grammar, text), text
        assert len(parse_tool_calls(fmt, text).tool_calls) == text.count("<tool_call>")
    for text in (
        hermes("get_weather", '{"city": 3}'),
        hermes("get_weather", '{"unit": "C"}'),
        hermes("get_time", "{}"),
        hermes("now", '{"x": 1}'),
        "Sure! " + one,
        one + " done",
    ):
        assert not matcher(grammar, text), text
    assert matcher(grammar, hermes("now", "{" + " " * 32 + "}"))
    assert not matcher(grammar, hermes("now", "{" + " " * 33 + "}"))  # bounded whitespace
    single = tool_call_constraint(plan(fmt, parallel=False))
    assert matcher(single, one) and not matcher(single, two)
    named = tool_call_constraint(plan(fmt, {"type": "function", "function": {"name": "now"}}))
    assert matcher(named, hermes("now", "{}"))
    assert not matcher(named, one)
    assert not matcher(named, hermes("now", "{}") + "\n" + hermes("now", "{}"))  # one call


def test_tags_that_are_tokens_are_asked_for_as_tokens(qwen_like: Matcher) -> None:
    """Qwen2.5 writes ``<tool_call>`` as one added token: the grammar must take that token
    (its text spelled in bytes is not what the model writes)."""
    ids = qwen_like.tag_ids("hermes")
    assert set(ids) == {"<tool_call>", "</tool_call>"}
    grammar = tool_call_constraint(plan("hermes"), ids)
    assert f"<[{ids['<tool_call>']}]>" in grammar.grammar
    text = hermes("get_weather", '{"city": "Paris"}')
    assert ids["<tool_call>"] in qwen_like.tokenizer.encode(text, add_special_tokens=False)
    assert qwen_like(grammar, text)
    assert not qwen_like(grammar, hermes("get_time", "{}"))


def test_mistral_grammar_starts_with_its_special_token(matcher: Matcher) -> None:
    ids = matcher.tag_ids("mistral")
    grammar = tool_call_constraint(plan("mistral"), ids)
    assert f"<[{ids['[TOOL_CALLS]']}]>" in grammar.grammar
    calls = (
        '[{"name": "get_weather", "arguments": {"city": "Rome"}}, {"name": "now", "arguments": {}}]'
    )
    assert matcher(grammar, "[TOOL_CALLS]" + calls)
    assert not matcher(grammar, calls)
    assert not matcher(grammar, '[TOOL_CALLS][{"name": "now", "arguments": {"x": 1}}]')
    single = tool_call_constraint(plan("mistral", parallel=False), ids)
    assert not matcher(single, "[TOOL_CALLS]" + calls)
    literal = lark_grammar("mistral", check_tools([NOW])[0], parallel=False)
    assert literal.startswith('start: "[TOOL_CALLS]" "["')


def test_no_grammar_for_an_unknown_format() -> None:
    with pytest.raises(ValueError, match="format"):
        lark_grammar("xml", check_tools([NOW])[0], parallel=True)
