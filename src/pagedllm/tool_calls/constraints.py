"""The grammar of a reply that must be calls (``tool_choice`` "required" or named).

The reply is held to the family's own call format, built from the tools' JSON Schemas,
so every call parses and its arguments validate: a Lark grammar (llguidance's dialect,
each call's arguments a ``%json`` schema) for the formats with markers around the JSON,
a JSON Schema for Llama 3's bare object. The keys are written in the order the family's
template writes them (the name first), so a streamed call's name arrives before its
arguments. Whitespace inside the arguments is bounded as structured outputs bound it
(``JSON_WHITESPACE``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from pagedllm.engine.structured_outputs import JSON_WHITESPACE
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.tool_calls.render import ToolPlan
from pagedllm.tool_calls.tools import Tool


def tool_call_constraint(
    plan: ToolPlan, tag_ids: Mapping[str, int] | None = None
) -> StructuredOutputsParams | None:
    """What holds a reply to ``plan``'s calls: "required", one call or more (one unless
    ``plan.parallel``); a named function, one call of it (OpenAI's meaning). None when
    the reply is free ("auto", "none"). ``tag_ids``: the format's tags that are tokens of
    their own (``render.tag_token_ids``)."""
    if not plan.choice.constrained:
        return None
    name = plan.choice.name
    tools = [plan.tool(name)] if name else list(plan.tools)
    if plan.format == "llama3_json":  # Llama 3 calls one function per reply
        return StructuredOutputsParams(json=llama3_schema(tools))
    several = plan.parallel and name is None
    return StructuredOutputsParams(grammar=lark_grammar(plan.format, tools, several, tag_ids))


def call_schema(tool: Tool, args_key: str = "arguments") -> dict[str, Any]:
    """The JSON Schema of one call object of ``tool``."""
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, args_key: tool.parameters},
        "required": ["name", args_key],
        "additionalProperties": False,
    }


def llama3_schema(tools: Sequence[Tool]) -> dict[str, Any]:
    schemas = [call_schema(t, "parameters") for t in tools]
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def lark_grammar(
    fmt: str, tools: Sequence[Tool], parallel: bool, tag_ids: Mapping[str, int] | None = None
) -> str:
    """Calls in ``fmt`` ("hermes", "generic" or "mistral"), one rule per tool; a tag in
    ``tag_ids`` is asked for as that token (``<[id]>``), any other spelled as text."""
    if fmt not in ("hermes", "generic", "mistral"):
        raise ValueError(f"no call grammar for format {fmt!r}")
    ids = tag_ids or {}

    def tag(text: str) -> str:
        return f"<[{ids[text]}]>" if text in ids else _literal(text)

    if fmt == "mistral":
        more = ' (", " call)*' if parallel else ""
        lines = [f'start: {tag("[TOOL_CALLS]")} "[" call{more} "]"']
    else:
        lines = ['start: call ("\\n" call)*' if parallel else "start: call"]
    lines.append("call: " + " | ".join(f"call_{i}" for i in range(len(tools))))
    for i, tool in enumerate(tools):
        head = _literal(json.dumps({"name": tool.name})[:-1] + ', "arguments": ')
        if fmt == "mistral":
            lines.append(f'call_{i}: {head} args_{i} "}}"')
        else:
            lines.append(
                f'call_{i}: {tag("<tool_call>")} "\\n" {head} args_{i} "}}\\n" {tag("</tool_call>")}'
            )
        lines.append(f"args_{i}: %json {json.dumps(bounded_whitespace(tool.parameters))}")
    return "\n".join(lines) + "\n"


def bounded_whitespace(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` whose JSON may hold at most a few whitespace characters in a row (an
    endless run is how a small model most often fails to close the object)."""
    return {**schema, "x-guidance": {"whitespace_pattern": JSON_WHITESPACE}}


def _literal(text: str) -> str:
    """A Lark string literal of ``text``."""
    return json.dumps(text)
