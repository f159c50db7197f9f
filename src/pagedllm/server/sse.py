"""Server-Sent Events and client-disconnect handling.

A stream is ``data: <json>\\n\\n`` events ending with ``data: [DONE]\\n\\n`` (the framing the
``openai`` client and vLLM's benchmark client parse). While the response runs, a watcher
reads the ASGI ``receive`` channel; when the client goes away it cancels the response, and
closing the event generator aborts the request, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from pydantic import BaseModel
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

T = TypeVar("T")

DONE = b"data: [DONE]\n\n"


# Characters that JSON leaves raw but line readers split on (Python's str.splitlines, hence
# httpx's aiter_lines): a token holding one would cut its event in two. They can stand only
# inside JSON strings, where their escapes mean the same.
LINE_BREAKS_IN_JSON = (
    (b"\xe2\x80\xa8", b"\\u2028"),
    (b"\xe2\x80\xa9", b"\\u2029"),
    (b"\xc2\x85", b"\\u0085"),
)


def sse_event(payload: BaseModel, *, exclude: set[str] | dict[str, Any] | None = None) -> bytes:
    """One SSE event carrying ``payload`` as compact JSON, on one line for any line reader."""
    data = payload.model_dump_json(exclude=exclude).encode()
    for raw, escaped in LINE_BREAKS_IN_JSON:
        if raw in data:
            data = data.replace(raw, escaped)
    return b"data: " + data + b"\n\n"


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class EventStreamResponse(Response):
    """A ``text/event-stream`` response that stops, and closes its source, on disconnect."""

    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncIterator[bytes],
        *,
        on_close: Callable[[], None] | None = None,
        status_code: int = 200,
    ) -> None:
        """``on_close`` runs however the response ends, even if ``events`` never started
        (closing a generator that never ran skips its ``finally``)."""
        super().__init__(content=None, status_code=status_code)
        self.events = events
        self.on_close = on_close
        self.headers["cache-control"] = "no-cache"
        self.headers["x-accel-buffering"] = "no"
        self.headers["content-type"] = "text/event-stream; charset=utf-8"
        del self.headers["content-length"]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # OSError: the client vanished while we were writing; _send_all's finally aborted it.
        with contextlib.suppress(OSError):
            await until_disconnect(receive, lambda: self._send_all(send))

    async def _send_all(self, send: Send) -> None:
        try:
            await send(
                {"type": "http.response.start", "status": self.status_code,
                 "headers": self.raw_headers}
            )  # fmt: skip
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await self.events.aclose()  # type: ignore[attr-defined]
            if self.on_close is not None:
                self.on_close()


async def until_disconnect(
    receive: Receive, work: Callable[[], Awaitable[T]]
) -> tuple[bool, T | None]:
    """Run ``work()`` unless the client disconnects first: ``(True, result)`` or ``(False, None)``.

    On disconnect the running task is cancelled, which runs ``work``'s ``finally`` blocks
    (they abort its requests); exceptions of ``work`` propagate unchanged.
    """
    task = asyncio.current_task()
    assert task is not None
    state = {"done": False, "disconnected": False}

    async def watch() -> None:
        await _wait_for_disconnect(receive)
        if not state["done"]:
            state["disconnected"] = True
            task.cancel()

    watcher = asyncio.create_task(watch())
    try:
        result = await work()
        state["done"] = True
        return True, result
    except asyncio.CancelledError:
        if state["disconnected"]:
            task.uncancel()
            return False, None
        raise
    finally:
        state["done"] = True
        watcher.cancel()
