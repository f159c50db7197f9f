"""Server test harness: an app over a real ``LLMEngine`` with the ``FakeModelRunner``.

Every test talks to the app in-process (``httpx.ASGITransport``) inside ``asyncio.run``;
when the test body returns, the harness checks that the KV pool is back to no block
held by a request (nothing leaked), then shuts the engine's step thread down.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from pagedllm.engine.async_engine import EngineClosedError
from pagedllm.engine.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.reports import cache_report as build_cache_report
from pagedllm.server.app import create_app
from pagedllm.testing import make_tiny_tokenizer
from pagedllm.util.net import free_port, port_free
from pagedllm.worker.fake_runner import FakeModelRunner

LETTERS = range(ord("a"), ord("z") + 1)  # token id == byte value in the tiny tokenizer


@dataclass
class Harness:
    app: Any
    runner: FakeModelRunner
    tokenizer: Any
    llm: LLMEngine  # runs in the app's engine-core thread: touch it only while that idles

    @property
    def engine(self) -> Any:
        return self.app.state.engine

    def expected_ids(
        self, prompt_ids: Sequence[int], num_tokens: int, sample: int = 0
    ) -> list[int]:
        """What the fake runner generates: sample ``j`` differs only in its first token."""
        context = list(prompt_ids)
        out: list[int] = []
        for i in range(num_tokens):
            token = self.runner.next_token(context, sample if i == 0 else 0)
            out.append(token)
            context.append(token)
        return out

    def expected_text(self, prompt: str | Sequence[int], num_tokens: int, sample: int = 0) -> str:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        return self.tokenizer.decode(self.expected_ids(ids, num_tokens, sample))

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def run(self, body: Callable[[httpx.AsyncClient], Awaitable[Any]], **client_kw: Any) -> Any:
        """Run ``body(client)`` against the app, then check no block leaked and shut down."""

        async def main() -> Any:
            transport = httpx.ASGITransport(app=self.app)
            async with httpx.AsyncClient(
                transport=transport, base_url="http://test", timeout=30, **client_kw
            ) as client:
                try:
                    result = await body(client)
                    await wait_pool_free(self.engine, llm=self.llm)
                    return result
                finally:
                    await self.engine.shutdown()

        return asyncio.run(main())


async def cache_report(engine: Any, llm: LLMEngine | None = None) -> dict[str, Any]:
    """The engine's /v1/cache report; once its core has stopped, read from ``llm``."""
    try:
        return await engine.cache_report()
    except EngineClosedError:
        if llm is None:
            raise
        return build_cache_report(llm.get_stats())


async def wait_until(
    condition: Callable[[], bool | Awaitable[bool]], deadline_s: float = 10.0, *, what: str
) -> None:
    """Poll ``condition`` (a function or a coroutine function) until it holds; after
    ``deadline_s`` seconds fail, saying ``what`` was awaited."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + deadline_s
    while True:
        held = condition()
        if inspect.isawaitable(held):
            held = await held
        if held:
            return
        if loop.time() > deadline:
            raise AssertionError(f"waited {deadline_s} s for {what}")
        await asyncio.sleep(0.005)


def wait_until_sync(
    condition: Callable[[], bool], deadline_s: float = 10.0, *, what: str, every_s: float = 0.02
) -> None:
    """``wait_until`` outside an event loop (other processes, threads, a uvicorn server):
    poll ``condition`` every ``every_s`` seconds until it holds (an AssertionError it raises,
    say for a process that died, ends the wait at once)."""
    deadline = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {deadline_s} s for {what}")
        time.sleep(every_s)


def answers_health(url: str, proc: Any) -> bool:
    """True once the server at ``url`` answers /health with 200; an AssertionError with
    its output if its process ``proc`` (a ``subprocess.Popen``) has exited."""
    assert proc.poll() is None, _output(proc)
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _output(proc: Any) -> str:
    stream = proc.stderr if proc.stderr is not None else proc.stdout
    data = b"" if stream is None else stream.read()
    return data.decode(errors="replace")[-3000:]


async def hold_core(engine: Any, llm: LLMEngine, gate: Any) -> Any:
    """Start a utility call that keeps the engine core (a thread here) busy until ``gate``
    is set, and return its future once the core is inside it: whatever is sent meanwhile
    waits, as behind a long step."""
    inside = threading.Event()

    count = llm.get_num_unfinished_requests

    def hold() -> int:
        inside.set()
        gate.wait(10)
        return count()

    llm.get_num_unfinished_requests = hold  # what the core runs for this call
    held = asyncio.ensure_future(engine.num_unfinished_requests())
    await wait_until(inside.is_set, what="the engine core to enter the held utility call")
    return held


async def wait_pool_free(
    engine: Any, timeout: float = 10.0, llm: LLMEngine | None = None
) -> dict[str, Any]:
    """Wait until no block is held by a request and nothing runs; fail otherwise."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        report = await cache_report(engine, llm)
        idle = report["running"] == report["waiting"] == report["swapped"] == 0
        if report["blocks_used"] == 0 and idle and engine.num_in_flight == 0:
            assert report["blocks_free"] + report["blocks_cached_free"] == report["blocks_total"]
            return report
        if loop.time() > deadline:
            raise AssertionError(f"KV blocks or requests leaked: {report}")
        await asyncio.sleep(0.01)


class ASGIStream:
    """Call the ASGI app directly, read its body as it is sent, and disconnect at will.

    (``httpx.ASGITransport`` hands back a streaming body only once the app is done.)
    """

    def __init__(self, app: Any, path: str, body: dict[str, Any], headers: Sequence = ()):
        self.app = app
        self.body = json.dumps(body).encode()
        self.scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
            "query_string": b"", "root_path": "", "client": ("127.0.0.1", 5555),
            "server": ("test", 80),
            "headers": [(b"host", b"test"), (b"content-type", b"application/json"), *headers],
        }  # fmt: skip
        self.status: int | None = None
        self.chunks: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._body_sent = False
        self._disconnect = asyncio.Event()
        self.task: asyncio.Task | None = None

    def start(self) -> ASGIStream:
        self.task = asyncio.create_task(self.app(self.scope, self._receive, self._send))
        return self

    async def next_chunk(self, timeout: float = 10.0) -> bytes | None:
        """The next body chunk (None once the response is complete)."""
        return await asyncio.wait_for(self.chunks.get(), timeout)

    async def disconnect(self) -> None:
        self._disconnect.set()
        assert self.task is not None
        await asyncio.wait_for(self.task, 10)

    async def _receive(self) -> dict[str, Any]:
        if not self._body_sent:
            self._body_sent = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self._disconnect.wait()
        return {"type": "http.disconnect"}

    async def _send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        elif message["type"] == "http.response.body":
            if message.get("body"):
                await self.chunks.put(message["body"])
            if not message.get("more_body"):
                await self.chunks.put(None)


class StreamingASGITransport(httpx.AsyncBaseTransport):
    """``httpx.ASGITransport`` with a body that streams: each chunk reaches the client as
    the app sends it (an endless event stream works), and closing the response
    disconnects the app's request (``http.disconnect``)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
            "method": request.method, "scheme": request.url.scheme,
            "path": request.url.path, "raw_path": request.url.raw_path.split(b"?")[0],
            "query_string": request.url.query, "root_path": "",
            "headers": [(k.lower(), v) for k, v in request.headers.raw],
            "server": (request.url.host, request.url.port), "client": ("127.0.0.1", 5555),
        }  # fmt: skip
        stream = _AppBody(self.app, scope, body)
        await stream.start()
        return httpx.Response(stream.status, headers=stream.headers, stream=stream)


class _AppBody(httpx.AsyncByteStream):
    def __init__(self, app: Any, scope: dict[str, Any], body: bytes) -> None:
        self.app, self.scope, self.body = app, scope, body
        self.chunks: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.started = asyncio.Event()
        self.disconnected = asyncio.Event()
        self.status = 500
        self.headers: list[tuple[bytes, bytes]] = []
        self.task: asyncio.Task | None = None
        self._body_sent = False

    async def start(self) -> None:
        self.task = asyncio.create_task(self._run())
        started = asyncio.create_task(self.started.wait())
        await asyncio.wait({self.task, started}, return_when=asyncio.FIRST_COMPLETED)
        started.cancel()
        if not self.started.is_set():
            self.task.result()  # the app raised before it answered
            raise RuntimeError("the app ended without a response")

    async def _run(self) -> None:
        try:
            await self.app(self.scope, self._receive, self._send)
        finally:
            await self.chunks.put(None)

    async def _receive(self) -> dict[str, Any]:
        if not self._body_sent:
            self._body_sent = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.disconnected.wait()
        return {"type": "http.disconnect"}

    async def _send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status, self.headers = message["status"], list(message.get("headers", []))
            self.started.set()
        elif message["type"] == "http.response.body" and message.get("body"):
            await self.chunks.put(message["body"])

    async def __aiter__(self):
        while (chunk := await self.chunks.get()) is not None:
            yield chunk
        assert self.task is not None
        try:
            await self.task
        except Exception as exc:  # the app broke off its answer: a lost connection
            raise httpx.ReadError(f"the app failed: {exc!r}") from exc

    async def aclose(self) -> None:
        self.disconnected.set()
        if self.task is not None and not self.task.done():
            try:
                await asyncio.wait_for(asyncio.shield(self.task), 5)
            except TimeoutError:
                self.task.cancel()


def free_port_run(count: int) -> int:
    """The first of ``count`` consecutive ports that are all free now: ``serve
    --data-parallel-size N`` puts its replicas on ``--port + 1`` .. ``--port + N`` (a port
    the kernel hands out is in the ephemeral range, where its neighbours may be another
    connection's: a test once failed with a replica's 'address already in use')."""
    for _ in range(100):
        first = free_port()
        if first + count <= 65536 and all(port_free(first + i) for i in range(count)):
            return first
    raise RuntimeError(f"no run of {count} free ports found")


def sse_events(body: bytes) -> list[Any]:
    """Split an SSE body into parsed events, checking the framing on the way."""
    assert body.endswith(b"data: [DONE]\n\n"), body[-200:]
    parts = body.split(b"\n\n")
    assert parts[-1] == b""
    events: list[Any] = []
    for part in parts[:-1]:
        assert part.startswith(b"data: "), part
        payload = part[len(b"data: ") :]
        events.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
    return events[:-1]


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A tiny random Llama checkpoint (byte tokenizer, ChatML template)."""
    from pagedllm.testing import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tokenizer")
    make_tiny_tokenizer(path)
    return str(path)


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture
def make_harness(tokenizer: Any) -> Callable[..., Harness]:
    def make(
        *,
        num_blocks: int = 64,
        block_size: int = 4,
        max_model_len: int = 128,
        num_host_blocks: int = 0,
        engine_kw: dict[str, Any] | None = None,
        runner_kw: dict[str, Any] | None = None,
        **app_kw: Any,
    ) -> Harness:
        runner = FakeModelRunner(
            num_blocks,
            block_size,
            vocab_size=len(tokenizer),
            num_host_blocks=num_host_blocks,
            allowed_token_ids=LETTERS,
            **(runner_kw or {}),
        )
        config = EngineConfig(
            block_size=block_size, max_model_len=max_model_len, **(engine_kw or {})
        )
        engine = LLMEngine(config, runner, tokenizer)
        return Harness(create_app(engine, **app_kw), runner, tokenizer, engine)

    return make
