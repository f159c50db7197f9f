"""The completions and chat completions endpoints: validate, tokenize, add, stream.

Everything that can be checked before the engine is checked here (types, ranges, model
name, prompt length against ``max_model_len`` and the cache size, the queue bound), so a
bad request never reaches the engine or disturbs the others.

Engine outputs are cumulative; a stream keeps, per choice, how much text and how many
logprobs it has sent and emits only what is new.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedllm.engine.async_engine import (
    AsyncEngine,
    EngineClosedError,
    QueueFullError,
    RequestFailedError,
    RequestSpec,
    RequestStream,
)
from pagedllm.sampling_params import SamplingParams
from pagedllm.server.errors import APIError, bad_request, from_validation_error
from pagedllm.server.metrics import ServerMetrics
from pagedllm.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatLogprobs,
    ChatStreamChoice,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    DeltaMessage,
    PromptTokensDetails,
    SamplingFields,
    TopLogprob,
    Usage,
)
from pagedllm.server.sse import DONE, EventStreamResponse, sse_event, until_disconnect

M = TypeVar("M", bound=BaseModel)
logger = logging.getLogger(__name__)

RETRY_AFTER_SECONDS = 1


@dataclass(slots=True)
class ServerContext:
    """What the endpoints of one app share (built by ``create_app``)."""

    engine: AsyncEngine
    metrics: ServerMetrics
    model_name: str
    model_aliases: frozenset[str]
    max_model_len: int
    vocab_size: int
    block_size: int
    num_blocks: int
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def cache_tokens(self) -> int:
        return self.num_blocks * self.block_size


@dataclass(frozen=True, slots=True)
class Prompt:
    token_ids: list[int]
    text: str | None  # None: token ids given, decoded only if echo needs it


@dataclass(slots=True)
class _ChoiceState:
    text_len: int = 0
    num_logprobs: int = 0
    text_offset: int = 0
    started: bool = False
    finished: bool = False


# ---------------------------------------------------------------- shared steps


def parse_body(model: type[M], body: bytes) -> M:
    """Validate a JSON body strictly; a 400 naming the field otherwise."""
    try:
        return model.model_validate_json(body, strict=True)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def check_model(ctx: ServerContext, name: str | None) -> None:
    if name is not None and name not in ctx.model_aliases:
        raise APIError(
            400,
            f"the model {name!r} does not exist; this server serves {ctx.model_name!r}",
            param="model",
            code="model_not_found",
        )


def check_common(req: SamplingFields) -> None:
    kind = (req.response_format or {}).get("type", "text")
    if kind != "text":
        raise bad_request(
            f"response_format {kind!r} is not supported (only 'text')", param="response_format"
        )
    if req.logit_bias:
        for key in req.logit_bias:
            if not key.lstrip("-").isdigit():
                raise bad_request(
                    f"logit_bias keys must be token ids, got {key!r}", param="logit_bias"
                )


def check_length(
    ctx: ServerContext, num_prompt: int, max_tokens: int, prompt_param: str, tokens_param: str
) -> None:
    """A 400 naming both numbers when a request can never run."""
    total = num_prompt + max_tokens
    param = prompt_param if num_prompt >= ctx.max_model_len else tokens_param
    if total > ctx.max_model_len:
        raise bad_request(
            f"this model's maximum context length is {ctx.max_model_len} tokens, but the "
            f"request needs {total} tokens ({num_prompt} in the prompt + {max_tokens} "
            f"max_tokens); shorten the prompt or lower max_tokens",
            param=param,
            code="context_length_exceeded",
        )
    if total > ctx.cache_tokens:
        raise bad_request(
            f"the request needs {total} tokens of KV cache ({num_prompt} in the prompt + "
            f"{max_tokens} max_tokens) but the whole cache holds {ctx.cache_tokens} tokens "
            f"({ctx.num_blocks} blocks of {ctx.block_size})",
            param=param,
            code="context_length_exceeded",
        )


def resolve_max_tokens(
    ctx: ServerContext,
    num_prompt: int,
    max_tokens: int | None,
    prompt_param: str,
    tokens_param: str,
) -> int:
    """``max_tokens`` as asked, or (when None) all the room the prompt leaves."""
    if max_tokens is None:
        limit = min(ctx.max_model_len, ctx.cache_tokens)
        if num_prompt >= limit:
            raise bad_request(
                f"the prompt has {num_prompt} tokens, which leaves no room to generate within "
                f"this model's maximum context length of {limit} tokens",
                param=prompt_param,
                code="context_length_exceeded",
            )
        return limit - num_prompt
    check_length(ctx, num_prompt, max_tokens, prompt_param, tokens_param)
    return max_tokens


def sampling_params(req: SamplingFields, max_tokens: int, logprobs: int | None) -> SamplingParams:
    """SamplingParams from the request (only the fields the client set, plus the fills)."""
    kwargs: dict[str, Any] = {"n": req.n, "max_tokens": max_tokens, "logprobs": logprobs}
    for name in (
        "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
        "frequency_penalty", "repetition_penalty",
    ):  # fmt: skip
        value = getattr(req, name)
        if value is not None:
            kwargs[name] = value
    if req.stop is not None:
        kwargs["stop"] = req.stop
    if req.stop_token_ids is not None:
        kwargs["stop_token_ids"] = req.stop_token_ids
    if req.logit_bias:
        kwargs["logit_bias"] = {int(k): v for k, v in req.logit_bias.items()}
    kwargs.update(
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
        skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
    )
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as exc:
        message = str(exc)
        param = message.split(" ", 1)[0]
        raise bad_request(message, param=param if param in kwargs else None) from None


async def add_streams(ctx: ServerContext, specs: Sequence[RequestSpec]) -> list[RequestStream]:
    """Hand the requests to the engine, mapping its refusals to HTTP errors."""
    now = time.monotonic()
    for spec in specs:  # before adding: the first output may arrive before add returns
        ctx.metrics.request_started(spec.request_id, now)
    try:
        return await ctx.engine.add_requests(specs)
    except BaseException as exc:
        for spec in specs:
            ctx.metrics.request_discarded(spec.request_id)
        raise _refusal(exc) from None


def _refusal(exc: BaseException) -> BaseException:
    """The HTTP error for an engine's refusal to take requests."""
    if isinstance(exc, QueueFullError):
        headers = {"Retry-After": str(RETRY_AFTER_SECONDS)}
        return APIError(429, str(exc), code="queue_full", headers=headers)
    if isinstance(exc, EngineClosedError):
        return APIError(503, str(exc), code="engine_unavailable")
    if isinstance(exc, ValueError | TypeError):
        return bad_request(str(exc))
    return exc


async def outputs_of(ctx: ServerContext, stream: RequestStream) -> AsyncIterator[Any]:
    """A stream's outputs; engine failures become ``APIError``; leaving aborts the request."""
    reason = "abort"
    try:
        async for output in stream:
            failed = [c for c in output.outputs if c.finish_reason == "error"]
            if failed:
                reason = "error"
                detail = getattr(output, "error", None) or "internal error"
                raise APIError(
                    500, f"request {stream.request_id} failed: {detail}", code="engine_error"
                )
            if output.finished:
                reason = _finish_reason(output)
            yield output
    except RequestFailedError as exc:
        reason = "error"
        raise APIError(500, str(exc), code="engine_error") from None
    except EngineClosedError as exc:
        raise APIError(503, str(exc), code="engine_unavailable") from None
    finally:
        stream.abort()
        ctx.metrics.request_ended(stream.request_id, reason)


async def final_output(ctx: ServerContext, stream: RequestStream) -> Any:
    last = None
    async with aclosing(outputs_of(ctx, stream)) as outputs:
        async for output in outputs:
            last = output
    if last is None or not last.finished:
        raise APIError(503, f"request {stream.request_id} ended unfinished", code="aborted")
    return last


async def final_outputs(ctx: ServerContext, streams: Sequence[RequestStream]) -> list[Any]:
    try:
        return [await final_output(ctx, s) for s in streams]
    finally:
        for stream in streams:
            stream.abort()


def _finish_reason(output: Any) -> str:
    reasons = [c.finish_reason for c in output.outputs if c.finish_reason]
    return reasons[0] if reasons else "stop"


def usage_of(outputs: Sequence[Any]) -> Usage:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(int(o.num_cached_tokens or 0) for o in outputs)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def new_id(prefix: str, request: Request) -> str:
    """``prefix-`` + the client's ``X-Request-Id`` header (as vLLM does) or a random id."""
    given = request.headers.get("x-request-id", "")
    if not (0 < len(given) <= 128 and given.isprintable()):
        given = uuid.uuid4().hex
    return f"{prefix}-{given}"


# ---------------------------------------------------------------- logprobs


def _logprob_triples(
    entries: Sequence[Any], token_ids: Sequence[int]
) -> list[tuple[int, float, list[tuple[int, float]]]]:
    """(token id, logprob, top alternatives) from ``TokenLogprob``s or vLLM-style dicts."""
    triples = []
    for i, entry in enumerate(entries):
        if isinstance(entry, dict):
            token_id = token_ids[i]
            values = {k: float(getattr(v, "logprob", v)) for k, v in entry.items()}
            top = sorted(values.items(), key=lambda kv: -kv[1])
            triples.append((token_id, values.get(token_id, float("-inf")), top))
        else:
            top = list(zip(entry.top_token_ids, entry.top_logprobs, strict=False))
            triples.append((entry.token_id, float(entry.logprob), top))
    return triples


def completion_logprobs(
    tokenizer: Any, entries: Sequence[Any], token_ids: Sequence[int], offset: int
) -> CompletionLogprobs:
    result = CompletionLogprobs()
    for token_id, logprob, top in _logprob_triples(entries, token_ids):
        text = tokenizer.decode([token_id])
        result.tokens.append(text)
        result.token_logprobs.append(logprob)
        result.top_logprobs.append({tokenizer.decode([t]): lp for t, lp in top})
        result.text_offset.append(offset)
        offset += len(text)
    return result


def chat_logprobs(tokenizer: Any, entries: Sequence[Any], token_ids: Sequence[int]) -> ChatLogprobs:
    content = []
    for token_id, logprob, top in _logprob_triples(entries, token_ids):
        text = tokenizer.decode([token_id])
        alternatives = []
        for t, lp in top:
            alt = tokenizer.decode([t])
            alternatives.append(TopLogprob(token=alt, logprob=lp, bytes=list(alt.encode())))
        content.append(
            ChatTokenLogprob(
                token=text, logprob=logprob, bytes=list(text.encode()), top_logprobs=alternatives
            )
        )
    return ChatLogprobs(content=content)


# ---------------------------------------------------------------- /v1/completions


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
            token_ids = list(ctx.tokenizer.encode(item))
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
    check_model(ctx, req.model)
    check_common(req)
    if req.suffix:
        raise bad_request("suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of different from n is not supported", param="best_of")
    prompts = completion_prompts(ctx, req.prompt)
    request_id = new_id("cmpl", request)
    specs = []
    for i, prompt in enumerate(prompts):
        prompt_param = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        max_tokens = resolve_max_tokens(
            ctx, len(prompt.token_ids), req.max_tokens, prompt_param, "max_tokens"
        )
        params = sampling_params(req, max_tokens, req.logprobs)
        specs.append(
            RequestSpec(f"{request_id}-{i}", prompt.token_ids, params, req.priority, req.cache_salt)
        )
    if req.echo:
        prompts = [
            p if p.text is not None else Prompt(p.token_ids, _decode(ctx, p)) for p in prompts
        ]
    streams = await add_streams(ctx, specs)
    created = int(time.time())
    if req.stream:
        return EventStreamResponse(
            completion_events(ctx, req, request_id, created, prompts, streams)
        )
    done, outputs = await until_disconnect(request.receive, lambda: final_outputs(ctx, streams))
    if not done:
        return Response(status_code=499)
    choices = []
    for i, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        for c in sorted(output.outputs, key=lambda c: c.index):
            prefix = prompt.text if req.echo and prompt.text else ""
            logprobs = None
            if req.logprobs is not None and c.logprobs is not None:
                logprobs = completion_logprobs(ctx.tokenizer, c.logprobs, c.token_ids, len(prefix))
            choices.append(
                CompletionChoice(
                    index=i * req.n + c.index,
                    text=prefix + c.text,
                    logprobs=logprobs,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
            )
    body = CompletionResponse(
        id=request_id, created=created, model=ctx.model_name, choices=choices,
        usage=usage_of(outputs),
    )  # fmt: skip
    return JSONResponse(body.model_dump(mode="json"))


def _decode(ctx: ServerContext, prompt: Prompt) -> str:
    return ctx.tokenizer.decode(prompt.token_ids)


async def completion_events(
    ctx: ServerContext,
    req: CompletionRequest,
    request_id: str,
    created: int,
    prompts: Sequence[Prompt],
    streams: Sequence[RequestStream],
) -> AsyncIterator[bytes]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    exclude = None if include_usage else {"usage"}
    finals = []
    try:
        for i, (prompt, stream) in enumerate(zip(prompts, streams, strict=True)):
            states: dict[int, _ChoiceState] = {}
            last = None
            async with aclosing(outputs_of(ctx, stream)) as outputs:
                async for output in outputs:
                    last = output
                    choices = []
                    for c in output.outputs:
                        state = states.setdefault(c.index, _ChoiceState())
                        choice = _completion_delta(ctx, req, prompt, c, state, i * req.n)
                        if choice is not None:
                            choices.append(choice)
                    if choices:
                        chunk = CompletionStreamResponse(
                            id=request_id, created=created, model=ctx.model_name, choices=choices
                        )
                        yield sse_event(chunk, exclude=exclude)
            finals.append(last)
        if include_usage:
            chunk = CompletionStreamResponse(
                id=request_id, created=created, model=ctx.model_name, choices=[],
                usage=usage_of(finals),
            )  # fmt: skip
            yield sse_event(chunk)
    except APIError as exc:
        yield exc.sse_event()
    except Exception as exc:  # a bug must still end the stream in the OpenAI shape
        logger.exception("stream %s failed", request_id)
        yield APIError(500, f"internal error: {type(exc).__name__}: {exc}").sse_event()
    finally:
        for stream in streams:
            stream.abort()
    yield DONE


def _completion_delta(
    ctx: ServerContext,
    req: CompletionRequest,
    prompt: Prompt,
    c: Any,
    state: _ChoiceState,
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
    if not text and not entries and not c.finish_reason:
        return None
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
    )


# ---------------------------------------------------------------- /v1/chat/completions


def chat_prompt(ctx: ServerContext, req: ChatCompletionRequest) -> Prompt:
    """The messages through the tokenizer's chat template."""
    tokenizer = ctx.tokenizer
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
    check_model(ctx, req.model)
    check_common(req)
    if req.tools:
        raise bad_request("tools are not supported", param="tools")
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs to be true", param="top_logprobs")
    prompt = chat_prompt(ctx, req)
    asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = resolve_max_tokens(ctx, len(prompt.token_ids), asked, "messages", param)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = sampling_params(req, max_tokens, logprobs)
    request_id = new_id("chatcmpl", request)
    spec = RequestSpec(f"{request_id}-0", prompt.token_ids, params, req.priority, req.cache_salt)
    streams = await add_streams(ctx, [spec])
    created = int(time.time())
    if req.stream:
        return EventStreamResponse(chat_events(ctx, req, request_id, created, streams[0]))
    done, outputs = await until_disconnect(request.receive, lambda: final_outputs(ctx, streams))
    if not done:
        return Response(status_code=499)
    output = outputs[0]
    choices = []
    for c in sorted(output.outputs, key=lambda c: c.index):
        logprobs_body = None
        if req.logprobs and c.logprobs is not None:
            logprobs_body = chat_logprobs(ctx.tokenizer, c.logprobs, c.token_ids)
        choices.append(
            ChatChoice(
                index=c.index,
                message=AssistantMessage(content=c.text),
                logprobs=logprobs_body,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
        )
    body = ChatCompletionResponse(
        id=request_id, created=created, model=ctx.model_name, choices=choices,
        usage=usage_of(outputs),
    )  # fmt: skip
    return JSONResponse(body.model_dump(mode="json"))


async def chat_events(
    ctx: ServerContext,
    req: ChatCompletionRequest,
    request_id: str,
    created: int,
    stream: RequestStream,
) -> AsyncIterator[bytes]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    exclude = None if include_usage else {"usage"}

    def chunk(choices: list[ChatStreamChoice], usage: Usage | None = None) -> bytes:
        body = ChatCompletionStreamResponse(
            id=request_id, created=created, model=ctx.model_name, choices=choices, usage=usage
        )
        return sse_event(body, exclude=exclude)

    states: dict[int, _ChoiceState] = {}
    last = None
    try:
        async with aclosing(outputs_of(ctx, stream)) as outputs:
            async for output in outputs:
                last = output
                for c in sorted(output.outputs, key=lambda c: c.index):
                    state = states.setdefault(c.index, _ChoiceState())
                    if not state.started:
                        state.started = True
                        role = DeltaMessage(role="assistant", content="")
                        yield chunk([ChatStreamChoice(index=c.index, delta=role)])
                    choice = _chat_delta(ctx, req, c, state)
                    if choice is not None:
                        yield chunk([choice])
        if include_usage and last is not None:
            yield chunk([], usage_of([last]))
    except APIError as exc:
        yield exc.sse_event()
    except Exception as exc:  # a bug must still end the stream in the OpenAI shape
        logger.exception("stream %s failed", request_id)
        yield APIError(500, f"internal error: {type(exc).__name__}: {exc}").sse_event()
    finally:
        stream.abort()
    yield DONE


def _chat_delta(
    ctx: ServerContext, req: ChatCompletionRequest, c: Any, state: _ChoiceState
) -> ChatStreamChoice | None:
    if state.finished:
        return None
    text = c.text[state.text_len :]
    entries = c.logprobs[state.num_logprobs :] if c.logprobs and req.logprobs else []
    if not text and not entries and not c.finish_reason:
        return None
    logprobs = None
    if entries:
        ids = c.token_ids[state.num_logprobs : state.num_logprobs + len(entries)]
        logprobs = chat_logprobs(ctx.tokenizer, entries, ids)
    state.text_len = len(c.text)
    state.num_logprobs += len(entries)
    state.finished = c.finish_reason is not None
    return ChatStreamChoice(
        index=c.index,
        delta=DeltaMessage(content=text) if text else DeltaMessage(),
        logprobs=logprobs,
        finish_reason=c.finish_reason,
        stop_reason=c.stop_reason,
    )
