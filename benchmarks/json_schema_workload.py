"""A structured-outputs serving workload: chat requests held to a JSON Schema, for any
OpenAI-compatible server (``serve_vs_vllm.py --workload json-schema``).

Each request asks for one record of a fixed set of realistic schemas (a person, a weather
report, an order, an event, a review, an address, a book, a support ticket; request i takes
schema i mod 8) with OpenAI's ``response_format: {"type": "json_schema", "json_schema":
{"name", "schema", "strict": true}}``, greedy, non-streamed. The schemas use only what
vLLM's grammar backends (xgrammar, guidance, outlines) and pagedllm's all take: objects
with required fields and no others, nesting, arrays with ``maxItems``, enums, bounded
integers and strings, patterns. Every reply's content is parsed and validated with
``jsonschema``: an output that fails is invalid; one cut by ``max_tokens`` (``finish_reason
"length"``) is counted as ``truncated`` too, so an invalid output that was not cut means the
server's grammar let it through.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from typing import Any

import httpx
import jsonschema

_TEXT = {"type": "string", "maxLength": 40}
_NAME = {"type": "string", "minLength": 1, "maxLength": 30}


def _record(properties: dict[str, Any]) -> dict[str, Any]:
    """An object with exactly these properties, all required."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


# name -> (schema, what the user asks for; {subject} varies by request and round)
SCHEMAS: dict[str, tuple[dict[str, Any], str]] = {
    "person": (_record({
        "name": _NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "maxLength": 60}, "is_member": {"type": "boolean"},
    }), "Invent a customer profile for someone called {subject}."),
    "weather": (_record({
        "city": _NAME, "unit": {"enum": ["C", "F"]},
        "forecast": {"type": "array", "maxItems": 3, "items": _record({
            "day": {"type": "integer", "minimum": 1, "maximum": 7},
            "high": {"type": "integer", "minimum": -40, "maximum": 55},
            "low": {"type": "integer", "minimum": -50, "maximum": 45},
            "summary": _TEXT,
        })},
    }), "Give a three-day weather forecast for {subject}."),
    "order": (_record({
        "order_id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "items": {"type": "array", "minItems": 1, "maxItems": 4, "items": _record({
            "sku": {"type": "string", "maxLength": 12},
            "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
        })},
        "status": {"enum": ["pending", "shipped", "delivered", "cancelled"]},
    }), "Write the order record of a purchase of {subject}."),
    "event": (_record({
        "title": _TEXT, "location": _record({"city": _NAME, "country": _NAME}),
        "attendees": {"type": "array", "maxItems": 4, "items": _NAME},
        "all_day": {"type": "boolean"},
    }), "Describe a meetup about {subject}."),
    "review": (_record({
        "product": _NAME, "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "pros": {"type": "array", "maxItems": 3, "items": _TEXT},
        "cons": {"type": "array", "maxItems": 3, "items": _TEXT},
        "recommend": {"type": "boolean"},
    }), "Review {subject} as a customer would."),
    "address": (_record({
        "street": _TEXT, "city": _NAME,
        "postal_code": {"type": "string", "pattern": "^[0-9]{5}$"},
        "country": {"enum": ["FR", "DE", "US", "JP", "BR", "IN"]},
    }), "Make up a postal address for {subject}."),
    "book": (_record({
        "title": _TEXT, "author": _NAME,
        "year": {"type": "integer", "minimum": 1450, "maximum": 2030},
        "genres": {"type": "array", "maxItems": 3,
                   "items": {"enum": ["fiction", "history", "science", "poetry", "travel"]}},
    }), "Recommend a book about {subject}."),
    "ticket": (_record({
        "id": {"type": "integer", "minimum": 1, "maximum": 99999},
        "priority": {"enum": ["low", "medium", "high", "urgent"]},
        "customer": _record({"name": _NAME, "email": {"type": "string", "maxLength": 60}}),
        "description": {"type": "string", "maxLength": 120},
    }), "File a support ticket about a problem with {subject}."),
}  # fmt: skip
SUBJECTS = ("Ada Lovelace", "Lisbon", "a red bicycle", "Osaka", "jazz records", "a tent",
            "Marie Curie", "Nairobi", "coffee beans", "a laptop", "Reykjavik", "tomatoes",
            "Alan Turing", "Montreal", "running shoes", "a violin")  # fmt: skip


def requests(model: str, num: int, max_tokens: int, seed: int) -> list[tuple[str, dict]]:
    """``num`` chat bodies (schema name, body): request i asks for schema i mod 8 about a
    subject drawn with ``seed`` (another round, other prompts: no prefix-cache carry-over
    beyond the chat template's)."""
    rng = random.Random(seed)
    names = list(SCHEMAS)
    bodies = []
    for i in range(num):
        name = names[i % len(names)]
        schema, ask = SCHEMAS[name]
        subject = f"{rng.choice(SUBJECTS)} (#{rng.randrange(10_000)})"
        messages = [
            {"role": "system", "content": "You answer with one JSON object and nothing else."},
            {"role": "user", "content": ask.format(subject=subject)},
        ]
        body = {
            "model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": name, "schema": schema, "strict": True}},
        }  # fmt: skip
        bodies.append((name, body))
    return bodies


def check(name: str, content: str | None) -> bool:
    """Whether ``content`` is JSON that validates against schema ``name``."""
    try:
        jsonschema.validate(json.loads(content or ""), SCHEMAS[name][0])
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


async def run(base_url: str, bodies: list[tuple[str, dict]], concurrency: int) -> dict[str, Any]:
    """Send ``bodies`` with at most ``concurrency`` in flight; throughput, latency, validity."""
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(None)) as client:

        async def one(name: str, body: dict) -> dict[str, Any]:
            async with limit:
                start = time.perf_counter()
                response = await client.post("/v1/chat/completions", json=body)
                latency = time.perf_counter() - start
            if response.status_code != 200:
                return {"ok": False, "error": response.text[:300]}
            data = response.json()
            choice = data["choices"][0]
            content = choice["message"].get("content")
            return {"ok": True, "latency": latency, "tokens": data["usage"]["completion_tokens"],
                    "valid": check(name, content), "cut": choice["finish_reason"] == "length",
                    "schema": name, "content": content}  # fmt: skip

        start = time.perf_counter()
        results = await asyncio.gather(*(one(name, body) for name, body in bodies))
        duration = time.perf_counter() - start
    done = [r for r in results if r["ok"]]
    tokens = sum(r["tokens"] for r in done)
    invalid = [r for r in done if not r["valid"]]
    latencies = [r["latency"] * 1000 for r in done]
    return {
        "completed": len(done), "failed": len(results) - len(done), "duration": duration,
        "total_output_tokens": tokens, "output_throughput": tokens / duration,
        "mean_latency_ms": statistics.fmean(latencies) if latencies else None,
        "invalid": len(invalid), "truncated": sum(r["cut"] for r in done),
        "invalid_uncut": sum(not r["cut"] for r in invalid),
        "errors": [r["error"] for r in results if not r["ok"]][:3],
        "invalid_examples": [(r["schema"], (r["content"] or "")[:200]) for r in invalid][:3],
    }  # fmt: skip
