"""Request-as-a-Service endpoint definitions (`request-endpoints/<name>`): validated, versioned.

An endpoint names a workload and two JSON Schemas (input, output) plus an optional prompt
template; every gateway serves it at `/v1/endpoints/<name>` (gateway/endpoints.py). Validation
here is the API boundary: the name follows the workload name rules, both schemas must be valid
JSON Schema (checked against their metaschema) of bounded size, and the workload must exist.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema

from controlplane import keys
from controlplane.store import EtcdStore
from controlplane.workloads.spec import NAME_RE
from kunlun_common.api import gateway_pb2
from kunlun_common.clock import now_ms
from kunlun_common.errors import InvalidInput, NotFoundError
from kunlun_common.messages import Message, msg

MAX_SCHEMA_BYTES = 64 * 1024
"""Largest schema text: gateways validate every request against it on their event loop."""
MAX_TEMPLATE_BYTES = 16 * 1024
"""Largest prompt template."""


def _schema_problem(field: str, text: str) -> Message | None:
    if not text:
        return msg(
            "endpoint.required_json_schema",
            '{field}: required (a JSON Schema, e.g. {{"type": "object"}})',
            field=field,
        )
    if len(text.encode()) > MAX_SCHEMA_BYTES:
        return msg(
            "endpoint.bytes_above_limit",
            "{field}: {count} bytes, above the limit of {max_schema_bytes}",
            field=field,
            count=len(text.encode()),
            max_schema_bytes=MAX_SCHEMA_BYTES,
        )
    try:
        schema: Any = json.loads(text)
    except ValueError as e:
        return msg("endpoint.not_valid_json", "{field}: not valid JSON ({e})", field=field, e=e)
    if not isinstance(schema, (dict, bool)):
        return msg(
            "endpoint.json_schema_must_object",
            "{field}: a JSON Schema must be an object, found {name}",
            field=field,
            name=type(schema).__name__,
        )
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        return msg(
            "endpoint.not_valid_json_schema",
            "{field}: not a valid JSON Schema at {json_path}: {message}",
            field=field,
            json_path=e.json_path,
            message=e.message,
        )
    return None


def problems(ep: gateway_pb2.RequestEndpoint) -> list[Message]:
    """What is wrong with a definition a caller sent, one line per field (the first is reported)."""
    out: list[Message] = []
    if not NAME_RE.match(ep.name):
        out.append(
            msg(
                "endpoint.name_not_valid_name",
                "name: {name!r} is not a valid name (lower-case letters, digits, '-' and '.', 1-63)",
                name=ep.name,
            )
        )
    if not NAME_RE.match(ep.workload):
        out.append(
            msg(
                "endpoint.workload_not_valid_workload",
                "workload: {workload!r} is not a valid workload name",
                workload=ep.workload,
            )
        )
    for field, text in (("input_schema", ep.input_schema_json), ("output_schema", ep.output_schema_json)):
        why = _schema_problem(field, text)
        if why:
            out.append(why)
    if len(ep.prompt_template.encode()) > MAX_TEMPLATE_BYTES:
        out.append(
            msg(
                "endpoint.prompt_template_above_limit",
                "prompt_template: above the limit of {max_template_bytes} bytes",
                max_template_bytes=MAX_TEMPLATE_BYTES,
            )
        )
    return out


async def put(store: EtcdStore, ep: gateway_pb2.RequestEndpoint, who: str) -> gateway_pb2.RequestEndpoint:
    found = problems(ep)
    if found:
        raise InvalidInput(found[0])
    if await store.get(keys.workload_name(ep.workload)) is None:
        raise NotFoundError(
            msg(
                "endpoint.workload_missing",
                "workload: {workload!r} does not exist (submit it first: kunlun-cli workload submit)",
                workload=ep.workload,
            )
        )
    old = await get(store, ep.name, missing_ok=True)
    rec = gateway_pb2.RequestEndpoint()
    rec.CopyFrom(ep)
    rec.version = (old.version if old is not None else 0) + 1
    rec.updated_by = who
    rec.updated_at_unix_ms = now_ms()
    await store.put(keys.request_endpoint(ep.name), keys.encode_message(rec))
    return rec


async def get(store: EtcdStore, name: str, missing_ok: bool = False) -> gateway_pb2.RequestEndpoint | None:
    kv = await store.get(keys.request_endpoint(name)) if NAME_RE.match(name) else None
    if kv is None:
        if missing_ok:
            return None
        raise NotFoundError(
            msg("endpoint.not_found", "endpoint {name!r} not found (kunlun-cli endpoint list)", name=name)
        )
    return decode(kv.value)


def decode(raw: bytes) -> gateway_pb2.RequestEndpoint:
    ep = gateway_pb2.RequestEndpoint()
    keys.decode_message(raw, ep)
    return ep


async def list_all(store: EtcdStore) -> list[gateway_pb2.RequestEndpoint]:
    kvs, _ = await store.get_prefix(keys.REQUEST_ENDPOINTS)
    return sorted((decode(kv.value) for kv in kvs), key=lambda e: e.name)


async def delete(store: EtcdStore, name: str) -> gateway_pb2.RequestEndpoint:
    ep = await get(store, name)
    assert ep is not None
    await store.delete(keys.request_endpoint(name))
    return ep
