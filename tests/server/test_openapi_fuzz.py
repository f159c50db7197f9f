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

The plausible bodies carry a generated constraint (``response_format``, vLLM's
``structured_outputs``, or ``tools`` with a ``tool_choice``): JSON Schemas drawn from the
keywords (supported, unsupported and malformed alike), regexes, choices and grammars, so
that fuzzed specs reach the grammar compiler and, once compiled, the engine's matchers. A
refused spec must be a 400 naming its field; after each route no matcher is left.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.generation import GenerationMode

from .conftest import StreamingASGITransport, wait_pool_free

CI_EXAMPLES = 100
DEEP_EXAMPLES = 1000
ENDLESS_STREAMS = frozenset({"/v1/cache/events/stream"})
# The fake runner's block size in bytes: big enough that the pools a resize asks for stay
# small (blocks = bytes / this), so a grow costs the test little memory.
KV_BLOCK_BYTES = 1 << 20
# Fields the server refuses whatever the engine could do (another model, not supported).
REFUSED_FIELDS = frozenset({"model", "suffix", "best_of"})
# Replaced by a generated constraint in plausible bodies (``_constraints``).
CONSTRAINT_FIELDS = frozenset({"response_format", "structured_outputs", "tools", "tool_choice"})
VOCAB_SIZE = 256  # the tiny tokenizer's bytes; its vocabulary holds a few more tokens


def _operations(app: Any) -> list[Any]:
    schema = schemathesis.openapi.from_dict(app.openapi())
    return [result.ok() for result in schema.get_all_operations()]


def _cases(operation: Any) -> Any:
    """Inputs the schema allows, the same made plausible (so that many reach the engine),
    and, where the route takes any, inputs it forbids; each with whether it is plausible."""
    positive = operation.as_strategy(generation_mode=GenerationMode.POSITIVE)
    if not list(operation.iter_parameters()) and not operation.body.items:
        return positive.map(lambda case: (case, False))  # nothing to get wrong
    negative = operation.as_strategy(generation_mode=GenerationMode.NEGATIVE)
    plausible = st.builds(_plausible, positive, _constraints(tools="chat" in operation.path))
    return st.tuples(positive | negative, st.just(False)) | st.tuples(plausible, st.just(True))


def _plausible(case: Any, constraint: dict[str, Any]) -> Any:
    """A schema-valid body that the server would otherwise refuse before the engine: no
    other model's name or unsupported field, a length that fits, token ids in the
    vocabulary; and ``constraint``'s fields in place of the fuzzed ones."""
    if not isinstance(case.body, dict):
        return case
    drop = REFUSED_FIELDS | CONSTRAINT_FIELDS
    body = {k: v for k, v in case.body.items() if k not in drop} | constraint
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


# ---------------------------------------------------------------- generated constraints

_SCALARS = st.none() | st.booleans() | st.integers(-1000, 1000) | st.text(max_size=6)
_JSON = st.recursive(
    _SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=6,
)
_TYPES = st.sampled_from(
    ["object", "array", "string", "integer", "number", "boolean", "null", "strng"]
)
_NAMES = st.sampled_from(["a", "b", "id", "name", "x y", "<tool_call>", ""])
_SIZES = st.integers(-1, 12)
# Regexes: small valid ones, ones with features some engines lack, malformed, and any text.
_REGEXES = st.sampled_from(
    ["[a-c]{1,4}", "x|yy", r"\d{3}-\d+", "(?i)ab", "a{2,1}", "(?<=a)b", "(unclosed", "[z-a]",
     "<tool_call>[a-z]{1,3}", r"<\|im_start\|>x", ".*", "a**"]
) | st.text(max_size=10)  # fmt: skip
_FORMATS = st.sampled_from(["uuid", "ipv4", "date", "date-time", "email", "time", "colour"])
_REFS = st.sampled_from(["#", "#/$defs/a", "#/$defs/missing", "#/properties/a", "http://x/y"])


def _leaf_schemas() -> Any:
    return st.fixed_dictionaries({}, optional={
        "type": _TYPES | st.lists(_TYPES, max_size=3), "enum": st.lists(_SCALARS, max_size=4),
        "const": _SCALARS, "minimum": st.integers(-50, 50), "maximum": st.integers(-50, 50),
        "exclusiveMinimum": st.integers(-5, 5), "multipleOf": st.integers(0, 4),
        "minLength": _SIZES, "maxLength": _SIZES, "pattern": _REGEXES, "format": _FORMATS,
        "$ref": _REFS, "not": st.just({}), "default": _SCALARS,
    })  # fmt: skip


def _schemas() -> Any:
    """JSON Schemas from their keywords: supported, unsupported, contradictory and
    malformed; a few are bare JSON values (not a schema at all)."""
    nested = st.recursive(_leaf_schemas(), lambda inner: st.fixed_dictionaries({}, optional={
        "type": _TYPES, "properties": st.dictionaries(_NAMES, inner, max_size=3),
        "required": st.lists(_NAMES, max_size=3),
        "additionalProperties": st.booleans() | inner, "items": inner,
        "prefixItems": st.lists(inner, max_size=2), "minItems": _SIZES, "maxItems": _SIZES,
        "anyOf": st.lists(inner, max_size=3), "oneOf": st.lists(inner, max_size=2),
        "allOf": st.lists(inner, max_size=2), "$defs": st.dictionaries(st.just("a"), inner),
        "if": inner, "then": inner,
    }), max_leaves=8)  # fmt: skip
    return nested | st.booleans() | _JSON


def _constraints(tools: bool) -> Any:
    """A body's constraint fields: one of response_format, structured_outputs, or (with
    ``tools``) tools with a tool_choice, or none."""
    schema = _schemas()
    json_schema = st.fixed_dictionaries(
        {"name": st.text(max_size=8), "schema": schema}, optional={"strict": st.booleans()}
    )
    structured = st.one_of(
        st.fixed_dictionaries({"json": schema}, optional={"disable_any_whitespace": st.booleans()}),
        st.fixed_dictionaries({"json_object": st.booleans()}),
        st.fixed_dictionaries({"regex": _REGEXES}),
        st.fixed_dictionaries({"choice": st.lists(st.text(max_size=6), max_size=4)}),
        st.fixed_dictionaries({"grammar": st.sampled_from(
            ['start: "a" | "b"', 'root ::= "x" [0-9]*', "start: missing", "?start: /[a-z]+/"]
        ) | st.text(max_size=16)}),
    )  # fmt: skip
    function = st.fixed_dictionaries(
        {"name": st.sampled_from(["get_weather", "now", "a-b_c"])},
        optional={
            "parameters": schema,
            "strict": st.booleans(),
            "description": st.text(max_size=8),
        },
    )
    tool_list = st.lists(
        st.fixed_dictionaries({"type": st.just("function"), "function": function}),
        min_size=1, max_size=3,
    )  # fmt: skip
    named = st.sampled_from(["now", "get_weather", "unknown"]).map(
        lambda name: {"type": "function", "function": {"name": name}}
    )
    choice = st.sampled_from(["none", "auto", "required"]) | named
    # Richest first: Hypothesis leans to the first branch as it simplifies.
    kinds = [
        st.fixed_dictionaries({"response_format": st.fixed_dictionaries(
            {"type": st.just("json_schema"), "json_schema": json_schema})}),
        st.fixed_dictionaries({"structured_outputs": structured}),
        st.just({"response_format": {"type": "json_object"}}),
        st.just({}),
    ]  # fmt: skip
    if tools:
        with_tools = st.fixed_dictionaries({"tools": tool_list}, optional={"tool_choice": choice})
        kinds.insert(0, with_tools)
    return st.one_of(kinds)


class Fuzzer:
    """One app and one event loop for all the cases of a route; counts what it sent."""

    def __init__(self, harness: Any) -> None:
        self.harness = harness
        self.loop = asyncio.new_event_loop()
        transport = StreamingASGITransport(harness.app)
        self.client = httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30)
        self.num_requests = 0
        self.statuses: dict[int, int] = {}
        # Bodies with a constraint: answered 200, or refused naming which field.
        self.constrained: dict[str, int] = {}

    def warm_up(self) -> None:
        """One finished request, so that the advice, events and blocks have something."""
        body = {"prompt": "warm up", "max_tokens": 4}
        response = self.loop.run_until_complete(self.client.post("/v1/completions", json=body))
        assert response.status_code == 200, response.text

    def send(self, case: Any, plausible: bool = False) -> httpx.Response:
        response = self.loop.run_until_complete(self._send(case))
        if plausible and isinstance(case.body, dict) and CONSTRAINT_FIELDS & case.body.keys():
            self._count_constrained(case.body, response)
        return response

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

    def _count_constrained(self, body: dict[str, Any], response: httpx.Response) -> None:
        if response.status_code == 200:
            outcome = "200"
        else:
            error = response.json()["error"]
            param = error.get("param") or ""
            # a refusal names the field: as its param, or in its message
            assert param or any(key in error["message"] for key in body), error
            outcome = f"400 {param.split('.')[0]}" if param else "400"
        self.constrained[outcome] = self.constrained.get(outcome, 0) + 1

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
            structured = self.harness.llm.structured  # no matcher or compile left behind
            assert len(structured.matchers) == 0 and not structured.compiling
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


CONSTRAINED_ROUTES = frozenset({"POST /v1/completions", "POST /v1/chat/completions"})
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
    @given(drawn=_cases(operation))
    def fuzz(drawn: tuple[Any, bool]) -> None:
        case, plausible = drawn
        _check_answer(case, fuzzer.send(case, plausible))

    try:
        fuzz()
    finally:
        report = fuzzer.finish()
    print(f"{route}: {fuzzer.num_requests} requests, statuses {fuzzer.statuses}")
    print(f"  with a constraint: {fuzzer.constrained}")
    assert report["blocks_used"] == 0
    if route in CONSTRAINED_ROUTES:  # constraints reached the compiler: some ran, some refused
        assert fuzzer.constrained.get("200") and any(
            outcome.split(" ")[-1] in CONSTRAINT_FIELDS for outcome in fuzzer.constrained
        ), fuzzer.constrained


def test_every_route_is_fuzzed(make_harness):
    """A new route joins the list above (or this fails)."""
    assert {op.label for op in _operations(make_harness().app)} == set(ROUTES)
