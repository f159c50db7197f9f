"""What the completions and chat endpoints share: validate, tokenize, add, follow.

Everything that can be checked before the engine is checked here (types, ranges, model
name, prompt length against ``max_model_len`` and the cache size, the queue bound), so a
bad request never reaches the engine or disturbs the others.

The engine core sends token ids; each ``RequestStream`` detokenizes them and hands out
what is new (``StreamDelta``); non-streaming answers read ``stream.output()`` at the end.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
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
    RequestSpec,
    RequestStream,
    StreamDelta,
)
from pagedllm.engine.config import DEFAULT_GRAMMAR_COMPILE_LIMIT_S
from pagedllm.engine.outputs import Logprob, RequestOutput, top_logprobs
from pagedllm.engine.structured_outputs import GrammarCompiler
from pagedllm.sampling_params import SamplingParams
from pagedllm.server.errors import APIError, bad_request, from_validation_error
from pagedllm.server.metrics import ServerMetrics
from pagedllm.server.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    PromptTokensDetails,
    SamplingFields,
    TopLogprob,
    Usage,
)
from pagedllm.server.request_log import RecentRequests
from pagedllm.server.sse import DONE, EventStreamResponse, until_disconnect
from pagedllm.server.structured import Structured, check_compiles, structured_outputs_of
from pagedllm.tool_calls.render import ToolPlan

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
    # The most tokens one request may have (``Scheduler.max_num_tokens``, asked of the core).
    max_num_tokens: int
    # ``--tool-call-parser``: how chats with tools show them and read the calls.
    tool_call_parser: str = "auto"
    # ``--grammar-compile-limit``: a grammar compiling longer is a 400.
    grammar_compile_limit_s: float = DEFAULT_GRAMMAR_COMPILE_LIMIT_S
    requests: RecentRequests = field(default_factory=RecentRequests)
    created: int = field(default_factory=lambda: int(time.time()))
    # Structured outputs' grammars, compiled here first (made for the first such request).
    grammars: GrammarCompiler | None = None

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def text_tokenizer(self, param: str) -> Any:
        """The tokenizer, for a request that gives text; a 400 naming ``param`` when the
        server runs without one (``--skip-tokenizer-init``)."""
        if self.engine.tokenizer is None:
            raise bad_request(
                "this server runs without a tokenizer (--skip-tokenizer-init): give the "
                "prompt as token ids to /v1/completions",
                param=param,
            )
        return self.engine.tokenizer


@dataclass(frozen=True, slots=True)
class Prompt:
    token_ids: list[int]
    text: str | None  # None: token ids given, decoded only if echo needs it
    tools: ToolPlan | None = None  # a chat's tools, when it or its history has some


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
    structured_outputs_of(req)  # response_format / structured_outputs well formed


async def check_structured_outputs(ctx: ServerContext, req: SamplingFields) -> None:
    """Compile the request's grammar off the event loop (cached): a 400 naming the field,
    the JSON-Schema feature and its path when the engine cannot take it."""
    await check_structured(ctx, structured_outputs_of(req))


async def check_structured(ctx: ServerContext, structured: Structured | None) -> None:
    """``check_structured_outputs`` of a constraint made elsewhere (a tool call's)."""
    if structured is None:
        return
    if ctx.grammars is None:
        tokenizer = ctx.text_tokenizer(structured.field)
        try:
            ctx.grammars = GrammarCompiler(
                tokenizer, ctx.vocab_size, time_limit_s=ctx.grammar_compile_limit_s
            )
        except ValueError as exc:
            raise bad_request(str(exc), param=structured.field) from None
    await check_compiles(ctx.grammars, structured)


def check_length(
    ctx: ServerContext,
    num_prompt: int,
    max_tokens: int | None,
    prompt_param: str,
    tokens_param: str,
) -> None:
    """A 400 naming the field when a request can never run. The limit is the core's
    (``Scheduler.max_num_tokens``); a ``max_tokens`` of None is filled in there."""
    if max_tokens is None:
        if num_prompt >= ctx.max_num_tokens:
            raise bad_request(
                f"the prompt has {num_prompt} tokens, which leaves no room to generate within "
                f"the {ctx.max_num_tokens} tokens a request may have (this model's maximum "
                f"context length is {ctx.max_model_len})",
                param=prompt_param,
                code="context_length_exceeded",
            )
        return
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
    if total > ctx.max_num_tokens:
        raise bad_request(
            f"the request needs {total} tokens ({num_prompt} in the prompt + {max_tokens} "
            f"max_tokens) but the KV cache ({ctx.num_blocks} blocks of {ctx.block_size}) "
            f"holds at most {ctx.max_num_tokens} tokens of one request",
            param=param,
            code="context_length_exceeded",
        )


def sampling_params(
    req: SamplingFields, max_tokens: int | None, logprobs: int | None
) -> SamplingParams:
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
        kwargs["logit_bias"] = req.logit_bias
    structured = structured_outputs_of(req)
    if structured is not None:
        kwargs["structured_outputs"] = structured.params
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
        ctx.metrics.request_started(spec.request_id, now, len(spec.prompt))
        ctx.requests.started(spec.request_id, spec.cache_salt)
    try:
        return await ctx.engine.add_requests(specs)
    except BaseException as exc:
        for spec in specs:
            ctx.metrics.request_discarded(spec.request_id)
            ctx.requests.discard(spec.request_id)
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


async def outputs_of(ctx: ServerContext, stream: RequestStream) -> AsyncIterator[StreamDelta]:
    """A stream's deltas; engine failures become ``APIError``; leaving aborts the request."""
    reason = "abort"
    try:
        async for delta in stream:
            if delta.error is not None or any(c.finish_reason == "error" for c in delta.choices):
                reason = "error"
                detail = delta.error or "internal error"
                raise APIError(
                    500, f"request {stream.request_id} failed: {detail}", code="engine_error"
                )
            if delta.finished:
                output = stream.output()
                reason = _finish_reason(output)
                _record(ctx, stream.request_id, output)
            yield delta
    except EngineClosedError as exc:
        raise APIError(503, str(exc), code="engine_unavailable") from None
    finally:
        stream.abort()
        ctx.metrics.request_ended(stream.request_id, reason)
        ctx.requests.discard(stream.request_id)


def _record(ctx: ServerContext, request_id: str, output: RequestOutput) -> None:
    """Note a finished request for ``/v1/cache/advice`` (the generated tokens too when
    there is one sample: the engine caches their blocks)."""
    outputs = output.outputs
    ctx.requests.finished(
        request_id,
        output.prompt_token_ids,
        output.num_cached_tokens or 0,
        outputs[0].token_ids if len(outputs) == 1 else (),
    )


async def final_output(ctx: ServerContext, stream: RequestStream) -> RequestOutput:
    async with aclosing(outputs_of(ctx, stream)) as deltas:
        async for _ in deltas:
            pass
    output = stream.output()
    if not output.finished:
        raise APIError(503, f"request {stream.request_id} ended unfinished", code="aborted")
    return output


async def final_outputs(ctx: ServerContext, streams: Sequence[RequestStream]) -> list[Any]:
    try:
        return [await final_output(ctx, s) for s in streams]
    finally:
        close_streams(ctx, streams)


def close_streams(ctx: ServerContext, streams: Sequence[RequestStream]) -> None:
    """Abort what is still running and close the metrics of every stream (idempotent)."""
    for stream in streams:
        stream.abort()
        ctx.metrics.request_ended(stream.request_id, "abort")


async def respond(
    ctx: ServerContext,
    request: Request,
    request_id: str,
    specs: Sequence[RequestSpec],
    stream: bool,
    body: Callable[[list[Any], int], BaseModel],
    events: Callable[[list[RequestStream], int], AsyncGenerator[bytes, None]],
    headers: dict[str, str] | None = None,
) -> Response:
    """Add the requests, then answer with ``body(final outputs, created)`` as JSON once
    all have finished, or (``stream``) with ``events(streams, created)`` as Server-Sent
    Events, with ``headers`` either way; 499 if the client leaves first."""
    streams = await add_streams(ctx, specs)
    created = int(time.time())
    if stream:
        response: Response = EventStreamResponse(
            event_stream(request_id, streams, events(streams, created)),
            on_close=lambda: close_streams(ctx, streams),
        )
        response.headers.update(headers or {})
        return response
    done, outputs = await until_disconnect(request.receive, lambda: final_outputs(ctx, streams))
    if not done:
        return Response(status_code=499)  # nobody is listening any more
    return JSONResponse(body(outputs, created).model_dump(mode="json"), headers=headers)


async def event_stream(
    request_id: str, streams: Sequence[RequestStream], events: AsyncGenerator[bytes, None]
) -> AsyncIterator[bytes]:
    """``events`` then ``[DONE]``; a failure ends it with an OpenAI error event, and the
    requests are aborted however it ends."""
    try:
        async with aclosing(events):
            async for event in events:
                yield event
    except APIError as exc:
        yield exc.sse_event()
    except Exception as exc:  # a bug must still end the stream in the OpenAI shape
        yield internal_error_event(request_id, exc)
    finally:
        for stream in streams:
            stream.abort()
    yield DONE


def _finish_reason(output: Any) -> str:
    reasons = [c.finish_reason for c in output.outputs if c.finish_reason]
    return reasons[0] if reasons else "stop"


def usage_of(outputs: Sequence[Any]) -> Usage:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(int(o.num_cached_tokens or 0) for o in outputs)
    one = outputs[0] if len(outputs) == 1 else None
    details = PromptTokensDetails(
        cached_tokens=cached,
        cache_event_seq=one.cache_event_seq if one else None,
        arrival_event_seq=one.arrival_event_seq if one else None,
    )
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=details,
    )


def internal_error_event(request_id: str, exc: Exception) -> bytes:
    """The SSE error event for an unexpected failure after a stream started (logged)."""
    logger.exception("stream %s failed", request_id, exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}").sse_event()


def new_id(prefix: str, request: Request) -> str:
    """``prefix-`` + the client's ``X-Request-Id`` header (as vLLM does) or a random id."""
    given = request.headers.get("x-request-id", "")
    if not (0 < len(given) <= 128 and given.isprintable()):
        given = uuid.uuid4().hex
    return f"{prefix}-{given}"


# ---------------------------------------------------------------- logprobs


def _scored_tokens(
    tokenizer: Any,
    positions: Sequence[dict[int, Logprob] | None],
    token_ids: Sequence[int],
    num_top: int,
) -> list[tuple[str, float | None, list[tuple[str, float]] | None]]:
    """Per token: its text, its logprob and the ``num_top`` most likely tokens as (text,
    logprob), most likely first; a None position (a prompt's first token) gives (text,
    None, None)."""
    scored: list[tuple[str, float | None, list[tuple[str, float]] | None]] = []
    for token_id, position in zip(token_ids, positions, strict=True):
        if position is None:
            scored.append((token_text(tokenizer, token_id), None, None))
            continue
        top = top_logprobs(position, token_id, num_top)
        actual = position[token_id]
        scored.append(
            (
                _listed_text(tokenizer, token_id, actual),
                actual.logprob,
                [(_listed_text(tokenizer, t, lp), lp.logprob) for t, lp in top],
            )
        )
    return scored


def _listed_text(tokenizer: Any, token_id: int, logprob: Logprob) -> str:
    return (
        token_text(tokenizer, token_id) if logprob.decoded_token is None else logprob.decoded_token
    )


def token_text(tokenizer: Any, token_id: int) -> str:
    """One token as text; ``token_id:N`` without a tokenizer (as vLLM spells it)."""
    return f"token_id:{token_id}" if tokenizer is None else tokenizer.decode([token_id])


def completion_logprobs(
    tokenizer: Any,
    positions: Sequence[dict[int, Logprob] | None],
    token_ids: Sequence[int],
    num_top: int,
    offset: int,
) -> CompletionLogprobs:
    """The legacy parallel lists; None positions (an echoed prompt's first token) give
    nulls, as vLLM's echo does."""
    result = CompletionLogprobs()
    for text, logprob, top in _scored_tokens(tokenizer, positions, token_ids, num_top):
        result.tokens.append(text)
        result.token_logprobs.append(logprob)
        result.top_logprobs.append(None if top is None else dict(top))
        result.text_offset.append(offset)
        offset += len(text)
    return result


def echo_logprobs(
    tokenizer: Any,
    prompt_token_ids: Sequence[int],
    prompt_logprobs: Sequence[dict[int, Logprob] | None],
    num_top: int,
    generated: CompletionLogprobs | None,
) -> CompletionLogprobs:
    """An echoed completion's logprobs: the prompt's tokens (offsets from 0, the first
    null) followed by ``generated``'s."""
    result = completion_logprobs(tokenizer, prompt_logprobs, prompt_token_ids, num_top, 0)
    if generated is not None:
        result.tokens += generated.tokens
        result.token_logprobs += generated.token_logprobs
        result.top_logprobs += generated.top_logprobs
        result.text_offset += generated.text_offset
    return result


def chat_logprobs(
    tokenizer: Any, positions: Sequence[dict[int, Logprob]], token_ids: Sequence[int], num_top: int
) -> ChatLogprobs:
    content = []
    for text, logprob, top in _scored_tokens(tokenizer, positions, token_ids, num_top):
        alternatives = [
            TopLogprob(token=alt, logprob=lp, bytes=list(alt.encode())) for alt, lp in top or ()
        ]
        content.append(
            ChatTokenLogprob(
                token=text, logprob=logprob, bytes=list(text.encode()), top_logprobs=alternatives
            )
        )
    return ChatLogprobs(content=content)
