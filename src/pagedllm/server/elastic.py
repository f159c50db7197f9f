"""``POST /v1/cache/resize``: the elastic KV pool over HTTP.

``{"kv_cache_memory": "2GiB", "preempt": false}`` starts a resize in the engine core
(``AsyncEngine.start_resize``: a shrink compacts in slices between steps, so running
requests keep generating) and answers with its report once it is done, polled with
``AsyncEngine.resize_report``. Behind ``--api-key`` like every
route but /health.
"""

from __future__ import annotations

import asyncio

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedllm.server.errors import bad_request
from pagedllm.server.protocol import CacheResizeRequest, body_schema
from pagedllm.server.serving import ServerContext, parse_body

# How often the route asks the core whether the resize is done.
POLL_S = 0.01


def add_elastic_routes(app: FastAPI, ctx: ServerContext) -> None:
    @app.post("/v1/cache/resize", openapi_extra=body_schema(CacheResizeRequest))
    async def resize(request: Request) -> Response:
        body = parse_body(CacheResizeRequest, await request.body())
        try:
            num_bytes = body.kv_cache_memory  # bytes by now (protocol.ByteSize)
            resize_id = await ctx.engine.start_resize(num_bytes, body.preempt)
        except (ValueError, TypeError) as exc:
            raise bad_request(str(exc), param="kv_cache_memory") from None
        while (report := await ctx.engine.resize_report(resize_id)) is None:
            await asyncio.sleep(POLL_S)
        # Requests are checked against the cache's size before they reach the engine.
        ctx.num_blocks = await ctx.engine.cache_capacity_blocks()
        ctx.max_num_tokens = await ctx.engine.max_num_tokens()
        return JSONResponse(report.to_dict())
