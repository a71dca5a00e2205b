"""The test engine's structured output: conforming JSON for the documented JSON Schema subset."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from node_agent.testengine.schema_output import SchemaUnsupported, generate, structured, violate

WORDS = ["alpha", "beta", "gamma"]

SCHEMAS: list[dict[str, Any]] = [
    {"type": "string"},
    {"type": "string", "minLength": 40, "maxLength": 50},
    {"type": "string", "maxLength": 3},
    {"type": "integer", "minimum": 10, "maximum": 12},
    {"type": "integer", "exclusiveMinimum": 5, "exclusiveMaximum": 7},
    {"type": "number", "minimum": 0.25, "maximum": 0.5},
    {"type": "number", "maximum": -100},
    {"type": "boolean"},
    {"type": "null"},
    {"enum": ["red", "green"]},
    {"type": "array", "items": {"type": "integer", "minimum": 1}, "minItems": 3, "maxItems": 5},
    {"type": "array", "items": {"type": "string"}, "maxItems": 0},
    {
        "type": "object",
        "properties": {
            "sentiment": {"type": "string", "enum": ["positive", "negative", "neutral"]},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 2},
            "nested": {
                "type": "object",
                "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
                "required": ["ok", "n"],
                "additionalProperties": False,
            },
        },
        "required": ["sentiment", "score", "tags", "extra"],
    },
]


@pytest.mark.parametrize("schema", SCHEMAS, ids=[json.dumps(s)[:40] for s in SCHEMAS])
def test_generated_value_conforms(schema: dict[str, Any]) -> None:
    jsonschema.validate(generate(schema, WORDS), schema)
    jsonschema.validate(generate(schema, []), schema)


@pytest.mark.parametrize("schema", SCHEMAS, ids=[json.dumps(s)[:40] for s in SCHEMAS])
def test_violation_does_not_conform(schema: dict[str, Any]) -> None:
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(violate(schema), schema)


def test_unsupported_keyword_is_named_with_its_path() -> None:
    schema = {"type": "object", "properties": {"a": {"anyOf": [{"type": "string"}]}}}
    with pytest.raises(SchemaUnsupported, match=r"\$\.a: keyword 'anyOf'"):
        generate(schema, WORDS)
    with pytest.raises(SchemaUnsupported, match="no integer between"):
        generate({"type": "integer", "minimum": 3, "maximum": 2}, WORDS)


def test_structured_response_formats() -> None:
    schema = SCHEMAS[-1]
    out = json.loads(
        structured({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}, WORDS)
    )
    jsonschema.validate(out, schema)
    assert json.loads(structured({"type": "json_object"}, WORDS)) == {}
    with pytest.raises(SchemaUnsupported, match=r"json_schema\.schema: required"):
        structured({"type": "json_schema", "json_schema": {}}, WORDS)
    with pytest.raises(SchemaUnsupported, match="found 'xml'"):
        structured({"type": "xml"}, WORDS)
