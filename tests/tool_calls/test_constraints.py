"""The grammar of a reply that must be calls accepts each family's calls of the given
tools, with valid arguments, and refuses anything else: JSON Schema forms checked with
``jsonschema``, Lark forms with llguidance's matcher over the tiny byte-level tokenizer
(one token per byte, so a text is accepted exactly when the grammar accepts it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from pagedllm.tool_calls.constraints import call_schema, lark_grammar, tool_call_constraint
from pagedllm.tool_calls.parsers import parse_tool_calls
from pagedllm.tool_calls.render import ToolPlan
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
    schema = tool_call_constraint(plan("llama3_json"))["json"]
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
    assert named == {"json": call_schema(check_tools([NOW])[0][0], "parameters")}


def test_each_call_object_is_held_to_its_tool() -> None:
    tools, _ = check_tools([WEATHER])
    schema = call_schema(tools[0])
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "Oslo"}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "get_weather", "arguments": {"city": "Oslo", "x": 1}}, schema)


# ---------------------------------------------------------------- Lark forms


@pytest.fixture(scope="module")
def matcher(tmp_path_factory: pytest.TempPathFactory) -> Any:
    pytest.importorskip("llguidance", reason="the grammar engine is not installed")
    import llguidance
    import llguidance.hf

    from .templates import tiny_tokenizer

    path: Path = tmp_path_factory.mktemp("grammar-tokenizer")
    tokenizer = tiny_tokenizer(path, "", special=("[TOOL_CALLS]",))
    llg_tokenizer = llguidance.hf.from_tokenizer(tokenizer)

    def accepts(grammar: str, text: str) -> bool:
        compiled = llguidance.LLMatcher.grammar_from_lark(grammar)
        error = llguidance.LLMatcher.validate_grammar(compiled, llg_tokenizer)
        assert not error, f"the grammar does not compile: {error}"
        m = llguidance.LLMatcher(llg_tokenizer, compiled, log_level=0)
        token_ids = tokenizer.encode(text, add_special_tokens=False)
        return all(m.consume_token(t) for t in token_ids) and m.is_accepting()

    accepts.marker = tokenizer.convert_tokens_to_ids("[TOOL_CALLS]")  # type: ignore[attr-defined]
    return accepts


def hermes(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


@pytest.mark.parametrize("fmt", ["hermes", "generic"])
def test_hermes_grammar_takes_only_valid_calls(matcher: Any, fmt: str) -> None:
    grammar = tool_call_constraint(plan(fmt))["grammar"]
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
    single = tool_call_constraint(plan(fmt, parallel=False))["grammar"]
    assert matcher(single, one) and not matcher(single, two)
    named = tool_call_constraint(plan(fmt, {"type": "function", "function": {"name": "now"}}))
    assert matcher(named["grammar"], hermes("now", "{}"))
    assert not matcher(named["grammar"], one)


def test_mistral_grammar_starts_with_its_special_token(matcher: Any) -> None:
    marker = matcher.marker
    grammar = tool_call_constraint(plan("mistral"), marker_token_id=marker)["grammar"]
    assert f"<[{marker}]>" in grammar
    calls = (
        '[{"name": "get_weather", "arguments": {"city": "Rome"}}, {"name": "now", "arguments": {}}]'
    )
    assert matcher(grammar, "[TOOL_CALLS]" + calls)
    assert not matcher(grammar, calls)
    assert not matcher(grammar, '[TOOL_CALLS][{"name": "now", "arguments": {"x": 1}}]')
    single = tool_call_constraint(plan("mistral", parallel=False), marker_token_id=marker)
    assert not matcher(single["grammar"], "[TOOL_CALLS]" + calls)
    literal = lark_grammar("mistral", check_tools([NOW])[0], parallel=False)
    assert literal.startswith('start: "[TOOL_CALLS]" "["')


def test_no_grammar_for_an_unknown_format() -> None:
    with pytest.raises(ValueError, match="format"):
        lark_grammar("xml", check_tools([NOW])[0], parallel=True)
