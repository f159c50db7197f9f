"""``StructuredOutputsParams``: validation naming the field, exactly one kind, the canonical
spec the compile cache hashes, and the trip across the engine core's wire."""

from __future__ import annotations

import pytest

from pagedllm.engine.messages import AddRequests, Codec, RequestSpec
from pagedllm.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams

S = StructuredOutputsParams


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, r"exactly one of json, json_object, regex, choice, grammar \(got none\)"),
        ({"json": {"type": "string"}, "regex": "a"}, r"\(got json and regex\)"),
        ({"json_object": False}, r"\(got none\)"),
        ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
        ({"json": [1, 2]}, "structured_outputs.json must be a JSON Schema object"),
        ({"json": {"a": {1, 2}}}, "structured_outputs.json is not JSON data"),
        ({"json_object": "yes"}, "structured_outputs.json_object must be a boolean"),
        ({"regex": ""}, "structured_outputs.regex must be a non-empty string"),
        ({"grammar": 3}, "structured_outputs.grammar must be a non-empty string"),
        ({"choice": "ab"}, "structured_outputs.choice must be a list of strings"),
        ({"choice": []}, "structured_outputs.choice must not be empty"),
        ({"choice": ["a", 2]}, "structured_outputs.choice must hold non-empty strings"),
        ({"regex": "a", "disable_any_whitespace": 1}, "disable_any_whitespace must be a boolean"),
    ],
)
def test_bad_values_name_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        S(**kwargs)


def test_the_spec_text_is_canonical() -> None:
    schema = {"type": "object", "properties": {"b": {}, "a": {}}}
    assert (
        S(json=schema).spec_text()
        == S(json='{"properties":{"a":{},"b":{}},"type":"object"}').spec_text()
    )
    assert S(json_object=True).kind == "json_object"
    assert S(choice=["x", "y"]).choice == ("x", "y") and S(choice=["x"]).spec_text() == '["x"]'


def test_from_dict_refuses_unknown_keys() -> None:
    assert S.from_dict({"regex": "a+", "json": None}) == S(regex="a+")
    with pytest.raises(ValueError, match="structured_outputs.guided_json is not a known field"):
        S.from_dict({"guided_json": {}})
    with pytest.raises(ValueError, match="structured_outputs must be an object"):
        S.from_dict(["regex"])  # type: ignore[arg-type]


def test_sampling_params_take_only_the_record() -> None:
    with pytest.raises(ValueError, match="structured_outputs must be StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a"})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="structured_outputs must be StructuredOutputsParams"):
        BeamSearchParams(beam_width=2, max_tokens=4, structured_outputs="a")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "structured",
    [S(json={"type": "object", "properties": {"a": {"enum": [1, None]}}}),
     S(json_object=True), S(regex="[0-9]+"), S(choice=["yes", "no"]),
     S(grammar='start: "a" b\nb: "c"', disable_any_whitespace=True), None],
)  # fmt: skip
def test_the_record_crosses_the_wire(structured: StructuredOutputsParams | None) -> None:
    params = SamplingParams(max_tokens=7, structured_outputs=structured)
    codec = Codec()
    message = codec.decode(codec.encode(AddRequests((RequestSpec("r", [1, 2], params),)))).message
    (spec,) = message.specs
    assert spec.params == params
    assert spec.params.structured_outputs == structured
