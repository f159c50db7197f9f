"""Structured outputs end to end on real models: 200 generated JSON schemas on a tiny random
Llama (with the tiny byte tokenizer), greedy and sampled, under preemption and with n=4;
a handful on the default SmolLM2 model. Every output must parse and validate with
``jsonschema``: the grammar, not the model, makes it valid.

The schemas are bounded (strings' maxLength, arrays' maxItems, integer ranges, no free
whitespace) so that any path through the grammar ends within ``max_tokens``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

import pytest

from pagedllm.engine.llm import LLM
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams

jsonschema = pytest.importorskip("jsonschema")

NUM_SCHEMAS = 200
# Tokens an output may need at most: a string character is at most 4 bytes (byte tokens) or
# a 6-byte escape, so each generated schema is checked against this budget.
MAX_TOKENS = 400
# Formats with bounded instances, and the most bytes of one (quotes included). Not "date":
# RFC 3339 (the grammar) allows the year 0000, Python's checker (date.fromisoformat) does not.
FORMATS = {"uuid": 38, "ipv4": 17}
NAMES = ("id", "name", "kind", "tags", "size", "ok", "when", "note", "x", "y")


def random_schema(rng: random.Random) -> dict[str, Any]:
    """An object schema with optional fields, nesting, arrays, enums, formats and $ref."""
    defs: dict[str, Any] = {}
    schema = _object(rng, depth=0, defs=defs)
    if defs:
        schema["$defs"] = defs
    return schema


def _object(rng: random.Random, depth: int, defs: dict[str, Any]) -> dict[str, Any]:
    names = rng.sample(NAMES, rng.randint(1, 3 if depth else 4))
    properties = {name: _value(rng, depth + 1, defs) for name in names}
    required = [n for n in names if rng.random() < 0.6]
    schema: dict[str, Any] = {
        "type": "object",
        "properties": properties,
        "additionalProperties": False,
    }
    if required:
        schema["required"] = required
    return schema


def _value(rng: random.Random, depth: int, defs: dict[str, Any]) -> dict[str, Any]:
    choices = ["integer", "boolean", "enum", "string", "format", "pattern", "const", "anyOf"]
    if depth < 2:
        choices += ["object", "array", "ref"]
    kind = rng.choice(choices)
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
    if kind == "boolean":
        return {"type": rng.choice(["boolean", "null"])}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 1, 2, None, True], rng.randint(1, 4))}
    if kind == "string":
        low = rng.randint(0, 2)
        return {"type": "string", "minLength": low, "maxLength": low + rng.randint(0, 4)}
    if kind == "format":
        return {"type": "string", "format": rng.choice(sorted(FORMATS))}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(["^[a-f]{2,4}$", "^[0-9]{3}-[A-Z]$"])}
    if kind == "const":
        return {"const": rng.choice(["v1", 7, False])}
    if kind == "anyOf":
        return {"anyOf": [_value(rng, 2, defs), _value(rng, 2, defs)]}
    if kind == "object":
        return _object(rng, depth, defs)
    if kind == "array":
        return {
            "type": "array",
            "items": _value(rng, depth + 1, defs),
            "maxItems": rng.randint(1, 3),
        }
    name = f"d{len(defs)}"
    defs[name] = _value(rng, 2, defs)
    return {"$ref": f"#/$defs/{name}"}


def bounded_schemas(count: int, seed: int = 0) -> list[dict[str, Any]]:
    """``count`` schemas whose longest output fits ``MAX_TOKENS`` byte tokens."""
    rng = random.Random(seed)
    schemas = []
    while len(schemas) < count:
        schema = random_schema(rng)
        if _longest(schema, schema) <= MAX_TOKENS:
            schemas.append(schema)
    return schemas


def _longest(schema: Any, root: dict[str, Any]) -> int:
    """An upper bound of the bytes of any instance the grammar lets through."""
    if "$ref" in schema:
        return _longest(root["$defs"][schema["$ref"].rsplit("/", 1)[1]], root)
    if "anyOf" in schema:
        return max(_longest(s, root) for s in schema["anyOf"])
    if "enum" in schema or "const" in schema:
        values = schema.get("enum", [schema.get("const")])
        return max(len(json.dumps(v)) for v in values)
    kind = schema["type"]
    if kind == "object":
        props = schema["properties"]
        return 2 + sum(len(k) + 4 + _longest(v, root) for k, v in props.items())
    if kind == "array":
        return 2 + schema["maxItems"] * (1 + _longest(schema["items"], root))
    if kind == "string" and "format" in schema:
        return FORMATS[schema["format"]]
    if kind == "string" and "pattern" in schema:
        return 2 + 5
    if kind == "string":
        return 2 + 12 * schema["maxLength"]  # escapes, surrogate pairs: 12 bytes a char
    if kind == "integer":
        return 5
    return 5  # boolean, null


def structured(schema: dict[str, Any]) -> StructuredOutputsParams:
    return StructuredOutputsParams(json=schema, disable_any_whitespace=True)


def check_valid(outputs: list[Any], schemas: list[dict[str, Any]]) -> int:
    """Every completion parses and validates; returns how many were checked."""
    checker = jsonschema.FormatChecker()
    checked = 0
    for output, schema in zip(outputs, schemas, strict=True):
        for completion in output.outputs:
            assert completion.finish_reason == "stop", (completion, schema)
            instance = json.loads(completion.text)
            jsonschema.validate(instance, schema, format_checker=checker)
            checked += 1
    return checked


@pytest.fixture(scope="module")
def schemas() -> list[dict[str, Any]]:
    return bounded_schemas(NUM_SCHEMAS)


def test_generated_schemas_cover_the_features(schemas: list[dict[str, Any]]) -> None:
    text = json.dumps(schemas)
    for feature in ('"$ref"', '"anyOf"', '"enum"', '"format"', '"pattern"', '"items"'):
        assert feature in text
    assert any(len(s["properties"]) > len(s.get("required", ())) for s in schemas)  # optional
    nested = [s for s in schemas if '"type": "object"' in json.dumps(s["properties"])]
    assert nested


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_tiny_model_outputs_validate(
    model_engine: Callable[..., LLMEngine], schemas: list[dict[str, Any]], temperature: float
) -> None:
    llm = LLM.from_engine(model_engine(max_num_seqs=64))
    params = [
        SamplingParams(temperature=temperature, seed=i, max_tokens=MAX_TOKENS,
                       structured_outputs=structured(s))
        for i, s in enumerate(schemas)
    ]  # fmt: skip
    outputs = llm.generate(["give me json"] * len(schemas), params, use_tqdm=False)
    assert check_valid(outputs, schemas) == NUM_SCHEMAS
    assert len(llm.engine.structured.matchers) == 0


PAGING = {
    "recompute": dict(preemption_mode="recompute"),
    "swap-chunked": dict(preemption_mode="swap", swap_space=..., max_num_batched_tokens=40),
    "disk": dict(preemption_mode="recompute", kv_offload_dir=...),
}


def _paged_run(
    model_engine: Callable[..., LLMEngine], schemas: list[dict[str, Any]], **config: Any
) -> tuple[list[Any], LLMEngine]:
    engine = model_engine(max_num_seqs=32, block_size=16, max_model_len=512, **config)
    llm = LLM.from_engine(engine)
    prompts = [f"json {'please ' * (i % 7)}" for i in range(len(schemas))]  # several lengths
    params = [
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=structured(s))
        for s in schemas
    ]
    return llm.generate(prompts, params, use_tqdm=False), engine


@pytest.mark.parametrize("name", list(PAGING))
def test_preempted_outputs_are_those_of_an_unpreempted_run(
    model_engine: Callable[..., LLMEngine], schemas: list[dict[str, Any]], name: str, tmp_path
) -> None:
    """The matcher lives with the request, not its blocks: recompute, swap, chunked prefill
    and the disk tier change nothing of what the grammar allows."""
    subset = schemas[:32]
    baseline, _ = _paged_run(model_engine, subset, num_blocks=1024)
    config = {k: v for k, v in PAGING[name].items() if v is not ...}
    if "swap_space" in PAGING[name]:
        config["num_host_blocks"] = 256
    if "kv_offload_dir" in PAGING[name]:
        config["kv_offload_dir"] = str(tmp_path / "kv")
    outputs, engine = _paged_run(model_engine, subset, num_blocks=48, **config)
    stats = engine.get_stats()
    assert stats.num_preemptions > 0
    if name == "swap-chunked":
        assert stats.num_preemptions_swap > 0
    if name == "disk":
        assert stats.disk is not None and stats.disk.blocks_read > 0
    assert [o.outputs[0].token_ids for o in outputs] == [b.outputs[0].token_ids for b in baseline]
    assert check_valid(outputs, subset) == len(subset)
    assert len(engine.structured.matchers) == 0


def test_n4_samples_each_follow_their_own_matcher(
    model_engine: Callable[..., LLMEngine], schemas: list[dict[str, Any]]
) -> None:
    """n=4: the samples fork after the prompt, each gets a matcher rebuilt from its own
    tokens; under preemption too (a small cache)."""
    subset = schemas[32:48]
    engine = model_engine(max_num_seqs=32, block_size=16, max_model_len=512, num_blocks=64)
    llm = LLM.from_engine(engine)
    params = [
        SamplingParams(n=4, temperature=1.0, seed=i, max_tokens=MAX_TOKENS,
                       structured_outputs=structured(s))
        for i, s in enumerate(subset)
    ]  # fmt: skip
    outputs = llm.generate(["json"] * len(subset), params, use_tqdm=False)
    assert check_valid(outputs, subset) == 4 * len(subset)
    distinct = [len({c.text for c in o.outputs}) for o in outputs]
    assert max(distinct) > 1  # the samples differ
    assert engine.get_stats().num_preemptions > 0
    assert len(engine.structured.matchers) == 0


DEFAULT_MODEL_SCHEMAS = [
    {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 20},
     "population_millions": {"type": "integer", "minimum": 0, "maximum": 100}},
     "required": ["capital", "population_millions"], "additionalProperties": False},
    {"type": "object", "properties": {"colours": {"type": "array", "maxItems": 3,
     "items": {"enum": ["red", "green", "blue", "yellow"]}}}, "required": ["colours"],
     "additionalProperties": False},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
     "reason": {"type": "string", "maxLength": 30}}, "required": ["answer"],
     "additionalProperties": False},
    {"$defs": {"city": {"type": "object", "properties": {"name": {"type": "string",
     "maxLength": 15}, "id": {"type": "string", "format": "uuid"}}, "required": ["name"],
     "additionalProperties": False}}, "type": "object",
     "properties": {"cities": {"type": "array", "items": {"$ref": "#/$defs/city"},
     "minItems": 1, "maxItems": 2}}, "required": ["cities"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"},
     "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
     "required": ["ok", "code"], "additionalProperties": False},
]  # fmt: skip
QUESTIONS = [
    "What is the capital of France?",
    "Name some colours of the rainbow.",
    "Is the sea salty?",
    "Name two cities in Italy.",
    "Give me a status code.",
]


@pytest.mark.slow
def test_default_model_outputs_validate_where_free_text_does_not() -> None:
    """SmolLM2-135M answers in prose; constrained (greedy and sampled, n=2) every answer
    parses and validates."""
    from pagedllm.model.default_model import ensure_default_model

    try:
        ensure_default_model()
    except RuntimeError as error:
        pytest.skip(f"default model unavailable: {error}")
    with LLM(model="default", max_num_seqs=16, kv_cache_memory=256 << 20) as llm:
        chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
        free = llm.chat(chats, SamplingParams(temperature=0.0, max_tokens=60), use_tqdm=False)
        valid_free = 0
        for output, schema in zip(free, DEFAULT_MODEL_SCHEMAS, strict=True):
            try:
                jsonschema.validate(json.loads(output.outputs[0].text), schema)
                valid_free += 1
            except (ValueError, jsonschema.ValidationError):
                pass
        assert valid_free == 0  # prose, not JSON
        for temperature, n in ((0.0, 1), (0.8, 2)):
            params = [
                SamplingParams(temperature=temperature, n=n, seed=0, max_tokens=160,
                               structured_outputs=StructuredOutputsParams(json=s))
                for s in DEFAULT_MODEL_SCHEMAS
            ]  # fmt: skip
            prompts = [{"prompt_token_ids": llm.encode_chat(c)} for c in chats]
            outputs = llm.generate(prompts, params, use_tqdm=False)
            assert check_valid(outputs, DEFAULT_MODEL_SCHEMAS) == n * len(QUESTIONS)
        assert len(llm.engine.structured.matchers) == 0
