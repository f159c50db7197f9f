"""The FastAPI app factory: OpenAI routes, /health, /metrics, /v1/cache, /dashboard,
/v1/cache/resize (``server/elastic.py``).

``create_app`` builds everything one app needs (async engine, metrics registry, routes)
and keeps it on ``app.state``; nothing lives at module level, so tests build as many
apps as they like in one process.

The engine core runs in a process of its own (``AsyncEngine.launch``, what ``pagedllm
serve`` does) or, when the app is built around an ``LLMEngine`` object, in a thread
(``AsyncEngine.in_thread``); the app talks to both the same way. It starts reading the
core's messages on first use (``httpx.ASGITransport`` sends no lifespan events) and stops
the core on lifespan shutdown: under uvicorn, SIGTERM stops accepting connections, lets
in-flight requests finish (``timeout_graceful_shutdown``), then aborts what is left and
stops the core.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import FastAPI, Query
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import FiniteFloat
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedllm.engine.async_engine import AsyncEngine, EngineClosedError
from pagedllm.model.tokenizer import DecodeOnlyTokenizer
from pagedllm.planner.cache_report import advice_for_log
from pagedllm.planner.cachelog import CacheLog
from pagedllm.server.cache_events import CacheEventFeed
from pagedllm.server.chat import create_chat_completion
from pagedllm.server.completions import create_completion
from pagedllm.server.dashboard import DASHBOARD_PATH, add_dashboard_routes
from pagedllm.server.elastic import add_elastic_routes
from pagedllm.server.errors import (
    APIError,
    bad_request,
    document_bad_requests,
    from_validation_error,
)
from pagedllm.server.metrics import ServerMetrics
from pagedllm.server.protocol import (
    REQUEST_BODIES,
    ChatCompletionRequest,
    CompletionRequest,
    Count,
    ModelCard,
    ModelList,
    Positive,
    body_schema,
)
from pagedllm.server.request_log import DEFAULT_MAX_RECORDS, RecentRequests
from pagedllm.server.serving import ServerContext
from pagedllm.server.sse import EventStreamResponse

logger = logging.getLogger(__name__)

DEFAULT_MAX_QUEUED_REQUESTS = 256
# The dashboard page is public; the JSON it polls needs the key (see server/dashboard.py).
PUBLIC_PATHS = frozenset({"/health", DASHBOARD_PATH})
# Seconds of silence before an events stream sends a keep-alive.
# Under 10 ms a stream would only spin sending heartbeats.
Heartbeat = Annotated[FiniteFloat, Query(ge=0.01, le=60)]


class BearerAuth:
    """Pure ASGI middleware: every path but /health and /dashboard (the page; its JSON
    is not public) needs ``Authorization: Bearer KEY``."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        error = APIError(
            401, "missing or invalid API key (Authorization: Bearer ...)", code="invalid_api_key"
        )
        await error.response()(scope, receive, send)

    def _allowed(self, scope: Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                return hmac.compare_digest(value, self.expected)
        return False


def create_app(
    engine: Any,
    *,
    api_key: str | None = None,
    max_queued_requests: int | None = DEFAULT_MAX_QUEUED_REQUESTS,
    served_model_name: str | None = None,
    shutdown_drain_timeout: float = 0.0,
    request_log: str | None = None,
    max_logged_requests: int = DEFAULT_MAX_RECORDS,
) -> FastAPI:
    """Build the OpenAI-compatible app around an ``AsyncEngine`` or an ``LLMEngine``.

    An ``LLMEngine`` gets a new ``AsyncEngine.in_thread`` bounded by
    ``max_queued_requests``; an ``AsyncEngine`` is used as given (with its own bound).
    ``served_model_name`` is the name clients send as ``model`` (default: the engine's
    model name). With ``api_key``, every route but /health and the /dashboard page
    requires it. The last ``max_logged_requests`` finished requests feed
    ``/v1/cache/advice``; ``request_log`` (a path) also appends each to a JSONL file.
    """
    if isinstance(engine, AsyncEngine):
        async_engine = engine
    else:
        async_engine = AsyncEngine.in_thread(engine, max_queued_requests=max_queued_requests)
    ctx = _build_context(async_engine, served_model_name)
    ctx.requests = RecentRequests(max_logged_requests, request_log)
    async_engine.add_listener(ctx.metrics.on_outputs)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        yield
        await async_engine.shutdown(drain_timeout=shutdown_drain_timeout)
        ctx.requests.close()

    app = FastAPI(title="pagedllm", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.ctx = ctx
    app.state.engine = async_engine
    _add_routes(app, ctx)
    _add_error_handlers(app, ctx)
    _document_bodies(app)
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)
    return app


def _build_context(engine: AsyncEngine, served_model_name: str | None) -> ServerContext:
    info = engine.info
    name = served_model_name or info.model_name
    return ServerContext(
        engine=engine,
        metrics=ServerMetrics(),
        model_name=name,
        model_aliases=frozenset({name, info.model_name, info.model}),
        max_model_len=info.max_model_len,
        vocab_size=info.vocab_size,
        block_size=info.block_size,
        num_blocks=info.num_blocks,
        max_num_tokens=info.max_num_tokens,
        tool_call_parser=info.tool_call_parser,
        grammar_compile_limit_s=info.grammar_compile_limit_s,
    )


def _add_routes(app: FastAPI, ctx: ServerContext) -> None:
    @app.get("/health")
    async def health() -> Response:
        if ctx.engine.is_running:
            return JSONResponse({"status": "ok"})
        reason = ctx.engine.dead_reason or "the server is shutting down"
        message = f"the engine is not running: {reason}"
        return APIError(503, message, code="engine_unavailable").response()

    @app.get("/v1/models")
    async def models() -> Response:
        card = ModelCard(id=ctx.model_name, created=ctx.created, max_model_len=ctx.max_model_len)
        return JSONResponse(ModelList(data=[card]).model_dump(mode="json"))

    @app.post("/v1/completions", openapi_extra=body_schema(CompletionRequest))
    async def completions(request: Request) -> Response:
        return await create_completion(ctx, request)

    @app.post("/v1/chat/completions", openapi_extra=body_schema(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        return await create_chat_completion(ctx, request)

    async def report() -> dict[str, Any]:
        result = await ctx.engine.cache_report()
        result["server"] = {"in_flight": ctx.engine.num_in_flight, "queued": ctx.engine.num_queued}
        return result

    @app.get("/v1/cache")
    async def cache() -> Response:
        return JSONResponse(await report())

    @app.get("/v1/cache/events")
    async def cache_events(since: Count = 0, epoch: str | None = None) -> Response:
        # A router's feed (server/cache_events.py), read in the core between two steps.
        body = await ctx.engine.events_report(epoch, since)
        return JSONResponse(body)

    feed = CacheEventFeed(ctx.engine)

    @app.get("/v1/cache/events/stream")
    async def cache_events_stream(
        since: Count = 0, epoch: str | None = None, heartbeat: Heartbeat = 1.0
    ) -> Response:
        # The same feed, pushed as the core logs it (server/cache_events.py).
        return EventStreamResponse(feed.stream(epoch, since, heartbeat))

    @app.get("/v1/cache/advice")
    async def cache_advice(limit: Positive | None = None) -> Response:
        log = ctx.requests.to_log(limit)
        if not len(log):
            raise bad_request("no finished requests yet: send some, then ask again")
        # The advisor replays the log through a KVCacheManager: off the event loop.
        body = await asyncio.to_thread(_advice, ctx, log)
        return JSONResponse(body)

    @app.get("/metrics")
    async def metrics() -> Response:
        body = ctx.metrics.render(await report())
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    add_dashboard_routes(app, ctx)
    add_elastic_routes(app, ctx)


def _document_bodies(app: FastAPI) -> None:
    """Add the bodies the routes read themselves (``REQUEST_BODIES``) to the OpenAPI
    document's components, where their ``openapi_extra`` points."""
    plain = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = plain()
            _, defs = models_json_schema(
                [(model, "validation") for model in REQUEST_BODIES],
                ref_template="#/components/schemas/{model}",
            )
            schema.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
            document_bad_requests(schema)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _advice(ctx: ServerContext, log: CacheLog) -> dict[str, Any]:
    """``pagedllm cache-report`` over the server's recent requests, with its own block size,
    number of blocks and tokenizer's vocabulary (no fast tokenizer: no divergence text)."""
    tokenizer = None
    if ctx.tokenizer is not None:
        # Not the server's own object: its encodes borrow it mutably on the event loop.
        fast = getattr(ctx.tokenizer, "is_fast", False)
        tokenizer = DecodeOnlyTokenizer(ctx.tokenizer) if fast else None
    return advice_for_log(
        log,
        tokenizer,
        block_size=ctx.block_size,
        num_blocks=ctx.num_blocks,
        model=ctx.model_name,
        source="recent requests",
    )


def _add_error_handlers(app: FastAPI, ctx: ServerContext) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        ctx.metrics.rejected.labels(str(exc.status)).inc()
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def bad_query(request: Request, exc: RequestValidationError) -> Response:
        return await api_error(request, from_validation_error(exc))

    @app.exception_handler(EngineClosedError)
    async def engine_closed(request: Request, exc: EngineClosedError) -> Response:
        return APIError(503, str(exc), code="engine_unavailable").response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return APIError(exc.status_code, str(exc.detail), headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error in %s", request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}").response()
