"""Structured output for the test engine: a JSON value that conforms to a JSON Schema.

What SGLang does with `response_format: {"type": "json_schema", ...}` (constrained decoding), the
test engine does by construction, for the subset of JSON Schema it documents:

- `type`: object, array, string, number, integer, boolean, null (a list of types: the first one);
- `enum` and `const` (the first value);
- object: `properties` (every property is produced, required or not) and `required` (a required
  name without a property schema gets a string);
- array: `items` (one schema), `minItems` / `maxItems` (the length is minItems, at least 1 unless
  maxItems is 0);
- string: `minLength` / `maxLength` (words of the prompt, padded or cut to fit);
- number / integer: `minimum` / `maximum`, `exclusiveMinimum` / `exclusiveMaximum` (numbers).

Anything else (`$ref`, `anyOf`, `pattern`, formats) is not understood: `generate` raises
SchemaUnsupported naming the keyword and its path, and the engine answers 400, as SGLang does for a
schema its grammar backend cannot compile. `violate` produces a value that does NOT conform, for
tests of whoever checks the engine's answer.
"""

from __future__ import annotations

import json
import math
from typing import Any

SUPPORTED = frozenset(
    (
        "type",
        "enum",
        "const",
        "properties",
        "required",
        "items",
        "minItems",
        "maxItems",
        "minLength",
        "maxLength",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "additionalProperties",
        "title",
        "description",
        "default",
        "examples",
        "$schema",
        "$id",
    )
)


class SchemaUnsupported(ValueError):
    """The schema uses something outside the documented subset (the message names it and where)."""


def generate(schema: Any, words: list[str], path: str = "$") -> Any:
    """A value conforming to `schema`, made of `words` (the prompt's) where text is needed."""
    if schema is True or schema == {}:
        return _text(words, 1, 32)
    if not isinstance(schema, dict):
        raise SchemaUnsupported(f"{path}: a schema must be an object, found {type(schema).__name__}")
    unknown = sorted(k for k in schema if k not in SUPPORTED)
    if unknown:
        raise SchemaUnsupported(f"{path}: keyword {unknown[0]!r} is not supported by the test engine")
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        values = schema["enum"]
        if not isinstance(values, list) or not values:
            raise SchemaUnsupported(f"{path}.enum: expected a non-empty list")
        return values[0]
    kind = schema.get("type", "object" if "properties" in schema else "string")
    if isinstance(kind, list):
        if not kind:
            raise SchemaUnsupported(f"{path}.type: expected a non-empty list")
        kind = kind[0]
    if kind == "object":
        props = schema.get("properties") or {}
        out = {name: generate(sub, words, f"{path}.{name}") for name, sub in props.items()}
        for name in schema.get("required") or []:
            if name not in out:
                out[name] = _text(words, 1, 32)
        return out
    if kind == "array":
        lo = int(schema.get("minItems", 1))
        hi = schema.get("maxItems")
        count = lo if hi is None else min(max(lo, 1), int(hi))
        item = schema.get("items", {})
        return [generate(item, words[i:] + words[:i], f"{path}[{i}]") for i in range(count)]
    if kind == "string":
        return _text(words, int(schema.get("minLength", 0)), schema.get("maxLength"))
    if kind in ("number", "integer"):
        return _number(schema, kind == "integer", len(words), path)
    if kind == "boolean":
        return len(words) % 2 == 0
    if kind == "null":
        return None
    raise SchemaUnsupported(f"{path}.type: {kind!r} is not a JSON Schema type the test engine knows")


def violate(schema: Any) -> Any:
    """A value that does not conform to `schema` (a conforming one with its first field broken)."""
    if not isinstance(schema, dict):
        return None
    kind = schema.get("type", "object" if "properties" in schema else "string")
    if kind == "object" and schema.get("properties"):
        value = generate(schema, ["x"])
        first = next(iter(schema["properties"]))
        value[first] = _wrong(schema["properties"][first])
        return value
    return _wrong(schema)


def _wrong(schema: Any) -> Any:
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(schema, dict) and "enum" in schema:
        return {"not": "one of the enum"}
    return "not-a-number" if kind in ("number", "integer", "boolean", "null", "object", "array") else 12345


def _text(words: list[str], lo: int, hi: Any) -> str:
    text = " ".join(words) or "ok"
    while len(text) < lo:
        text = f"{text} {text}"
    if hi is not None:
        text = text[: max(int(hi), lo)]
    return text


def _number(schema: dict[str, Any], integer: bool, seed: int, path: str) -> float | int:
    lo = float(schema.get("minimum", -math.inf))
    hi = float(schema.get("maximum", math.inf))
    xlo, xhi = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
    step = 1.0 if integer else 0.5
    if isinstance(xlo, (int, float)) and not isinstance(xlo, bool):
        lo = max(
            lo, math.floor(xlo) + 1 if integer else xlo + min(step, (hi - xlo) / 2 if hi < math.inf else step)
        )
    if isinstance(xhi, (int, float)) and not isinstance(xhi, bool):
        hi = min(
            hi, math.ceil(xhi) - 1 if integer else xhi - min(step, (xhi - lo) / 2 if lo > -math.inf else step)
        )
    if integer:
        lo = float(math.ceil(lo)) if lo > -math.inf else lo
        hi = float(math.floor(hi)) if hi < math.inf else hi
    if lo > hi:
        raise SchemaUnsupported(f"{path}: no {'integer' if integer else 'number'} between the bounds")
    value = float(seed)
    if lo > -math.inf and hi < math.inf:
        value = lo + (seed % int(hi - lo + 1)) if integer else (lo + hi) / 2
    elif lo > -math.inf:
        value = lo + seed
    elif hi < math.inf:
        value = hi - seed
    return int(value) if integer else value


def structured(response_format: Any, words: list[str], violation: bool = False) -> str:
    """The message content for an OpenAI-style `response_format` (json_schema, json_object, text)."""
    if not isinstance(response_format, dict):
        raise SchemaUnsupported("expected an object with a 'type'")
    kind = response_format.get("type")
    if kind == "text":
        return " ".join(words)
    if kind == "json_object":
        schema: Any = {"type": "object"}
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise SchemaUnsupported("json_schema.schema: required (the JSON Schema of the answer)")
        schema = spec["schema"]
    else:
        raise SchemaUnsupported(f"type: expected 'json_schema', 'json_object' or 'text', found {kind!r}")
    value = violate(schema) if violation else generate(schema, words)
    return json.dumps(value, ensure_ascii=False)
