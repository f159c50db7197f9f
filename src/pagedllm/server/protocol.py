"""Request and response bodies of the OpenAI API, as pydantic models.

Requests are validated in strict JSON mode: ``"16"`` is not an integer and ``true`` is
not a number, so a wrong type is a 400 naming the field rather than a silent coercion.
Unknown fields are ignored, as OpenAI clients send extras (``user``, ``metadata`` ...).
Every number is bounded here (``Int64`` and its kin, ``FiniteFloat``), so a value the engine
core cannot take is a 400 naming its field rather than a failure past the edge.

Responses are built with ``model_dump_json`` so that the field order, and therefore the
bytes of every SSE event, is fixed by the order of the fields below.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from annotated_types import Interval
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, FiniteFloat, model_serializer

from pagedllm.engine.args import parse_size

# Integers cross to the engine core in msgpack, whose integers are 64-bit, and reach torch
# as int64: a larger one would fail there, as a 500. Every integer a client sends (query
# parameters too) is one of these or has tighter bounds of its own in its Field (never
# both: the type's bound would override the Field's); every float is a FiniteFloat.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
Int64 = Annotated[int, Interval(ge=INT64_MIN, le=INT64_MAX)]
Count = Annotated[int, Interval(ge=0, le=INT64_MAX)]  # token ids, sequence numbers
Positive = Annotated[int, Interval(ge=1, le=INT64_MAX)]  # lengths, limits
TopK = Annotated[int, Interval(ge=-1, le=INT64_MAX)]  # -1 and 0: no top-k

# Tools in one request (OpenAI's limit), and calls in one earlier assistant message.
MAX_TOOLS = 128

# Token-id prompts: one prompt or a batch of them (the vocabulary is checked later:
# a negative id is "outside the vocabulary" too).
TokenIds = list[Int64]


def _token_id_keys(bias: dict[str, float]) -> dict[int, float]:
    """JSON keys are strings: each must spell a token id."""
    out = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit() and int(key) <= INT64_MAX):
            raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
        out[int(key)] = value
    return out


def _size_in_bytes(size: str | int) -> int:
    """``"2GiB"`` or a number of bytes, as a positive int64."""
    num_bytes = parse_size(size)
    if not 0 < num_bytes <= INT64_MAX:
        raise ValueError(f"size must be positive and at most {INT64_MAX} bytes, got {size!r}")
    return num_bytes


LogitBias = Annotated[
    dict[str, FiniteFloat],
    AfterValidator(_token_id_keys),
    Field(json_schema_extra={"propertyNames": {"pattern": "^[0-9]{1,18}$"}}),
]
ByteSize = Annotated[str | Positive, AfterValidator(_size_in_bytes)]


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class SamplingFields(_Request):
    """Fields shared by completions and chat completions (vLLM names)."""

    model: str | None = None
    n: int = Field(default=1, ge=1, le=128)
    temperature: FiniteFloat | None = Field(default=None, ge=0.0, le=2.0)
    top_p: FiniteFloat | None = Field(default=None, gt=0.0, le=1.0)
    top_k: TopK | None = None
    min_p: FiniteFloat | None = Field(default=None, ge=0.0, le=1.0)
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Count] | None = None
    response_format: dict[str, Any] | None = None
    # vLLM's: {"json": schema} | {"json_object": true} | {"regex"} | {"choice"} | {"grammar"}
    structured_outputs: dict[str, Any] | None = None
    presence_penalty: FiniteFloat | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: FiniteFloat | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: FiniteFloat | None = Field(default=None, gt=0.0)
    logit_bias: LogitBias | None = None
    ignore_eos: bool = False
    min_tokens: Count = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # pagedllm / vLLM extensions
    cache_salt: str | None = Field(default=None, min_length=1)
    priority: Int64 = 0


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: Positive | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    best_of: Positive | None = None
    suffix: str | None = None
    # Each choice also carries its generated token ids (always so without a tokenizer).
    return_token_ids: bool = False


class TextContentPart(_Request):
    type: Literal["text"]
    text: str


class FunctionCall(_Request):
    """An earlier call's function: ``arguments`` is JSON text, as OpenAI sends it."""

    name: str = Field(min_length=1)
    arguments: str


class ToolCallMessagePart(_Request):
    """One of an assistant message's earlier ``tool_calls``."""

    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessagePart] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_call_id: str | None = Field(default=None, min_length=1, max_length=256)


class FunctionDefinition(_Request):
    """A tool's function; ``parameters`` is a JSON Schema (checked in tool_calls/tools.py)."""

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    # OpenAI: hold the arguments to the schema. Required and named calls always are (the
    # grammar); auto never is, strict or not (README, "Tools (function calling)").
    strict: bool | None = None


class ChatTool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Request):
    name: str = Field(min_length=1, max_length=64)


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Positive | None = None
    max_completion_tokens: Positive | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True
    tools: list[ChatTool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True


# ---------------------------------------------------------------- responses


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PromptTokensDetails(_Response):
    cached_tokens: int = 0
    # pagedllm: where the replica's cache event log stood when the cached prefix was
    # looked up (one prompt only), so a router can replay its view to that point.
    cache_event_seq: int | None = None
    # ... and where it stood when the request arrived (its miss: before arrival, or queued)
    arrival_event_seq: int | None = None


class Usage(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class CompletionLogprobs(_Response):
    """The legacy completions logprobs layout (parallel lists)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionStreamResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob] | None = None


class _DropsNone(_Response):
    """A body whose None fields are left out."""

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ResponseFunction(_Response):
    name: str
    arguments: str


class ResponseToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunction


class AssistantMessage(_Response):
    """``tool_calls`` only when the request had tools (then ``content`` is null when the
    reply is only calls)."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ResponseToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_absent_calls(self, handler: Any) -> dict[str, Any]:
        body = handler(self)
        if body.get("tool_calls") is None:
            body.pop("tool_calls", None)
        return body


class ChatChoice(_Response):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaFunction(_DropsNone):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_DropsNone):
    """A call's stream delta: ``id``, ``type`` and the name first, then arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction | None = None


class DeltaMessage(_DropsNone):
    """A chat stream delta; absent fields are left out (``{}`` on the final chunk)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pagedllm"
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class CacheResizeRequest(_Request):
    """``POST /v1/cache/resize``: the KV cache's new size, ``"2GiB"`` or bytes."""

    kv_cache_memory: ByteSize
    preempt: bool = False


# The bodies the routes read themselves (``parse_body``), so that the OpenAPI document
# describes them all the same (``body_schema``; the app adds them to its components).
REQUEST_BODIES = (CompletionRequest, ChatCompletionRequest, CacheResizeRequest)


def body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """A route's ``openapi_extra``: its JSON body is ``model``."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}
