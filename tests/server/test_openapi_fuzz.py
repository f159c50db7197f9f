"""Fuzz the server's own OpenAPI schema in-process: no input may earn a 5xx.

schemathesis turns ``app.openapi()`` into Hypothesis strategies for every route in it:
inputs the schema allows (positive), the same made plausible so that many reach the
engine, and inputs it forbids (negative). Each case goes to the app through
``StreamingASGITransport`` on one event loop, over an ``LLMEngine`` with the fake runner.
Every answer must be below 500, and a 4xx an OpenAI error body. After each route the
server is healthy and no KV block is held.

``GET /v1/cache/events/stream`` is endless by design (it pushes events until the client
leaves): its parameters are fuzzed like any others, but a 200's body is not read; the
client disconnects after the status line. ``/dashboard`` (a static page, no inputs) is
left out of the schema, and so of this test.

The normal suite runs ``CI_EXAMPLES`` cases per route, derandomized (the same every run);
``pytest --deep`` runs ``DEEP_EXAMPLES`` from a new seed each time (about 6,000 requests).
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.generation import GenerationMode

from .conftest import StreamingASGITransport, wait_pool_free

CI_EXAMPLES = 100
DEEP_EXAMPLES = 1000
ENDLESS_STREAMS = frozenset({"/v1/cache/events/stream"})
# The fake runner's block size in bytes: big enough that the pools a resize asks for stay
# small (blocks = bytes / this), so a grow costs the test little memory.
KV_BLOCK_BYTES = 1 << 20
# Fields the server refuses whatever the engine could do (another model, not supported).
REFUSED_FIELDS = frozenset({"model", "suffix", "best_of", "response_format"})
VOCAB_SIZE = 256  # the tiny tokenizer's bytes; its vocabulary holds a few more tokens


def _operations(app: Any) -> list[Any]:
    schema = schemathesis.openapi.from_dict(app.openapi())
    return [result.ok() for result in schema.get_all_operations()]


def _cases(operation: Any) -> Any:
    """Inputs the schema allows, the same made plausible (so that many reach the engine),
    and, where the route takes any, inputs it forbids."""
    positive = operation.as_strategy(generation_mode=GenerationMode.POSITIVE)
    if not list(operation.iter_parameters()) and not operation.body.items:
        return positive  # nothing to get wrong
    negative = operation.as_strategy(generation_mode=GenerationMode.NEGATIVE)
    return positive | positive.map(_plausible) | negative


def _plausible(case: Any) -> Any:
    """A schema-valid body that the server would otherwise refuse before the engine: no
    other model's name or unsupported field, a length that fits, token ids in the
    vocabulary."""
    if not isinstance(case.body, dict):
        return case
    body = {k: v for k, v in case.body.items() if k not in REFUSED_FIELDS}
    for name in ("max_tokens", "max_completion_tokens", "min_tokens"):
        if isinstance(body.get(name), int):
            body[name] = body[name] % 8 + (name != "min_tokens")
    if (body.get("min_tokens") or 0) > (body.get("max_tokens") or 16):
        body["min_tokens"] = 0
    if "prompt" in body:
        body["prompt"] = _in_vocabulary(body["prompt"]) or "x"
    case.body = body
    return case


def _in_vocabulary(prompt: Any) -> Any:
    """Token ids as ids of the vocabulary (JSON Schema's integers include 3.0; strict
    validation does not), each prompt of a batch not empty."""
    if isinstance(prompt, list):
        return [_in_vocabulary(p) or "x" if isinstance(p, list | str) else _in_vocabulary(p)
                for p in prompt]  # fmt: skip
    if isinstance(prompt, int | float) and not isinstance(prompt, bool):
        return int(prompt) % VOCAB_SIZE
    return prompt


class Fuzzer:
    """One app and one event loop for all the cases of a route; counts what it sent."""

    def __init__(self, harness: Any) -> None:
        self.harness = harness
        self.loop = asyncio.new_event_loop()
        transport = StreamingASGITransport(harness.app)
        self.client = httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30)
        self.num_requests = 0
        self.statuses: dict[int, int] = {}

    def warm_up(self) -> None:
        """One finished request, so that the advice, events and blocks have something."""
        body = {"prompt": "warm up", "max_tokens": 4}
        response = self.loop.run_until_complete(self.client.post("/v1/completions", json=body))
        assert response.status_code == 200, response.text

    def send(self, case: Any) -> httpx.Response:
        return self.loop.run_until_complete(self._send(case))

    async def _send(self, case: Any) -> httpx.Response:
        # requests prepares the case as schemathesis would put it on the wire.
        kwargs = case.as_transport_kwargs(base_url="http://test")
        prepared = requests.Request(**kwargs).prepare()
        request = self.client.build_request(
            prepared.method, prepared.url, headers=dict(prepared.headers), content=prepared.body
        )
        response = await self.client.send(request, stream=True)
        try:
            if case.operation.path not in ENDLESS_STREAMS or response.status_code != 200:
                await response.aread()
        finally:
            await response.aclose()
        self.num_requests += 1
        self.statuses[response.status_code] = self.statuses.get(response.status_code, 0) + 1
        return response

    def finish(self) -> dict[str, Any]:
        """Check the server is healthy and holds no block, then shut it down."""
        try:
            return self.loop.run_until_complete(self._finish())
        finally:
            self.loop.run_until_complete(self.client.aclose())
            self.loop.close()

    async def _finish(self) -> dict[str, Any]:
        engine = self.harness.engine
        try:
            report = await wait_pool_free(engine, llm=self.harness.llm)
            health = await self.client.get("/health")
            assert health.status_code == 200, health.text
            return report
        finally:
            await engine.shutdown()


def _check_answer(case: Any, response: httpx.Response) -> None:
    where = f"{case.operation.label} {case.as_transport_kwargs(base_url='http://test')}"
    assert response.status_code < 500, f"{response.status_code} for {where}: {response.text}"
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["message"], where


@pytest.fixture
def deep(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--deep"))


ROUTES = [
    "GET /health",
    "GET /v1/models",
    "POST /v1/completions",
    "POST /v1/chat/completions",
    "GET /v1/cache",
    "GET /v1/cache/events",
    "GET /v1/cache/events/stream",
    "GET /v1/cache/advice",
    "GET /metrics",
    "GET /v1/cache/blocks",
    "POST /v1/cache/resize",
]


@pytest.mark.parametrize("route", ROUTES)
def test_no_input_earns_a_5xx(make_harness, deep, route):
    harness = make_harness(runner_kw={"kv_block_bytes": KV_BLOCK_BYTES})
    (operation,) = [op for op in _operations(harness.app) if op.label == route]
    fuzzer = Fuzzer(harness)
    fuzzer.warm_up()

    @settings(
        max_examples=DEEP_EXAMPLES if deep else CI_EXAMPLES,
        derandomize=not deep,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=_cases(operation))
    def fuzz(case: Any) -> None:
        _check_answer(case, fuzzer.send(case))

    try:
        fuzz()
    finally:
        report = fuzzer.finish()
    print(f"{route}: {fuzzer.num_requests} requests, statuses {fuzzer.statuses}")
    assert report["blocks_used"] == 0


def test_every_route_is_fuzzed(make_harness):
    """A new route joins the list above (or this fails)."""
    assert {op.label for op in _operations(make_harness().app)} == set(ROUTES)
