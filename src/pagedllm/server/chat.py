"""``POST /v1/chat/completions``: messages through the model's chat template, ``n``
answers out, whole or as Server-Sent Events (the role first, the finish reason last).

With ``tools`` (``pagedllm/tool_calls/``) the template shows them, each answer is read for
calls in the model's format (``message.tool_calls``, or in a stream each call's id and
name first, then its argument fragments) and one that called ends with "tool_calls"; the
``x-pagedllm-tool-format`` header names the format. A reply that must call a tool
("required", or a named one) is held to the format's grammar, built from the tools'
schemas and compiled here before the engine sees the request."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from pagedllm.engine.async_engine import ChoiceDelta, RequestSpec, RequestStream
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams
from pagedllm.server.errors import bad_request
from pagedllm.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatStreamChoice,
    DeltaFunction,
    DeltaMessage,
    DeltaToolCall,
    ResponseFunction,
    ResponseToolCall,
    Usage,
)
from pagedllm.server.serving import (
    Prompt,
    ServerContext,
    chat_logprobs,
    check_common,
    check_length,
    check_model,
    check_structured,
    check_structured_outputs,
    new_id,
    outputs_of,
    parse_body,
    respond,
    sampling_params,
    usage_of,
)
from pagedllm.server.sse import sse_event
from pagedllm.server.structured import Structured, structured_outputs_of
from pagedllm.tool_calls.constraints import tool_call_constraint
from pagedllm.tool_calls.parsers import ToolCallDelta, ToolCallStream
from pagedllm.tool_calls.render import (
    ToolPlan,
    render_chat,
    special_marker,
    tag_token_ids,
    tool_finish_reason,
)
from pagedllm.tool_calls.tools import InvalidToolRequest

# Says how a chat with tools showed them to the model: its tool-call format ("hermes",
# "llama3_json", "mistral", or "generic" when the template cannot show tools).
TOOL_FORMAT_HEADER = "x-pagedllm-tool-format"


def chat_prompt(ctx: ServerContext, req: ChatCompletionRequest) -> Prompt:
    """The messages (and tools) through the tokenizer's chat template."""
    return render_chat_prompt(ctx.text_tokenizer("messages"), req, ctx.tool_call_parser)


def render_chat_prompt(
    tokenizer: Any, req: ChatCompletionRequest, tool_call_parser: str = "auto"
) -> Prompt:
    """The messages and tools through ``tokenizer``'s chat template (the router hashes
    the same token ids the engine will)."""
    if not getattr(tokenizer, "chat_template", None):
        raise bad_request("this model has no chat template; use /v1/completions", param="messages")
    choice = req.tool_choice
    try:
        text, plan = render_chat(
            tokenizer,
            [m.model_dump(exclude_none=True) for m in req.messages],
            tools=[t.model_dump(exclude_none=True) for t in req.tools or ()],
            tool_choice=choice.model_dump() if isinstance(choice, BaseModel) else choice,
            parallel_tool_calls=req.parallel_tool_calls,
            tool_call_parser=tool_call_parser,
            add_generation_prompt=req.add_generation_prompt,
        )
    except InvalidToolRequest as exc:
        raise bad_request(str(exc), param=exc.param) from None
    except Exception as exc:  # jinja templates raise anything (e.g. role order rules)
        raise bad_request(f"messages: the chat template refused them: {exc}", "messages") from None
    token_ids = list(tokenizer.encode(text, add_special_tokens=False))
    if not token_ids:
        raise bad_request("messages produce an empty prompt", param="messages")
    return Prompt(token_ids, text, plan)


async def create_chat_completion(ctx: ServerContext, request: Request) -> Response:
    req = parse_body(ChatCompletionRequest, await request.body())
    _check_request(ctx, req)
    await check_structured_outputs(ctx, req)
    prompt = chat_prompt(ctx, req)
    calls_only = await _tool_constraint(ctx, req, prompt.tools)
    request_id = new_id("chatcmpl", request)

    def body(outputs: list[Any], created: int) -> ChatCompletionResponse:
        ordered = sorted(outputs[0].outputs, key=lambda c: c.index)
        choices = [_choice(ctx, req, c, prompt.tools) for c in ordered]
        return ChatCompletionResponse(
            id=request_id, created=created, model=ctx.model_name, choices=choices,
            usage=usage_of(outputs),
        )  # fmt: skip

    spec = _spec(ctx, req, f"{request_id}-0", prompt, calls_only)
    headers = {TOOL_FORMAT_HEADER: prompt.tools.format} if prompt.tools else None
    return await respond(
        ctx, request, request_id, [spec], req.stream, body,
        lambda streams, created: chat_events(ctx, req, request_id, created, streams[0], prompt),
        headers,
    )  # fmt: skip


def _check_request(ctx: ServerContext, req: ChatCompletionRequest) -> None:
    check_model(ctx, req.model)
    check_common(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs to be true", param="top_logprobs")


async def _tool_constraint(
    ctx: ServerContext, req: ChatCompletionRequest, plan: ToolPlan | None
) -> StructuredOutputsParams | None:
    """The grammar a reply that must call a tool ("required", or a named one) is held
    to, compiled here first: each tool's parameters alone, so that a schema the engine
    cannot take is a 400 naming the tool, the JSON-Schema feature and its path."""
    if plan is None or not plan.choice.constrained:
        return None
    if structured_outputs_of(req) is not None:
        raise bad_request(
            "tool_choice: a reply that must call a tool cannot also follow response_format "
            "or structured_outputs",
            param="tool_choice",
        )
    for i, tool in enumerate(plan.tools):
        if plan.choice.name in (None, tool.name):
            parameters = StructuredOutputsParams(json=tool.parameters)
            await check_structured(ctx, Structured(parameters, f"tools[{i}].function.parameters"))
    constraint = tool_call_constraint(plan, tag_token_ids(ctx.tokenizer, plan.format))
    await check_structured(ctx, Structured(constraint, "tools"))
    return constraint


def _spec(
    ctx: ServerContext,
    req: ChatCompletionRequest,
    request_id: str,
    prompt: Prompt,
    calls_only: StructuredOutputsParams | None = None,
) -> RequestSpec:
    # max_completion_tokens is the current name; max_tokens the deprecated one.
    if req.max_completion_tokens is not None:
        asked, param = req.max_completion_tokens, "max_completion_tokens"
    else:
        asked, param = req.max_tokens, "max_tokens"
    check_length(ctx, len(prompt.token_ids), asked, "messages", param)
    logprobs = _num_top(req) if req.logprobs else None
    params = sampling_params(req, asked, logprobs)
    if prompt.tools is not None and prompt.tools.parses:
        params = _tool_params(ctx, params, prompt.tools)
    if calls_only is not None:
        params = dataclasses.replace(params, structured_outputs=calls_only)
    return RequestSpec(request_id, prompt.token_ids, params, req.priority, req.cache_salt)


def _tool_params(ctx: ServerContext, params: SamplingParams, plan: ToolPlan) -> SamplingParams:
    """A reply read for calls keeps a special-token call marker in its text."""
    if special_marker(ctx.tokenizer, plan.format) is not None:
        params = dataclasses.replace(params, skip_special_tokens=False)
    return params


def _num_top(req: ChatCompletionRequest) -> int:
    """Alternatives per token the request asks for (``top_logprobs``, 0 when unset)."""
    return req.top_logprobs or 0


def _choice(
    ctx: ServerContext, req: ChatCompletionRequest, c: Any, plan: ToolPlan | None
) -> ChatChoice:
    logprobs = None
    if req.logprobs and c.logprobs is not None:
        logprobs = chat_logprobs(ctx.tokenizer, c.logprobs, c.token_ids, _num_top(req))
    message, finish_reason = AssistantMessage(content=c.text), c.finish_reason
    if plan is not None and plan.parses:
        reply = plan.parse(c.text)
        calls = [
            ResponseToolCall(
                id=call.id, function=ResponseFunction(name=call.name, arguments=call.arguments)
            )
            for call in reply.tool_calls
        ]
        message = AssistantMessage(content=reply.content, tool_calls=calls)
        finish_reason = tool_finish_reason(c.finish_reason, bool(calls))
    return ChatChoice(
        index=c.index,
        message=message,
        logprobs=logprobs,
        finish_reason=finish_reason,
        stop_reason=c.stop_reason,
    )


async def chat_events(
    ctx: ServerContext,
    req: ChatCompletionRequest,
    request_id: str,
    created: int,
    stream: RequestStream,
    prompt: Prompt | None = None,
) -> AsyncGenerator[bytes, None]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    exclude = None if include_usage else {"usage"}
    plan = prompt.tools if prompt is not None and prompt.tools and prompt.tools.parses else None

    def chunk(choices: list[ChatStreamChoice], usage: Usage | None = None) -> bytes:
        body = ChatCompletionStreamResponse(
            id=request_id, created=created, model=ctx.model_name, choices=choices, usage=usage
        )
        return sse_event(body, exclude=exclude)

    started: set[int] = set()
    readers: dict[int, ToolCallStream] = {}  # per choice, with tools: its calls as they come
    async with aclosing(outputs_of(ctx, stream)) as deltas:
        async for delta in deltas:
            for c in delta.choices:
                if c.index not in started:
                    started.add(c.index)
                    role = DeltaMessage(role="assistant", content="")
                    yield chunk([ChatStreamChoice(index=c.index, delta=role)])
                if plan is None:
                    yield chunk([_chat_delta(ctx, req, c)])
                    continue
                reader = readers.setdefault(c.index, plan.stream())
                choice = _tool_delta(ctx, req, c, plan, reader)
                if choice is not None:
                    yield chunk([choice])
    if include_usage:
        yield chunk([], usage_of([stream.output()]))


def _chat_delta(ctx: ServerContext, req: ChatCompletionRequest, c: ChoiceDelta) -> ChatStreamChoice:
    return ChatStreamChoice(
        index=c.index,
        delta=DeltaMessage(content=c.text) if c.text else DeltaMessage(),
        logprobs=_delta_logprobs(ctx, req, c),
        finish_reason=c.finish_reason,
        stop_reason=c.stop_reason,
    )


def _delta_logprobs(ctx: ServerContext, req: ChatCompletionRequest, c: ChoiceDelta) -> Any:
    if req.logprobs and c.logprobs:
        return chat_logprobs(ctx.tokenizer, c.logprobs, c.token_ids, _num_top(req))
    return None


def _tool_delta(
    ctx: ServerContext,
    req: ChatCompletionRequest,
    c: ChoiceDelta,
    plan: ToolPlan,
    reader: ToolCallStream,
) -> ChatStreamChoice | None:
    """The chunk of a choice read for calls: its content and call deltas (None when this
    piece decided nothing and ended nothing)."""
    parsed = plan.limit(reader.feed(c.text, last=c.finish_reason is not None))
    logprobs = _delta_logprobs(ctx, req, c)
    finish_reason = c.finish_reason
    if finish_reason is not None:
        finish_reason = tool_finish_reason(finish_reason, bool(reader.reply().tool_calls))
    elif not parsed and logprobs is None:
        return None
    calls = [_delta_call(d) for d in parsed.tool_calls] or None
    return ChatStreamChoice(
        index=c.index,
        delta=DeltaMessage(content=parsed.content or None, tool_calls=calls),
        logprobs=logprobs,
        finish_reason=finish_reason,
        stop_reason=c.stop_reason,
    )


def _delta_call(delta: ToolCallDelta) -> DeltaToolCall:
    if delta.id is None:
        return DeltaToolCall(index=delta.index, function=DeltaFunction(arguments=delta.arguments))
    return DeltaToolCall(
        index=delta.index,
        id=delta.id,
        type="function",
        function=DeltaFunction(name=delta.name, arguments=delta.arguments),
    )
