"""``POST /v1/completions``: a prompt (text, token ids, or a batch of either) in,
``n`` completions per prompt out, whole or as Server-Sent Events."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from pagedllm.engine.async_engine import RequestSpec, RequestStream
from pagedllm.server.errors import bad_request
from pagedllm.server.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
)
from pagedllm.server.serving import (
    ChoiceState,
    Prompt,
    ServerContext,
    check_common,
    check_model,
    completion_logprobs,
    new_id,
    outputs_of,
    parse_body,
    resolve_max_tokens,
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
    prompts = completion_prompts(ctx, req.prompt)
    request_id = new_id("cmpl", request)
    specs = [_spec(ctx, req, request_id, i, p, len(prompts)) for i, p in enumerate(prompts)]
    if req.echo:
        prompts = [
            p if p.text is not None else Prompt(p.token_ids, _decode(ctx, p)) for p in prompts
        ]

    def body(outputs: list[Any], created: int) -> CompletionResponse:
        choices = [
            _choice(ctx, req, i, prompt, c)
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
    max_tokens = resolve_max_tokens(
        ctx, len(prompt.token_ids), req.max_tokens, prompt_param, "max_tokens"
    )
    params = sampling_params(req, max_tokens, req.logprobs)
    return RequestSpec(
        f"{request_id}-{index}", prompt.token_ids, params, req.priority, req.cache_salt
    )


def _choice(
    ctx: ServerContext, req: CompletionRequest, prompt_index: int, prompt: Prompt, c: Any
) -> CompletionChoice:
    prefix = prompt.text if req.echo and prompt.text else ""
    logprobs = None
    if req.logprobs is not None and c.logprobs is not None:
        logprobs = completion_logprobs(ctx.tokenizer, c.logprobs, c.token_ids, len(prefix))
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
    finals = []
    for i, (prompt, stream) in enumerate(zip(prompts, streams, strict=True)):
        states: dict[int, ChoiceState] = {}
        last = None
        async with aclosing(outputs_of(ctx, stream)) as outputs:
            async for output in outputs:
                last = output
                choices = []
                for c in output.outputs:
                    state = states.setdefault(c.index, ChoiceState())
                    choice = _completion_delta(ctx, req, prompt, c, state, i * req.n)
                    if choice is not None:
                        choices.append(choice)
                if choices:
                    chunk = CompletionStreamResponse(
                        id=request_id, created=created, model=ctx.model_name, choices=choices
                    )
                    yield sse_event(chunk, exclude=exclude or None)
        finals.append(last)
    if include_usage:
        chunk = CompletionStreamResponse(
            id=request_id, created=created, model=ctx.model_name, choices=[],
            usage=usage_of(finals),
        )  # fmt: skip
        yield sse_event(chunk)


def _completion_delta(
    ctx: ServerContext,
    req: CompletionRequest,
    prompt: Prompt,
    c: Any,
    state: ChoiceState,
    index_base: int,
) -> CompletionChoice | None:
    if state.finished:
        return None
    text = c.text[state.text_len :]
    if req.echo and not state.started and prompt.text:
        text = prompt.text + text
        state.text_offset = 0
    logprobs = None
    entries = c.logprobs[state.num_logprobs :] if c.logprobs and req.logprobs is not None else []
    if entries:
        ids = c.token_ids[state.num_logprobs : state.num_logprobs + len(entries)]
        offset = state.text_offset + (
            len(prompt.text or "") if req.echo and not state.started else 0
        )
        logprobs = completion_logprobs(ctx.tokenizer, entries, ids, offset)
    new_ids = list(c.token_ids[state.num_tokens :]) if _returns_ids(ctx, req) else None
    if not text and not entries and not new_ids and not c.finish_reason:
        return None
    state.num_tokens = len(c.token_ids)
    state.started = True
    state.text_len = len(c.text)
    state.num_logprobs += len(entries)
    state.text_offset += len(text)
    state.finished = c.finish_reason is not None
    return CompletionChoice(
        index=index_base + c.index,
        text=text,
        logprobs=logprobs,
        finish_reason=c.finish_reason,
        stop_reason=c.stop_reason,
        token_ids=new_ids,
    )
