"""A request's tools and tool choice, checked once for the server and the offline ``LLM``.

Every refusal is an ``InvalidToolRequest`` (a ``ValueError``) whose ``param`` names the
field in the OpenAI request (``tools[1].function.parameters``), so the server answers
400 naming it and the offline API raises with the same words.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

CHOICE_MODES = ("none", "auto", "required")
# OpenAI's rule for function names (dots allowed too); a name also goes into grammars
# as a literal, which this keeps free of quotes and escapes.
NAME_PATTERN = re.compile(r"[a-zA-Z0-9_.-]{1,64}")
# A function without parameters takes an empty object.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


class InvalidToolRequest(ValueError):
    """A bad ``tools`` / ``tool_choice`` / tool message; ``param`` is the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass(frozen=True, slots=True)
class Tool:
    """One function a model may call; ``parameters`` is a JSON Schema of an object."""

    name: str
    description: str | None
    parameters: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        """The OpenAI shape, as chat templates take their ``tools``."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """``mode`` is "none", "auto", "required" or "named" (then ``name`` is the tool)."""

    mode: str
    name: str | None = None

    @property
    def constrained(self) -> bool:
        """True when the reply must be calls: "required" and named ones."""
        return self.mode in ("required", "named")


def check_tools(
    tools: Sequence[Mapping[str, Any]] | None, tool_choice: Any = None
) -> tuple[tuple[Tool, ...], ToolChoice]:
    """The tools of an OpenAI request (``{"type": "function", "function": {...}}``) and
    its ``tool_choice`` ("none", "auto", "required" or ``{"type": "function",
    "function": {"name": ...}}``; default "auto" with tools, "none" without)."""
    checked = tuple(_check_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools or ()))
    names = [t.name for t in checked]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise InvalidToolRequest(f"two tools are named {name!r}", f"tools[{i}].function.name")
    return checked, _check_choice(tool_choice, checked)


def _check_tool(tool: Any, param: str) -> Tool:
    if not isinstance(tool, Mapping) or tool.get("type") != "function":
        raise InvalidToolRequest("a tool must be {'type': 'function', 'function': {...}}", param)
    function = tool.get("function")
    if not isinstance(function, Mapping):
        raise InvalidToolRequest("must be an object with a name", f"{param}.function")
    name = function.get("name")
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise InvalidToolRequest(
            f"must be 1 to 64 letters, digits, '_', '.' or '-', got {name!r}",
            f"{param}.function.name",
        )
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise InvalidToolRequest("must be a string", f"{param}.function.description")
    parameters = check_parameters(function.get("parameters"), f"{param}.function.parameters")
    return Tool(name, description, parameters)


def check_parameters(schema: Any, param: str) -> dict[str, Any]:
    """A function's parameters: a valid JSON Schema of an object (``type`` may be left
    out); None means no parameters."""
    if schema is None:
        return dict(NO_PARAMETERS)
    if not isinstance(schema, Mapping):
        raise InvalidToolRequest("must be a JSON Schema object", param)
    schema = copy.deepcopy(dict(schema))
    kind = schema.setdefault("type", "object")
    if kind != "object":
        raise InvalidToolRequest(
            f"must describe an object (type 'object'), got type {kind!r}", param
        )
    from jsonschema.exceptions import SchemaError
    from jsonschema.validators import validator_for

    try:
        validator_for(schema).check_schema(schema)
    except SchemaError as exc:
        where = exc.json_path.removeprefix("$") or " (top level)"
        raise InvalidToolRequest(
            f"not a valid JSON Schema at {where.lstrip('.')}: {exc.message}", param
        ) from None
    return schema


def _check_choice(choice: Any, tools: tuple[Tool, ...]) -> ToolChoice:
    if choice is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(choice, str):
        if choice not in CHOICE_MODES:
            raise InvalidToolRequest(
                f"must be one of {CHOICE_MODES} or a named function, got {choice!r}", "tool_choice"
            )
        if choice == "required" and not tools:
            raise InvalidToolRequest("'required' needs tools", "tool_choice")
        return ToolChoice(choice)
    named = isinstance(choice, Mapping) and choice.get("type") == "function"
    function = choice.get("function") if named else None
    name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(name, str):
        raise InvalidToolRequest(
            "must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
            "tool_choice",
        )
    if name not in {t.name for t in tools}:
        known = ", ".join(repr(t.name) for t in tools) or "none"
        raise InvalidToolRequest(
            f"names the function {name!r}, which is not among the tools ({known})",
            "tool_choice.function.name",
        )
    return ToolChoice("named", name)


def history_arguments(arguments: Any, param: str) -> dict[str, Any]:
    """An earlier call's ``arguments`` (JSON text of an object, as OpenAI sends them)
    as the object chat templates render."""
    if isinstance(arguments, Mapping):
        return dict(arguments)
    try:
        value = json.loads(arguments) if isinstance(arguments, str) else None
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise InvalidToolRequest("must be the JSON text of an object", param)
    return value
