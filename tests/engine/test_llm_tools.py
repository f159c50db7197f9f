"""``LLM.chat(messages, tools=...)``: the tools through the chat template, and each
completion read for calls (``tool_calls``, ``content``; ``text`` stays the whole reply),
on a scripted fake runner writing what a model with tools would."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pagedllm.engine.config import EngineConfig
from pagedllm.engine.llm import LLM
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams
from pagedllm.tool_calls.tools import InvalidToolRequest
from tests.tool_calls.scripted_runner import ScriptedRunner
from tests.tool_calls.templates import QWEN2_5, tiny_tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
    {"type": "function", "function": {"name": "now"}},
]
ASK = [{"role": "user", "content": "Weather in Paris, and the time?"}]
CALLS = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
)
GREEDY = SamplingParams(temperature=0, max_tokens=300)


def make_llm(tmp_path: Path, replies: list[str], **config: Any) -> LLM:
    tokenizer = tiny_tokenizer(tmp_path / "tokenizer", QWEN2_5)
    engine = LLMEngine(
        EngineConfig(block_size=16, max_model_len=4096, **config),
        ScriptedRunner(tokenizer, replies),
        tokenizer,
    )
    return LLM.from_engine(engine)


def test_chat_with_tools_reads_the_calls(tmp_path: Path) -> None:
    with make_llm(tmp_path, [CALLS]) as llm:
        [output] = llm.chat(ASK, GREEDY, tools=TOOLS, use_tqdm=False)
        [completion] = output.outputs
        assert completion.text == CALLS
        assert completion.content is None
        calls = [(c.name, c.arguments) for c in completion.tool_calls]
        assert calls == [("get_weather", '{"city": "Paris"}'), ("now", "{}")]
        assert all(c.id.startswith("call_") for c in completion.tool_calls)
        assert completion.tool_calls[0].to_dict()["function"]["name"] == "get_weather"
        assert "<tools>" in output.prompt and '"name": "get_weather"' in output.prompt
        [one] = llm.chat(ASK, GREEDY, tools=TOOLS, parallel_tool_calls=False, use_tqdm=False)
        assert [c.name for c in one.outputs[0].tool_calls] == ["get_weather"]


def test_history_calls_render_and_plain_chats_are_unchanged(tmp_path: Path) -> None:
    with make_llm(tmp_path, [CALLS, "Sunny."]) as llm:
        [first] = llm.chat(ASK, GREEDY, tools=TOOLS, use_tqdm=False)
        completion = first.outputs[0]
        history = [
            *ASK,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [c.to_dict() for c in completion.tool_calls],
            },
            *(
                {"role": "tool", "tool_call_id": c.id, "content": "ok"}
                for c in completion.tool_calls
            ),
        ]
        [second] = llm.chat(history, GREEDY, tools=TOOLS, use_tqdm=False)
        assert second.outputs[0].content == "Sunny." and second.outputs[0].tool_calls == ()
        assert second.prompt.count("<tool_response>\nok\n</tool_response>") == 2
        assert llm.encode_chat(history, tools=TOOLS) == list(second.prompt_token_ids)
        [plain] = llm.chat(ASK, GREEDY, use_tqdm=False)
        assert plain.outputs[0].tool_calls is None and plain.outputs[0].content is None
        [none] = llm.chat(ASK, GREEDY, tools=TOOLS, tool_choice="none", use_tqdm=False)
        assert none.outputs[0].tool_calls is None and none.outputs[0].text == CALLS


def test_bad_tools_raise_naming_the_field(tmp_path: Path) -> None:
    with make_llm(tmp_path, [CALLS], tool_call_parser="generic") as llm:
        with pytest.raises(InvalidToolRequest) as info:
            llm.chat(
                ASK,
                GREEDY,
                tools=TOOLS,
                tool_choice={"type": "function", "function": {"name": "x"}},
            )
        assert info.value.param == "tool_choice.function.name"
        assert llm.engine.scheduler.has_unfinished_requests() is False
        # a forced generic format shows the tools in a system prompt instead
        assert "<|im_start|>system\n" in llm.render_chat(ASK, tools=TOOLS)
        assert "# Tools\n\nYou may call functions" in llm.render_chat(ASK, tools=TOOLS)


def test_a_named_choice_is_held_to_that_tool(tmp_path: Path) -> None:
    from pagedllm.sampling_params import StructuredOutputsParams

    now = {"type": "function", "function": {"name": "now"}}
    with make_llm(tmp_path, [CALLS]) as llm:
        [output] = llm.chat(ASK, GREEDY, tools=TOOLS, tool_choice=now, use_tqdm=False)
        assert [(c.name, c.arguments) for c in output.outputs[0].tool_calls] == [("now", "{}")]
        both = SamplingParams(
            max_tokens=8, structured_outputs=StructuredOutputsParams(json_object=True)
        )
        with pytest.raises(InvalidToolRequest, match="structured_outputs"):
            llm.chat(ASK, both, tools=TOOLS, tool_choice="required", use_tqdm=False)
