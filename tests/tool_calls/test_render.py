"""Tools through chat templates: Qwen2.5's own (Hermes), Llama-3 and Mistral styles, and
the generic format for a template without tools; bad tools and tool choices refused
with the field named."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pagedllm.testing import CHATML_TEMPLATE
from pagedllm.tool_calls.render import (
    choose_format,
    generic_system_prompt,
    mistral_call_id,
    render_chat,
    special_marker,
    template_format,
)
from pagedllm.tool_calls.tools import InvalidToolRequest, Tool, ToolChoice, check_tools

from .templates import LLAMA3_STYLE, MISTRAL_STYLE, QWEN2_5, tiny_tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_0123456789abcdef",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_0123456789abcdef", "content": "21°C, sunny"},
]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("templates")
    return {
        "qwen": tiny_tokenizer(root / "qwen", QWEN2_5),
        "llama": tiny_tokenizer(root / "llama", LLAMA3_STYLE),
        "mistral": tiny_tokenizer(root / "mistral", MISTRAL_STYLE, special=("[TOOL_CALLS]",)),
        "chatml": tiny_tokenizer(root / "chatml", CHATML_TEMPLATE),
    }


def test_each_template_names_its_format(tokenizers: dict[str, Any]) -> None:
    assert template_format(QWEN2_5) == "hermes"
    assert template_format(LLAMA3_STYLE) == "llama3_json"
    assert template_format(MISTRAL_STYLE) == "mistral"
    assert template_format(CHATML_TEMPLATE) is None
    assert choose_format(tokenizers["chatml"], "auto") == "generic"
    assert choose_format(tokenizers["qwen"], "generic") == "generic"
    assert choose_format(tokenizers["chatml"], "generic") == "generic"


def test_qwen_renders_tools_and_history_as_its_template_does(tokenizers: dict[str, Any]) -> None:
    tokenizer = tokenizers["qwen"]
    text, plan = render_chat(tokenizer, HISTORY, tools=[WEATHER])
    assert plan is not None and plan.format == "hermes" and plan.parses
    # transformers' own rendering of the same conversation (arguments as an object)
    history = json.loads(json.dumps(HISTORY))
    history[1]["content"] = ""
    history[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    assert text == tokenizer.apply_chat_template(
        history, tools=[WEATHER], tokenize=False, add_generation_prompt=True
    )
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    )
    assert "<tool_response>\n21°C, sunny\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_tool_choice_none_shows_no_tools(tokenizers: dict[str, Any]) -> None:
    text, plan = render_chat(tokenizers["qwen"], HISTORY, tools=[WEATHER], tool_choice="none")
    assert plan is not None and not plan.parses
    assert "<tools>" not in text and "<tool_call>" in text  # the history still shows


def test_llama3_style_renders_parameters_and_ipython(tokenizers: dict[str, Any]) -> None:
    text, plan = render_chat(tokenizers["llama"], HISTORY, tools=[WEATHER])
    assert plan is not None and plan.format == "llama3_json"
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}' in text
    assert "<|start_header_id|>ipython<|end_header_id|>\n\n21°C, sunny" in text


def test_mistral_gets_nine_character_ids_and_keeps_its_marker(tokenizers: dict[str, Any]) -> None:
    tokenizer = tokenizers["mistral"]
    text, plan = render_chat(tokenizer, HISTORY, tools=[WEATHER])
    assert plan is not None and plan.format == "mistral"
    short = mistral_call_id("call_0123456789abcdef")
    assert short == "789abcdef"
    assert f'"id": "{short}"' in text and f'"call_id": "{short}"' in text
    assert special_marker(tokenizer, "mistral") == tokenizer.convert_tokens_to_ids("[TOOL_CALLS]")
    assert special_marker(tokenizers["qwen"], "hermes") is None


def test_a_template_without_tools_gets_the_generic_format(tokenizers: dict[str, Any]) -> None:
    tokenizer = tokenizers["chatml"]
    messages = [{"role": "system", "content": "Be brief."}, *HISTORY]
    text, plan = render_chat(tokenizer, messages, tools=[WEATHER], tool_choice="required")
    assert plan is not None and plan.format == "generic"
    tools, choice = check_tools([WEATHER], "required")
    prompt = generic_system_prompt(tools, choice, parallel=True)
    assert text.startswith(f"<|im_start|>system\nBe brief.\n\n{prompt}<|im_end|>")
    assert "You must call at least one function." in prompt
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert f"<|im_start|>assistant\n{call}<|im_end|>" in text
    assert "<|im_start|>user\n<tool_response>\n21°C, sunny\n</tool_response><|im_end|>" in text


def test_results_in_a_row_are_one_user_turn_in_the_generic_format(
    tokenizers: dict[str, Any],
) -> None:
    messages = [*HISTORY, {"role": "tool", "tool_call_id": "call_2", "content": "windy"}]
    text, _ = render_chat(tokenizers["chatml"], messages, tools=[WEATHER])
    assert "21°C, sunny\n</tool_response>\n<tool_response>\nwindy\n</tool_response>" in text
    assert text.count("<|im_start|>user") == 2


def test_no_tools_renders_as_before(tokenizers: dict[str, Any]) -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    text, plan = render_chat(tokenizers["qwen"], messages)
    assert plan is None
    assert text == tokenizers["qwen"].apply_chat_template(
        [{"role": "user", "content": "a\nb"}], tokenize=False, add_generation_prompt=True
    )


@pytest.mark.parametrize(
    ("tools", "choice", "param", "words"),
    [
        ([WEATHER], {"type": "function", "function": {"name": "get_time"}}, "tool_choice.function.name", "not among the tools"),
        ([], "required", "tool_choice", "needs tools"),
        ([WEATHER], "sometimes", "tool_choice", "must be one of"),
        ([WEATHER, WEATHER], None, "tools[1].function.name", "two tools"),
        ([{"type": "function", "function": {"name": "bad name"}}], None, "tools[0].function.name", "letters"),
        ([{"type": "retrieval"}], None, "tools[0]", "'type': 'function'"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
            None, "tools[0].function.parameters", "object",
        ),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"properties": {"x": {"type": "strng"}}}}}],
            None, "tools[0].function.parameters", "properties.x.type",
        ),
    ],
)  # fmt: skip
def test_bad_tools_are_refused_naming_the_field(
    tools: list[Any], choice: Any, param: str, words: str
) -> None:
    with pytest.raises(InvalidToolRequest, match=words) as info:
        check_tools(tools, choice)
    assert info.value.param == param
    assert str(info.value).startswith(f"{param}: ")


def test_bad_history_is_refused_naming_the_field(tokenizers: dict[str, Any]) -> None:
    broken = json.loads(json.dumps(HISTORY))
    broken[1]["tool_calls"][0]["function"]["arguments"] = "{not json"
    with pytest.raises(InvalidToolRequest) as info:
        render_chat(tokenizers["qwen"], broken, tools=[WEATHER])
    assert info.value.param == "messages[1].tool_calls[0].function.arguments"
    anonymous = [*HISTORY[:2], {"role": "tool", "content": "21°C"}]
    with pytest.raises(InvalidToolRequest) as info:
        render_chat(tokenizers["qwen"], anonymous, tools=[WEATHER])
    assert info.value.param == "messages[2].tool_call_id"


def test_a_forced_parser_needs_a_template_that_renders_tools(tokenizers: dict[str, Any]) -> None:
    with pytest.raises(InvalidToolRequest, match="does not render tools") as info:
        render_chat(tokenizers["chatml"], HISTORY, tools=[WEATHER], tool_call_parser="hermes")
    assert info.value.param == "tools"
    _, plan = render_chat(tokenizers["qwen"], HISTORY, tools=[WEATHER], tool_call_parser="hermes")
    assert plan is not None and plan.format == "hermes"
    with pytest.raises(ValueError, match="tool_call_parser"):
        choose_format(tokenizers["qwen"], "xml")


def test_tools_and_choices_are_read_as_openai_sends_them() -> None:
    tools, choice = check_tools(
        [WEATHER], {"type": "function", "function": {"name": "get_weather"}}
    )
    assert tools == (
        Tool("get_weather", "The weather in a city.", {**WEATHER["function"]["parameters"]}),
    )
    assert choice == ToolChoice("named", "get_weather") and choice.constrained
    assert check_tools([WEATHER])[1] == ToolChoice("auto")
    assert check_tools(None)[1] == ToolChoice("none")
    [bare] = check_tools([{"type": "function", "function": {"name": "now"}}])[0]
    assert bare.parameters == {"type": "object", "properties": {}, "additionalProperties": False}
    assert bare.to_dict() == {
        "type": "function",
        "function": {"name": "now", "parameters": bare.parameters},
    }


def test_parameters_without_a_type_are_an_object(tmp_path: Path) -> None:
    [tool] = check_tools(
        [{"type": "function", "function": {"name": "f", "parameters": {"properties": {}}}}]
    )[0]
    assert tool.parameters == {"properties": {}, "type": "object"}
