"""Conversations with tools through the model's own chat template, or a generic format.

A template that shows tools gets them as its ``tools`` variable (transformers'
``apply_chat_template(tools=...)``), and the history's calls and results as its messages
(assistant ``tool_calls`` with their arguments as objects, ``role: "tool"`` messages);
the family of its tool-call format is read from the template's text. A template that
cannot show tools gets the ``generic`` format instead: a system prompt lists the tools
and asks for ``<tool_call>`` blocks (the Hermes format, the one models most often know),
and the history's calls and results are written into the messages as text.

``--tool-call-parser NAME`` (``EngineConfig.tool_call_parser``) forces a family; "auto"
reads it from the template, and "generic" always uses the generic format.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pagedllm.tool_calls.parsers import (
    TOOL_CALL_PARSERS,
    ParsedDelta,
    ParsedReply,
    ToolCallStream,
    parse_tool_calls,
    tool_call_stream,
)
from pagedllm.tool_calls.tools import (
    InvalidToolRequest,
    Tool,
    ToolChoice,
    check_tools,
    history_arguments,
)

# What starts a call in each format's output, and what else marks calls.
MARKERS = {
    "hermes": "<tool_call>",
    "generic": "<tool_call>",
    "llama3_json": "<|python_tag|>",
    "mistral": "[TOOL_CALLS]",
}
TAGS = {**{fmt: (marker,) for fmt, marker in MARKERS.items()}, "hermes": ("<tool_call>", "</tool_call>"),
        "generic": ("<tool_call>", "</tool_call>")}  # fmt: skip
# A tool to see whether a template renders tools at all.
_PROBE_TOOL = Tool("probe_tool", "A probe.", {"type": "object", "properties": {}}).to_dict()
_PROBE_MESSAGES = [{"role": "user", "content": "Hello"}]


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """How one request uses tools: the format its reply is read in, the tools and the
    choice (checked), and whether several calls are allowed."""

    format: str
    tools: tuple[Tool, ...]
    choice: ToolChoice
    parallel: bool = True

    @property
    def parses(self) -> bool:
        """True when the reply is read for calls (tools shown, choice not "none")."""
        return bool(self.tools) and self.choice.mode != "none"

    def tool(self, name: str) -> Tool:
        return next(t for t in self.tools if t.name == name)

    def parse(self, text: str) -> ParsedReply:
        """A whole reply's content and calls (the first only, unless ``parallel``)."""
        reply = parse_tool_calls(self.format, text)
        return reply if self.parallel else ParsedReply(reply.content, reply.tool_calls[:1])

    def stream(self) -> ToolCallStream:
        return tool_call_stream(self.format)

    def limit(self, delta: ParsedDelta) -> ParsedDelta:
        """A streamed delta with the first call only, unless ``parallel``."""
        if self.parallel:
            return delta
        return ParsedDelta(delta.content, tuple(c for c in delta.tool_calls if c.index == 0))


def tool_finish_reason(reason: str | None, has_calls: bool) -> str | None:
    """A reply that ended on its own after calling tools finished with "tool_calls"."""
    return "tool_calls" if has_calls and reason == "stop" else reason


def render_chat(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    tool_choice: Any = None,
    parallel_tool_calls: bool = True,
    tool_call_parser: str = "auto",
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
) -> tuple[str, ToolPlan | None]:
    """The conversation as the prompt text, and its ``ToolPlan`` (None when neither the
    request nor its history has tools). ``InvalidToolRequest`` names a bad field; what
    the template itself raises goes up unchanged."""
    checked, choice = check_tools(tools, tool_choice)
    conversation = [_message(m, f"messages[{i}]") for i, m in enumerate(messages)]
    kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": add_generation_prompt}
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    uses_tools = checked or any(m.get("tool_calls") or m["role"] == "tool" for m in conversation)
    if not uses_tools:
        return tokenizer.apply_chat_template(conversation, **kwargs), None
    plan = ToolPlan(
        choose_format(tokenizer, tool_call_parser, chat_template), checked, choice,
        bool(parallel_tool_calls),
    )  # fmt: skip
    shown = checked if choice.mode != "none" else ()
    if plan.format == "generic":
        conversation = generic_conversation(conversation, shown, choice, plan.parallel)
    else:
        if plan.format == "mistral":
            conversation = [_short_ids(m) for m in conversation]
        if shown:
            kwargs["tools"] = [t.to_dict() for t in shown]
    return tokenizer.apply_chat_template(conversation, **kwargs), plan


def choose_format(tokenizer: Any, parser: str, chat_template: str | None = None) -> str:
    """The tool-call format for ``--tool-call-parser parser``: "auto" reads the
    template (generic when it shows no tools, or in a format we do not know)."""
    if parser not in TOOL_CALL_PARSERS:
        raise ValueError(f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got {parser!r}")
    if parser == "auto":
        return template_format(template_text(tokenizer, chat_template)) or "generic"
    if parser != "generic" and not renders_tools(tokenizer, chat_template):
        raise InvalidToolRequest(
            f"this model's chat template does not render tools, which --tool-call-parser "
            f"{parser} needs (the default, auto, describes them in a system prompt instead)",
            "tools",
        )
    return parser


def template_format(template: str) -> str | None:
    """The tool-call format a chat template's text asks for, None if it shows no tools."""
    if "tools" not in template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|start_header_id|>" in template and (
        "ipython" in template or "<|python_tag|>" in template
    ):
        return "llama3_json"
    return None


def template_text(tokenizer: Any, chat_template: str | None = None) -> str:
    """The template's source (a tokenizer's named templates all together)."""
    template = chat_template if chat_template is not None else tokenizer.chat_template
    if isinstance(template, Mapping):
        return "\n".join(str(t) for t in template.values())
    return template or ""


def renders_tools(tokenizer: Any, chat_template: str | None = None) -> bool:
    """True when the template's output changes when it is given a tool."""
    kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": True}
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    try:
        plain = tokenizer.apply_chat_template(_PROBE_MESSAGES, **kwargs)
        shown = tokenizer.apply_chat_template(_PROBE_MESSAGES, tools=[_PROBE_TOOL], **kwargs)
    except Exception:  # noqa: BLE001 - a template that raises on tools renders none
        return False
    return plain != shown


def special_marker(tokenizer: Any, fmt: str) -> int | None:
    """The token id of ``fmt``'s call marker when the tokenizer has it as a special
    token (the reply must then keep special tokens for the marker to be read)."""
    marker = MARKERS[fmt]
    special = set(getattr(tokenizer, "all_special_tokens", ()))
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    special |= {t.content for t in decoder.values() if getattr(t, "special", False)}
    return tokenizer.convert_tokens_to_ids(marker) if marker in special else None


def tag_token_ids(tokenizer: Any, fmt: str) -> dict[str, int]:
    """``fmt``'s tags that the tokenizer has as added tokens (Qwen2.5's ``<tool_call>``,
    Mistral's ``[TOOL_CALLS]``), with their ids: a grammar asks for that token, as the
    model writes it, not for the tag's text spelled out in other tokens."""
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    added = {token.content: token_id for token_id, token in decoder.items()}
    return {tag: added[tag] for tag in TAGS[fmt] if tag in added}


# ---------------------------------------------------------------- messages


def _message(message: Mapping[str, Any], param: str) -> dict[str, Any]:
    """An OpenAI message as templates take it: content as one string, earlier calls'
    arguments as objects."""
    if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
        raise InvalidToolRequest("a message must be an object with a role", param)
    role = message["role"]
    out: dict[str, Any] = {"role": role, "content": _text(message.get("content"))}
    if role == "assistant" and message.get("tool_calls"):
        out["tool_calls"] = [
            _history_call(call, f"{param}.tool_calls[{j}]")
            for j, call in enumerate(message["tool_calls"])
        ]
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise InvalidToolRequest(
                "a tool message needs the id of the call it answers", f"{param}.tool_call_id"
            )
        out["tool_call_id"] = call_id
        if isinstance(message.get("name"), str):
            out["name"] = message["name"]
    return out


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "\n".join(_part_text(part) for part in content)
    return content or ""


def _part_text(part: Any) -> str:
    return part.get("text", "") if isinstance(part, Mapping) else getattr(part, "text", "")


def _history_call(call: Any, param: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise InvalidToolRequest("a call must be {'id', 'function': {'name', 'arguments'}}", param)
    arguments = history_arguments(function.get("arguments"), f"{param}.function.arguments")
    return {
        "id": str(call.get("id") or ""),
        "type": "function",
        "function": {"name": function["name"], "arguments": arguments},
    }


def _short_ids(message: dict[str, Any]) -> dict[str, Any]:
    """Mistral's templates take call ids of exactly nine letters and digits."""
    out = dict(message)
    if "tool_call_id" in out:
        out["tool_call_id"] = mistral_call_id(out["tool_call_id"])
    if "tool_calls" in out:
        out["tool_calls"] = [{**c, "id": mistral_call_id(c["id"])} for c in out["tool_calls"]]
    return out


def mistral_call_id(call_id: str) -> str:
    return re.sub(r"[^a-zA-Z0-9]", "", call_id)[-9:].rjust(9, "0")


# ---------------------------------------------------------------- the generic format


def generic_conversation(
    conversation: list[dict[str, Any]],
    tools: Sequence[Tool],
    choice: ToolChoice,
    parallel: bool,
) -> list[dict[str, Any]]:
    """Messages any template renders: the tools in a system prompt, earlier calls as
    ``<tool_call>`` blocks in the assistant's text, results as user messages."""
    out: list[dict[str, Any]] = []
    for message in conversation:
        if message["role"] == "tool":
            response = f"<tool_response>\n{message['content']}\n</tool_response>"
            if out and out[-1].get("tool_responses"):
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "tool_responses": True})
        elif message.get("tool_calls"):
            blocks = [_generic_block(c["function"]) for c in message["tool_calls"]]
            text = "\n".join(([message["content"]] if message["content"] else []) + blocks)
            out.append({"role": "assistant", "content": text})
        else:
            out.append({"role": message["role"], "content": message["content"]})
    for message in out:
        message.pop("tool_responses", None)
    if tools:
        prompt = generic_system_prompt(tools, choice, parallel)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _generic_block(function: Mapping[str, Any]) -> str:
    call = {"name": function["name"], "arguments": function["arguments"]}
    return f"<tool_call>\n{json.dumps(call, ensure_ascii=False)}\n</tool_call>"


def generic_system_prompt(tools: Sequence[Tool], choice: ToolChoice, parallel: bool) -> str:
    """The system prompt that describes ``tools`` and the generic call format."""
    listed = "\n".join(json.dumps(t.to_dict(), ensure_ascii=False) for t in tools)
    rules = []
    if choice.mode == "required":
        rules.append("You must call at least one function.")
    elif choice.mode == "named":
        rules.append(f"You must call the function {choice.name}.")
    if not parallel:
        rules.append("Call at most one function per reply.")
    return (
        "# Tools\n\nYou may call functions to help with the request. The functions, each "
        "with its parameters as a JSON Schema:\n<tools>\n"
        f"{listed}\n</tools>\n\n"
        "To call a function, reply with a JSON object per call inside <tool_call></tool_call> "
        'tags:\n<tool_call>\n{"name": <function-name>, "arguments": <arguments-object>}\n'
        "</tool_call>\nEach result comes back inside <tool_response></tool_response> tags."
        + "".join(f"\n{rule}" for rule in rules)
    )
