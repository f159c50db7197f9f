"""``POST /v1/chat/completions``: messages through the model's chat template, ``n``
answers out, whole or as Server-Sent Events (the role first, the finish reason last)."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from pagedllm.engine.async_engine import ChoiceDelta, RequestSpec, RequestStream
from pagedllm.server.errors import bad_request
from pagedllm.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatStreamChoice,
    DeltaMessage,
    Usage,
)
from pagedllm.server.serving import (
    Prompt,
    ServerContext,
    chat_logprobs,
    check_common,
    check_length,
    check_model,
    check_structured_outputs,
    new_id,
    outputs_of,
    parse_body,
    respond,
    sampling_params,
    usage_of,
)
from pagedllm.server.sse import sse_event


def chat_prompt(ctx: ServerContext, req: ChatCompletionRequest) -> Prompt:
    """The messages through the tokenizer's chat template."""
    return render_chat_prompt(ctx.text_tokenizer("messages"), req)


def render_chat_prompt(tokenizer: Any, req: ChatCompletionRequest) -> Prompt:
    """The messages through ``tokenizer``'s chat template (the router hashes the same
    token ids the engine will)."""
    if not getattr(tokenizer, "chat_template", None):
        raise bad_request("this model has no chat template; use /v1/completions", param="messages")
    conversation = []
    for message in req.messages:
        content = message.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        conversation.append({"role": message.role, "content": content or ""})
    try:
        text = tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=req.add_generation_prompt
        )
    except Exception as exc:  # jinja templates raise anything (e.g. role order rules)
        raise bad_request(f"messages: the chat template refused them: {exc}", "messages") from None
    token_ids = list(tokenizer.encode(text, add_special_tokens=False))
    if not token_ids:
        raise bad_request("messages produce an empty prompt", param="messages")
    return Prompt(token_ids, text)


async def create_chat_completion(ctx: ServerContext, request: Request) -> Response:
    req = parse_body(ChatCompletionRequest, await request.body())
    _check_request(ctx, req)
    await check_structured_outputs(ctx, req)
    prompt = chat_prompt(ctx, req)
    request_id = new_id("chatcmpl", request)

    def body(outputs: list[Any], created: int) -> ChatCompletionResponse:
        choices = [_choice(ctx, req, c) for c in sorted(outputs[0].outputs, key=lambda c: c.index)]
        return ChatCompletionResponse(
            id=request_id, created=created, model=ctx.model_name, choices=choices,
            usage=usage_of(outputs),
        )  # fmt: skip

    spec = _spec(ctx, req, f"{request_id}-0", prompt)
    return await respond(
        ctx, request, request_id, [spec], req.stream, body,
        lambda streams, created: chat_events(ctx, req, request_id, created, streams[0]),
    )  # fmt: skip


def _check_request(ctx: ServerContext, req: ChatCompletionRequest) -> None:
    check_model(ctx, req.model)
    check_common(req)
    if req.tools:
        raise bad_request("tools are not supported", param="tools")
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs to be true", param="top_logprobs")


def _spec(
    ctx: ServerContext, req: ChatCompletionRequest, request_id: str, prompt: Prompt
) -> RequestSpec:
    # max_completion_tokens is the current name; max_tokens the deprecated one.
    if req.max_completion_tokens is not None:
        asked, param = req.max_completion_tokens, "max_completion_tokens"
    else:
        asked, param = req.max_tokens, "max_tokens"
    check_length(ctx, len(prompt.token_ids), asked, "messages", param)
    logprobs = _num_top(req) if req.logprobs else None
    params = sampling_params(req, asked, logprobs)
    return RequestSpec(request_id, prompt.token_ids, params, req.priority, req.cache_salt)


def _num_top(req: ChatCompletionRequest) -> int:
    """Alternatives per token the request asks for (``top_logprobs``, 0 when unset)."""
    return req.top_logprobs or 0


def _choice(ctx: ServerContext, req: ChatCompletionRequest, c: Any) -> ChatChoice:
    logprobs = None
    if req.logprobs and c.logprobs is not None:
        logprobs = chat_logprobs(ctx.tokenizer, c.logprobs, c.token_ids, _num_top(req))
    return ChatChoice(
        index=c.index,
        message=AssistantMessage(content=c.text),
        logprobs=logprobs,
        finish_reason=c.finish_reason,
        stop_reason=c.stop_reason,
    )


async def chat_events(
    ctx: ServerContext,
    req: ChatCompletionRequest,
    request_id: str,
    created: int,
    stream: RequestStream,
) -> AsyncGenerator[bytes, None]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    exclude = None if include_usage else {"usage"}

    def chunk(choices: list[ChatStreamChoice], usage: Usage | None = None) -> bytes:
        body = ChatCompletionStreamResponse(
            id=request_id, created=created, model=ctx.model_name, choices=choices, usage=usage
        )
        return sse_event(body, exclude=exclude)

    started: set[int] = set()
    async with aclosing(outputs_of(ctx, stream)) as deltas:
        async for delta in deltas:
            for c in delta.choices:
                if c.index not in started:
                    started.add(c.index)
                    role = DeltaMessage(role="assistant", content="")
                    yield chunk([ChatStreamChoice(index=c.index, delta=role)])
                yield chunk([_chat_delta(ctx, req, c)])
    if include_usage:
        yield chunk([], usage_of([stream.output()]))


def _chat_delta(ctx: ServerContext, req: ChatCompletionRequest, c: ChoiceDelta) -> ChatStreamChoice:
    logprobs = None
    if req.logprobs and c.logprobs:
        logprobs = chat_logprobs(ctx.tokenizer, c.logprobs, c.token_ids, _num_top(req))
    return ChatStreamChoice(
        index=c.index,
        delta=DeltaMessage(content=c.text) if c.text else DeltaMessage(),
        logprobs=logprobs,
        finish_reason=c.finish_reason,
        stop_reason=c.stop_reason,
    )
