"""``POST /v1/completions``: a prompt (text, token ids, or a batch of either) in,
``n`` completions per prompt out, whole or as Server-Sent Events."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from pagedllm.engine.async_engine import ChoiceDelta, RequestSpec, RequestStream
from pagedllm.server.errors import bad_request
from pagedllm.server.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
)
from pagedllm.server.serving import (
    Prompt,
    ServerContext,
    check_common,
    check_length,
    check_model,
    check_structured_outputs,
    completion_logprobs,
    echo_logprobs,
    new_id,
    outputs_of,
    parse_body,
    respond,
    sampling_params,
    usage_of,
)
from pagedllm.server.sse import sse_event


def completion_prompts(ctx: ServerContext, prompt: Any) -> list[Prompt]:
    """One ``Prompt`` per entry of a string, token-id list, or batch of either."""
    if isinstance(prompt, str):
        batch: list[Any] = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        batch = [prompt]
    else:
        batch = list(prompt)
    if not batch:
        raise bad_request("prompt must not be an empty list", param="prompt")
    prompts = []
    for i, item in enumerate(batch):
        param = "prompt" if len(batch) == 1 else f"prompt[{i}]"
        if isinstance(item, str):
            token_ids = list(ctx.text_tokenizer(param).encode(item))
            prompts.append(Prompt(token_ids, item))
        else:
            _check_token_ids(ctx, item, param)
            prompts.append(Prompt(list(item), None))
        if not prompts[-1].token_ids:
            raise bad_request(f"{param} must not be empty", param=param)
    return prompts


def _check_token_ids(ctx: ServerContext, token_ids: Sequence[int], param: str) -> None:
    for token_id in token_ids:
        if not 0 <= token_id < ctx.vocab_size:
            raise bad_request(
                f"{param}: token id {token_id} is outside the vocabulary (0..{ctx.vocab_size - 1})",
                param=param,
            )


async def create_completion(ctx: ServerContext, request: Request) -> Response:
    req = parse_body(CompletionRequest, await request.body())
    _check_request(ctx, req)
    await check_structured_outputs(ctx, req)
    prompts = completion_prompts(ctx, req.prompt)
    request_id = new_id("cmpl", request)
    specs = [_spec(ctx, req, request_id, i, p, len(prompts)) for i, p in enumerate(prompts)]
    if req.echo:
        prompts = [
            p if p.text is not None else Prompt(p.token_ids, _decode(ctx, p)) for p in prompts
        ]

    def body(outputs: list[Any], created: int) -> CompletionResponse:
        choices = [
            _choice(ctx, req, i, prompt, c, output.prompt_logprobs)
            for i, (prompt, output) in enumerate(zip(prompts, outputs, strict=True))
            for c in sorted(output.outputs, key=lambda c: c.index)
        ]
        return CompletionResponse(
            id=request_id, created=created, model=ctx.model_name, choices=choices,
            usage=usage_of(outputs),
        )  # fmt: skip

    return await respond(
        ctx, request, request_id, specs, req.stream, body,
        lambda streams, created: completion_events(ctx, req, request_id, created, prompts, streams),
    )  # fmt: skip


def _check_request(ctx: ServerContext, req: CompletionRequest) -> None:
    check_model(ctx, req.model)
    check_common(req)
    if req.suffix:
        raise bad_request("suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of different from n is not supported", param="best_of")


def _spec(
    ctx: ServerContext,
    req: CompletionRequest,
    request_id: str,
    index: int,
    prompt: Prompt,
    batch: int,
) -> RequestSpec:
    """Engine request ``{request_id}-{index}`` for the index-th prompt of a batch."""
    prompt_param = "prompt" if batch == 1 else f"prompt[{index}]"
    check_length(ctx, len(prompt.token_ids), req.max_tokens, prompt_param, "max_tokens")
    params = sampling_params(req, req.max_tokens, req.logprobs)
    if req.echo and req.logprobs is not None:
        # The echoed prompt's logprobs too, as vLLM returns them.
        params = dataclasses.replace(params, prompt_logprobs=req.logprobs)
    return RequestSpec(
        f"{request_id}-{index}", prompt.token_ids, params, req.priority, req.cache_salt
    )


def _choice(
    ctx: ServerContext,
    req: CompletionRequest,
    prompt_index: int,
    prompt: Prompt,
    c: Any,
    prompt_logprobs: Sequence[Any] | None,
) -> CompletionChoice:
    prefix = prompt.text if req.echo and prompt.text else ""
    logprobs = None
    if req.logprobs is not None and c.logprobs is not None:
        logprobs = completion_logprobs(
            ctx.tokenizer, c.logprobs, c.token_ids, req.logprobs, len(prefix)
        )
    if req.echo and req.logprobs is not None and prompt_logprobs is not None:
        logprobs = echo_logprobs(
            ctx.tokenizer, prompt.token_ids, prompt_logprobs, req.logprobs, logprobs
        )
    return CompletionChoice(
        index=prompt_index * req.n + c.index,
        text=prefix + c.text,
        logprobs=logprobs,
        finish_reason=c.finish_reason,
        stop_reason=c.stop_reason,
        token_ids=list(c.token_ids) if _returns_ids(ctx, req) else None,
    )


def _returns_ids(ctx: ServerContext, req: CompletionRequest) -> bool:
    """Choices carry token ids when asked, and always without a tokenizer (their text
    is then empty)."""
    return req.return_token_ids or ctx.tokenizer is None


def _decode(ctx: ServerContext, prompt: Prompt) -> str:
    return "" if ctx.tokenizer is None else ctx.tokenizer.decode(prompt.token_ids)


async def completion_events(
    ctx: ServerContext,
    req: CompletionRequest,
    request_id: str,
    created: int,
    prompts: Sequence[Prompt],
    streams: Sequence[RequestStream],
) -> AsyncGenerator[bytes, None]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    exclude: dict[str, Any] = {} if include_usage else {"usage": True}
    if not _returns_ids(ctx, req):
        exclude["choices"] = {"__all__": {"token_ids"}}
    for i, (prompt, stream) in enumerate(zip(prompts, streams, strict=True)):
        offsets: dict[int, int] = {}  # per choice: characters sent (for logprobs' text_offset)
        async with aclosing(outputs_of(ctx, stream)) as deltas:
            async for delta in deltas:
                choices = [
                    _completion_delta(ctx, req, prompt, stream, c, offsets, i * req.n)
                    for c in delta.choices
                ]
                chunk = CompletionStreamResponse(
                    id=request_id, created=created, model=ctx.model_name, choices=choices
                )
                yield sse_event(chunk, exclude=exclude or None)
    if include_usage:
        chunk = CompletionStreamResponse(
            id=request_id, created=created, model=ctx.model_name, choices=[],
            usage=usage_of([s.output() for s in streams]),
        )  # fmt: skip
        yield sse_event(chunk)


def _completion_delta(
    ctx: ServerContext,
    req: CompletionRequest,
    prompt: Prompt,
    stream: RequestStream,
    c: ChoiceDelta,
    offsets: dict[int, int],
    index_base: int,
) -> CompletionChoice:
    """The chunk of choice ``c``; the echoed prompt (and its logprobs) goes before its
    first text."""
    first = c.index not in offsets
    offset = offsets.get(c.index, 0)
    text = c.text
    if req.echo and first and prompt.text:
        text = prompt.text + text
    logprobs = None
    if req.logprobs is not None and c.logprobs:
        start = offset + (len(prompt.text or "") if req.echo and first else 0)
        logprobs = completion_logprobs(ctx.tokenizer, c.logprobs, c.token_ids, req.logprobs, start)
    if req.echo and first and req.logprobs is not None and stream.prompt_logprobs is not None:
        logprobs = echo_logprobs(
            ctx.tokenizer, prompt.token_ids, stream.prompt_logprobs, req.logprobs, logprobs
        )
    offsets[c.index] = offset + len(text)
    return CompletionChoice(
        index=index_base + c.index,
        text=text,
        logprobs=logprobs,
        finish_reason=c.finish_reason,
        stop_reason=c.stop_reason,
        token_ids=list(c.token_ids) if _returns_ids(ctx, req) else None,
    )
