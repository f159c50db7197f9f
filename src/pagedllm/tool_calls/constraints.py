"""The grammar of a reply that must be calls (``tool_choice`` "required" or named).

The reply is held to the family's own call format, built from the tools' JSON Schemas,
so every call parses and its arguments validate: a Lark grammar (llguidance's dialect,
each call's arguments a ``%json`` schema) for the formats with markers around the JSON,
a JSON Schema for Llama 3's bare object. The keys are written in the order the family's
template writes them (the name first), so a streamed call's name arrives before its
arguments. The result is the keyword arguments of ``StructuredOutputsParams``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from pagedllm.tool_calls.render import MARKERS, ToolPlan
from pagedllm.tool_calls.tools import Tool


def tool_call_constraint(
    plan: ToolPlan, marker_token_id: int | None = None
) -> dict[str, Any] | None:
    """``StructuredOutputsParams`` keywords holding a reply to ``plan``'s calls (one at
    most unless ``plan.parallel``); None when the reply is free ("auto", "none").
    ``marker_token_id``: the call marker's id when it is a special token."""
    if not plan.choice.constrained:
        return None
    tools = [plan.tool(plan.choice.name)] if plan.choice.name else list(plan.tools)
    if plan.format == "llama3_json":  # Llama 3 calls one function per reply
        return {"json": llama3_schema(tools)}
    return {"grammar": lark_grammar(plan.format, tools, plan.parallel, marker_token_id)}


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
    fmt: str, tools: Sequence[Tool], parallel: bool, marker_token_id: int | None = None
) -> str:
    """Calls in ``fmt`` ("hermes", "generic" or "mistral"), one per tool rule."""
    if fmt not in ("hermes", "generic", "mistral"):
        raise ValueError(f"no call grammar for format {fmt!r}")
    lines = []
    if fmt == "mistral":
        marker = f"<[{marker_token_id}]>" if marker_token_id is not None else _literal(MARKERS[fmt])
        more = ' (", " call)*' if parallel else ""
        lines.append(f'start: {marker} "[" call{more} "]"')
    else:
        lines.append('start: call ("\\n" call)*' if parallel else "start: call")
    lines.append("call: " + " | ".join(f"call_{i}" for i in range(len(tools))))
    for i, tool in enumerate(tools):
        head = _literal(json.dumps({"name": tool.name})[:-1] + ', "arguments": ')
        if fmt == "mistral":
            lines.append(f'call_{i}: {head} args_{i} "}}"')
        else:
            lines.append(f'call_{i}: "<tool_call>\\n" {head} args_{i} "}}\\n</tool_call>"')
        lines.append(f"args_{i}: %json {json.dumps(tool.parameters)}")
    return "\n".join(lines) + "\n"


def _literal(text: str) -> str:
    """A Lark string literal of ``text``."""
    return json.dumps(text)
