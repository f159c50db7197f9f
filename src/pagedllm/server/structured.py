"""Structured outputs on the server: ``response_format`` (OpenAI: ``text``, ``json_object``,
``json_schema``) and vLLM's ``structured_outputs`` request field, both to one
``StructuredOutputsParams``; its grammar is compiled here, in a worker thread of the API
process (cached, time-limited), so a spec the engine cannot take is a 400 naming the field,
the JSON-Schema feature and its path before the request reaches the engine core.
"""

from __future__ import annotations

import asyncio
from typing import Any, NamedTuple

from pagedllm.engine.structured_outputs import GrammarCompiler, GrammarError
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.server.errors import bad_request
from pagedllm.server.protocol import SamplingFields

RESPONSE_FORMATS = ("text", "json_object", "json_schema")


class Structured(NamedTuple):
    """A request's constraint and the field it came from (errors name that field)."""

    params: StructuredOutputsParams
    field: str


def structured_outputs_of(req: SamplingFields) -> Structured | None:
    """The request's constraint, or None; a 400 naming the field for a malformed one."""
    from_format = _from_response_format(req.response_format)
    if req.structured_outputs is None:
        return from_format
    if from_format is not None:
        raise bad_request(
            "structured_outputs: set it or response_format, not both", param="structured_outputs"
        )
    try:
        params = StructuredOutputsParams.from_dict(req.structured_outputs)
    except (ValueError, TypeError) as exc:
        raise bad_request(str(exc), param="structured_outputs") from None
    return Structured(params, f"structured_outputs.{params.kind}")


def _from_response_format(response_format: dict[str, Any] | None) -> Structured | None:
    if response_format is None:
        return None
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return Structured(StructuredOutputsParams(json_object=True), "response_format")
    if kind != "json_schema":
        raise bad_request(
            f"response_format.type {kind!r} is not supported (one of "
            f"{', '.join(RESPONSE_FORMATS)})",
            param="response_format.type",
        )
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request(
            "response_format.json_schema must be an object with a schema",
            param="response_format.json_schema",
        )
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request(
            "response_format.json_schema.strict must be a boolean",
            param="response_format.json_schema.strict",
        )
    field = "response_format.json_schema.schema"
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise bad_request(f"{field} must be a JSON Schema object", param=field)
    # strict or not, the schema is enforced: every draw is masked by its grammar.
    try:
        return Structured(StructuredOutputsParams(json=schema), field)
    except ValueError as exc:
        raise bad_request(str(exc), param=field) from None


async def check_compiles(compiler: GrammarCompiler, structured: Structured | None) -> None:
    """Compile the request's grammar in a worker thread (the event loop keeps serving);
    a 400 naming the field when the engine cannot take it or it takes too long."""
    if structured is None:
        return
    try:
        await asyncio.to_thread(compiler.compile, structured.params)
    except GrammarError as exc:
        raise bad_request(exc.message(structured.field), param=structured.field) from None
