"""OpenAI-style error bodies: ``{"error": {"message", "type", "param", "code"}}``.

Every failure the server answers goes through ``APIError`` so that clients (the
``openai`` package maps status codes to exception classes) always see the same shape.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.responses import JSONResponse

# pydantic puts the member type of a union in the error location ("prompt", "list[int]", 1);
# those parts are not field names.
_TYPE_TAGS = {"str", "int", "float", "bool", "none", "list", "dict"}

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The body of every error answer (documented in the OpenAPI schema as such)."""

    error: ErrorDetail


def document_bad_requests(schema: dict[str, Any]) -> None:
    """FastAPI documents a failed validation as 422 with its own body; this server answers
    400 with ``ErrorResponse``. Rewrite ``schema`` (an OpenAPI document) to say so."""
    ref = "#/components/schemas/{model}"
    body = ErrorResponse.model_json_schema(ref_template=ref)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components.update(body.pop("$defs"))
    components["ErrorResponse"] = body
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            responses = operation.get("responses", {})
            if responses.pop("422", None) is not None:
                responses["400"] = {
                    "description": "Bad request: the error names the offending field",
                    "content": {
                        "application/json": {
                            "schema": {"$ref": "#/components/schemas/ErrorResponse"}
                        }
                    },
                }
    for unused in ("HTTPValidationError", "ValidationError"):
        components.pop(unused, None)


class APIError(Exception):
    """An error answered to the client with ``status`` and an OpenAI-style body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, "invalid_request_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def sse_event(self) -> bytes:
        """The same body as one SSE event, for failures after a stream has started."""
        return b"data: " + json.dumps(self.body(), separators=(",", ":")).encode() + b"\n\n"

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def _param_of(loc: tuple[Any, ...]) -> str | None:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif isinstance(item, str) and _is_field_name(item):
            parts.append(item if not parts else f".{item}")
    return "".join(parts) or None


def _is_field_name(item: str) -> bool:
    if item in _TYPE_TAGS or "[" in item or "-" in item:
        return False
    return not item[:1].isupper()  # model class names tag union members too


def from_validation_error(error: ValidationError | RequestValidationError) -> APIError:
    """A 400 naming the first offending field (or saying the JSON is malformed). FastAPI's
    errors (query parameters) start their location with where the field was: "query"."""
    if isinstance(error, RequestValidationError):
        errors = [{**e, "loc": tuple(e["loc"])[1:]} for e in error.errors()]
    else:
        errors = error.errors(include_url=False)
    if not errors:
        return bad_request("invalid request body")
    first = errors[0]
    if first["type"] == "json_invalid":
        return bad_request(f"malformed JSON body: {first['msg']}", code="invalid_json")
    param = _param_of(tuple(first["loc"]))
    if param is None:
        return bad_request(f"request body: {first['msg']}")
    top = param.split(".")[0].split("[")[0]
    if top == "prompt" and len({e["loc"][:1] for e in errors}) == 1 and len(errors) > 1:
        return bad_request(
            "prompt must be a string, a list of strings, a list of token ids or a list of "
            "lists of token ids",
            param="prompt",
        )
    return bad_request(f"{param}: {first['msg']}", param=param)
