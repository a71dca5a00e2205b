"""Request-as-a-Service: `POST /v1/endpoints/NAME` and `GET /v1/endpoints/NAME/openapi.json`.

An endpoint (pushed by the control plane in GatewayConfig.endpoints) is a JSON API defined by two
JSON Schemas over a workload. Per request the gateway validates the body against the input schema
(400 naming the failing JSON path), renders the prompt ({field} placeholders filled from the input;
`{input}` or no template: the input as JSON), and sends one chat completion with an OpenAI-style
`response_format: {"type": "json_schema", ...}` (SGLang's structured output) through the normal
routing: an `Exchange` like any proxied request (policy, canary split, retries, timeout, traffic
stats), whose response is captured here instead of relayed. The answer's message content must be
JSON conforming to the output schema (502 naming the violation otherwise); the client gets that
JSON alone. Validation runs on the event loop: schemas are meant to be small (the control plane
bounds their size).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import httptools
import jsonschema
import structlog
from jsonschema.exceptions import best_match

from kunlun_common.api import gateway_pb2

if TYPE_CHECKING:
    from gateway.client import ClientProtocol
    from gateway.proxy import Proxy
    from gateway.wire import Request

log = structlog.get_logger("gateway.endpoints")
PREFIX = b"/v1/endpoints/"
_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
_ENGINE_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\n"


@dataclass(frozen=True)
class Compiled:
    """One endpoint ready to serve, or why it cannot be."""

    spec: gateway_pb2.RequestEndpoint
    """The definition as pushed."""
    input_schema: dict[str, Any]
    """Parsed input schema."""
    output_schema: dict[str, Any]
    """Parsed output schema."""
    input_validator: Any
    """jsonschema validator of the input."""
    output_validator: Any
    """jsonschema validator of the engine's answer."""


def compile_all(
    specs: Iterable[gateway_pb2.RequestEndpoint], old: dict[str, Compiled | str]
) -> dict[str, Compiled | str]:
    """name -> Compiled (or the reason it cannot be served); unchanged definitions are reused."""
    out: dict[str, Compiled | str] = {}
    for spec in specs:
        prev = old.get(spec.name)
        if isinstance(prev, Compiled) and prev.spec == spec:
            out[spec.name] = prev
            continue
        try:
            ins, outs = json.loads(spec.input_schema_json), json.loads(spec.output_schema_json)
            iv, ov = _validator(ins), _validator(outs)
            out[spec.name] = Compiled(spec, ins, outs, iv, ov)
        except (ValueError, jsonschema.SchemaError) as e:
            out[spec.name] = (
                f"endpoint {spec.name!r} has an invalid schema ({e}); fix it with `kunlun-cli endpoint create`"
            )
            log.warning("endpoint not served", endpoint=spec.name, error=str(e))
    return out


def _validator(schema: Any) -> Any:
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def violation(validator: Any, value: Any) -> str | None:
    """`$.path: message` of the most relevant error, or None when `value` conforms."""
    err = best_match(validator.iter_errors(value))
    return None if err is None else f"{err.json_path}: {err.message}"


def render(template: str, data: Any) -> str:
    """The prompt: {field} placeholders from the input object; {input} or no template: all of it."""
    whole = json.dumps(data, ensure_ascii=False, sort_keys=True)
    if not template:
        return whole

    def one(m: re.Match[str]) -> str:
        name = m.group(1)
        if isinstance(data, dict) and name in data:
            v = data[name]
            return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)
        return whole if name == "input" else ""

    return _PLACEHOLDER.sub(one, template)


def openapi(ep: Compiled) -> dict[str, Any]:
    """OpenAPI 3.1 description of one endpoint."""
    spec = ep.spec
    err = {
        "type": "object",
        "properties": {
            "error": {
                "type": "object",
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "code": {"type": "integer"},
                },
            }
        },
    }
    errors = {"content": {"application/json": {"schema": err}}}
    return {
        "openapi": "3.1.0",
        "info": {
            "title": f"Kunlun endpoint {spec.name}",
            "version": str(spec.version or 1),
            "description": f"Served by workload {spec.workload!r} with structured output.",
        },
        "paths": {
            f"/v1/endpoints/{spec.name}": {
                "post": {
                    "operationId": spec.name,
                    "security": [{"bearer": []}],
                    "requestBody": {
                        "required": True,
                        "content": {"application/json": {"schema": ep.input_schema}},
                    },
                    "responses": {
                        "200": {
                            "description": "The answer, conforming to the output schema",
                            "content": {"application/json": {"schema": ep.output_schema}},
                        },
                        "400": {"description": "The body does not conform to the input schema", **errors},
                        "401": {"description": "Missing or invalid API key", **errors},
                        "502": {"description": "The engine failed or its answer did not conform", **errors},
                        "503": {"description": "No instance of the workload can take it", **errors},
                        "504": {"description": "The engine did not answer in time", **errors},
                    },
                }
            }
        },
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }


def serve(proxy: Proxy, client: ClientProtocol, req: Request, path: bytes) -> None:
    """Answer one request under /v1/endpoints/ (the API key was checked already)."""
    rest = path[len(PREFIX) :].decode("latin-1")
    name, _, sub = rest.partition("/")
    table: dict[str, Compiled | str] = proxy.registry.request_endpoints
    ep = table.get(name)
    if ep is None:
        names = ", ".join(sorted(table)) or "none"
        client.error(404, f"endpoint {name!r} not found (defined: {names})", req.keep_alive)
        return
    if isinstance(ep, str):
        client.error(503, ep, req.keep_alive)
        return
    if sub == "openapi.json":
        if req.method != b"GET":
            client.error(405, f"{path.decode('latin-1')} takes GET", req.keep_alive)
            return
        client.reply(200, json.dumps(openapi(ep), separators=(",", ":")).encode(), req.keep_alive)
        return
    if sub:
        client.error(404, f"no route {path.decode('latin-1')}", req.keep_alive)
        return
    if req.method != b"POST":
        client.error(405, f"{path.decode('latin-1')} takes POST", req.keep_alive)
        return
    try:
        data = json.loads(req.body)
    except ValueError as e:
        client.error(400, f"request body is not valid JSON ({e})", req.keep_alive)
        return
    why = violation(ep.input_validator, data)
    if why is not None:
        client.error(400, f"input does not conform to the schema of endpoint {name!r}: {why}", req.keep_alive)
        return
    _call_engine(proxy, client, req, ep, data)


def _call_engine(proxy: Proxy, client: ClientProtocol, req: Request, ep: Compiled, data: Any) -> None:
    from gateway.exchange import Exchange  # (exchange -> backends -> this module)

    spec, reg = ep.spec, proxy.registry
    wl = reg.workloads.get(spec.workload)
    if wl is None or not wl.backends:
        if reg.known(spec.workload):
            client.error(503, reg.no_instance_reason(spec.workload), req.keep_alive, b"retry-after: 1\r\n")
        else:
            client.error(
                503, f"workload {spec.workload!r} of endpoint {spec.name!r} has no instance", req.keep_alive
            )
        return
    body = json.dumps(
        {
            "model": spec.workload,
            "messages": [{"role": "user", "content": render(spec.prompt_template, data)}],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": spec.name, "schema": ep.output_schema, "strict": True},
            },
        },
        separators=(",", ":"),
    ).encode()
    tail = b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)
    inner = type(req)(b"POST", b"/v1/chat/completions", [], body, True, False)
    capture = _Capture(client, req, ep)
    variant = reg.variant_for(wl, None) if wl.canaries else None
    ex = Exchange(proxy, cast("ClientProtocol", capture), inner, wl, None, _ENGINE_HEAD, tail, variant)
    client.exchange = ex
    proxy.inflight += 1
    ex.start()


class _Capture:
    """Stands in for the client connection of the engine call: collects the response, then answers."""

    def __init__(self, client: ClientProtocol, req: Request, ep: Compiled) -> None:
        self.client = client
        self.req = req
        self.ep = ep
        self.transport = self
        self.parser = httptools.HttpResponseParser(self)
        self.body: list[bytes] = []
        self.status = 0
        self.answered = False

    # the Exchange writes the engine's raw response bytes here
    def write(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._answer(502, None, f"malformed HTTP response from the engine ({e})")

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()

    def finished(self, keep_alive: bool) -> None:
        self._check()

    def error(self, status: int, message: str, keep_alive: bool, extra: bytes = b"") -> None:
        self._answer(status, None, message)

    def _check(self) -> None:
        name = self.ep.spec.name
        raw = b"".join(self.body)
        if self.status != 200:
            self._answer(502, None, f"engine of endpoint {name!r} answered {self.status}: {raw[:300]!r}")
            return
        try:
            content = json.loads(raw)["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError) as e:
            self._answer(502, None, f"engine of endpoint {name!r} sent no chat completion ({e!r})")
            return
        try:
            value = json.loads(content) if isinstance(content, str) else None
        except ValueError as e:
            self._answer(502, None, f"engine answer of endpoint {name!r} is not JSON ({e})")
            return
        why = violation(self.ep.output_validator, value)
        if why is not None:
            self._answer(
                502, None, f"engine answer does not conform to the output schema of endpoint {name!r}: {why}"
            )
            return
        self._answer(200, json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode(), "")

    def _answer(self, status: int, body: bytes | None, message: str) -> None:
        if self.answered:
            return
        self.answered = True
        if status != 200:
            log.info("endpoint request failed", endpoint=self.ep.spec.name, status=status, error=message)
            self.client.error(status, message, self.req.keep_alive)
        else:
            assert body is not None
            self.client.reply(200, body, self.req.keep_alive)
