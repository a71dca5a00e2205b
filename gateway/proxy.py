"""The hot path: client connections (asyncio.Protocol + httptools), routing, retries, errors.

Per request the gateway parses the HTTP head (httptools, C), parses the JSON body once to read
`model` (and the prompt prefix only for prefix_affinity), picks an instance, and writes the request
head it rebuilt (hop-by-hop headers and the client's API key dropped) plus the untouched body to a
pooled keep-alive upstream connection in one writev. Response bytes go to the client as they arrive
(SSE chunks included): no framework, no per-request task, no copy of the response.

A request that failed before any byte reached the client (connect refused, connection reset,
502/503/504 from the engine) is retried on another instance (`retries`, default once). Every error
the gateway itself answers is a JSON body `{"error": {"message", "type", "code"}}`:
400 malformed JSON or HTTP, 401 missing/invalid/revoked key, 404 unknown model or route, 405,
413 body too large, 502 instance failed (after the retry), 503 no instance can take it (the message
names the workload and why), 504 the engine did not answer within request_timeout_s.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import Callable
from typing import Any, cast

import httptools
import structlog

from gateway import endpoints
from gateway.auth import ApiKeys
from gateway.backends import Registry
from gateway.exchange import Exchange
from gateway.routing import prompt_prefix
from gateway.settings import GatewaySettings

try:
    import orjson

    _loads: Callable[[bytes], Any] = orjson.loads
except ImportError:  # pragma: no cover - orjson is optional
    _loads = json.loads

log = structlog.get_logger("gateway.proxy")
_REASONS = {
    200: b"OK",
    400: b"Bad Request",
    401: b"Unauthorized",
    404: b"Not Found",
    405: b"Method Not Allowed",
    413: b"Payload Too Large",
    502: b"Bad Gateway",
    503: b"Service Unavailable",
    504: b"Gateway Timeout",
}
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}
_INFERENCE = frozenset((b"/v1/chat/completions", b"/v1/completions", b"/generate"))
_HOP = frozenset(
    (
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"transfer-encoding",
        b"te",
        b"trailer",
        b"upgrade",
        b"content-length",
        b"expect",
        b"host",
        b"proxy-authorization",
    )
)


def error_body(status: int, message: str) -> bytes:
    err = {"message": message, "type": _TYPES.get(status, "error"), "param": None, "code": status}
    return json.dumps({"error": err}, separators=(",", ":")).encode()


class Request:
    __slots__ = ("body", "headers", "http10", "keep_alive", "method", "too_big", "url")

    def __init__(
        self,
        method: bytes,
        url: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        keep_alive: bool,
        http10: bool,
        too_big: bool,
    ) -> None:
        self.method = method
        self.url = url
        self.headers = headers
        self.body = body
        self.keep_alive = keep_alive
        self.http10 = http10
        self.too_big = too_big


class Proxy:
    """Gateway-wide state the connections share."""

    def __init__(
        self,
        settings: GatewaySettings,
        registry: Registry,
        keys: ApiKeys,
        status: Callable[[], dict[str, Any]],
    ) -> None:
        self.settings = settings
        self.registry = registry
        self.keys = keys
        self.status = status
        self.clients: set[ClientProtocol] = set()
        self.loop = asyncio.get_running_loop()
        self.inflight = 0
        self.created = int(time.time())

    def protocol(self) -> ClientProtocol:
        return ClientProtocol(self)

    # ------------------------------------------------------------------ routes
    def handle(self, client: ClientProtocol, req: Request) -> None:
        if req.too_big:
            client.error(413, f"request body larger than {self.settings.max_body_bytes} bytes", False)
            return
        path = req.url.split(b"?", 1)[0]
        fwd, auth, session = _scan(req.headers, self.keys.required)
        if path in _INFERENCE:
            if req.method != b"POST":
                client.error(405, f"{path.decode()} takes POST", req.keep_alive)
                return
            if self._refused(client, req, auth):
                return
            self._inference(client, req, fwd, session)
            return
        if path == b"/health" or path == b"/health_generate":
            self._health(client, req)
            return
        if path == b"/v1/models" or path == b"/kunlun/status":
            if req.method != b"GET":
                client.error(405, f"{path.decode()} takes GET", req.keep_alive)
            elif not self._refused(client, req, auth):
                body = self._models() if path == b"/v1/models" else self.status()
                client.reply(200, json.dumps(body, separators=(",", ":")).encode(), req.keep_alive)
            return
        if path.startswith(endpoints.PREFIX):
            if not self._refused(client, req, auth):
                endpoints.serve(self, client, req, path)
            return
        client.error(404, f"no route {path.decode('latin-1')}", req.keep_alive)

    def _refused(self, client: ClientProtocol, req: Request, auth: bytes | None) -> bool:
        why = self.keys.check(auth)
        if why is None:
            return False
        if not self.keys.loaded:
            client.error(503, "API keys are required but none were received from the control plane yet", True)
            return True
        client.error(401, why, req.keep_alive, b"www-authenticate: Bearer\r\n")
        return True

    def _health(self, client: ClientProtocol, req: Request) -> None:
        reg = self.registry
        if not reg.synced:
            body = {"status": "starting", "reason": "no endpoint snapshot from the control plane yet"}
            client.reply(503, json.dumps(body).encode(), req.keep_alive)
            return
        ok = {"status": "ok", "workloads": len(reg.served()), "instances": len(reg.all_backends())}
        client.reply(200, json.dumps(ok).encode(), req.keep_alive)

    def _models(self) -> dict[str, Any]:
        data = [
            {
                "id": w.name,
                "object": "model",
                "created": self.created,
                "owned_by": "kunlun",
                "root": w.backends[0].model or w.name,
            }
            for w in sorted(self.registry.served(), key=lambda w: w.name)
        ]
        return {"object": "list", "data": data}

    def _inference(self, client: ClientProtocol, req: Request, fwd: bytes, session: bytes | None) -> None:
        try:
            body = _loads(req.body)
        except ValueError as e:
            client.error(400, f"request body is not valid JSON ({e})", req.keep_alive)
            return
        if not isinstance(body, dict):
            client.error(400, "request body must be a JSON object", req.keep_alive)
            return
        reg = self.registry
        model = body.get("model")
        if model is None or model == "":
            served = reg.served()
            if len(served) != 1:
                names = ", ".join(sorted(w.name for w in served)) or "none"
                client.error(400, f"model: required (the workload name; served: {names})", req.keep_alive)
                return
            model = served[0].name
        if not isinstance(model, str):
            client.error(400, f"model: expected a string, found {type(model).__name__}", req.keep_alive)
            return
        wl = reg.workloads.get(model)
        if wl is None or not wl.backends:
            if not reg.synced:
                client.error(503, "no endpoint snapshot from the control plane yet", req.keep_alive)
            elif not reg.known(model):
                names = ", ".join(sorted(w.name for w in reg.served())) or "none"
                client.error(404, f"model {model!r} not found (served: {names})", req.keep_alive)
            else:
                client.error(503, reg.no_instance_reason(model), req.keep_alive, b"retry-after: 1\r\n")
            return
        key: str | None = None
        if wl.policy.name == "prefix_affinity":
            key = session.decode("latin-1") if session else prompt_prefix(body, wl.prefix_chars)
        http = b" HTTP/1.0\r\n" if req.http10 else b" HTTP/1.1\r\n"
        head = b"".join((req.method, b" ", req.url, http))
        tail = b"%scontent-length: %d\r\n\r\n" % (fwd, len(req.body))
        variant = reg.variant_for(wl, session.decode("latin-1") if session else None) if wl.canaries else None
        ex = Exchange(self, client, req, wl, key, head, tail, variant)
        client.exchange = ex
        self.inflight += 1
        ex.start()


def _scan(headers: list[tuple[bytes, bytes]], strip_auth: bool) -> tuple[bytes, bytes | None, bytes | None]:
    """(headers to forward, Authorization value, x-session-id value)."""
    out: list[bytes] = []
    auth = session = None
    for name, value in headers:
        low = name.lower()
        if low == b"authorization":
            auth = value
            if strip_auth:
                continue
        elif low == b"x-session-id":
            session = value
        elif low in _HOP:
            continue
        out.append(b"%s: %s\r\n" % (name, value))
    return b"".join(out), auth, session


class ClientProtocol(asyncio.Protocol):
    """One client connection: keep-alive, pipelined requests answered in order."""

    def __init__(self, proxy: Proxy) -> None:
        self.proxy = proxy
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.size = 0
        self.pending: deque[Request] = deque()
        self.busy = False
        self.exchange: Exchange | None = None
        self.paused_reading = False

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.proxy.clients.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.proxy.clients.discard(self)
        self.pending.clear()
        ex, self.exchange = self.exchange, None
        if ex is not None:
            ex.abort()

    def pause_writing(self) -> None:
        if self.exchange is not None:
            self.exchange.pause()

    def resume_writing(self) -> None:
        if self.exchange is not None:
            self.exchange.resume()

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.error(400, "protocol upgrades are not supported", False)
        except httptools.HttpParserError as e:
            self.error(400, f"malformed HTTP request ({e})", False)

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.url = b""
        self.headers = []
        self.body = []
        self.size = 0

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))
        if len(name) == 6 and name.lower() == b"expect" and value.lower() == b"100-continue":
            if self.transport is not None:
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self.size += len(body)
        if self.size <= self.proxy.settings.max_body_bytes:
            self.body.append(body)

    def on_message_complete(self) -> None:
        p = self.parser
        body = self.body[0] if len(self.body) == 1 else b"".join(self.body)
        req = Request(
            p.get_method(),
            self.url,
            self.headers,
            body,
            bool(p.should_keep_alive()),
            p.get_http_version() == "1.0",
            self.size > self.proxy.settings.max_body_bytes,
        )
        if self.busy:
            self.pending.append(req)
            if len(self.pending) > 32 and self.transport is not None and not self.paused_reading:
                self.transport.pause_reading()
                self.paused_reading = True
            return
        self.busy = True
        self.proxy.handle(self, req)

    # responses
    def reply(
        self,
        status: int,
        body: bytes,
        keep_alive: bool,
        extra: bytes = b"",
        content_type: bytes = b"application/json",
    ) -> None:
        t = self.transport
        if t is not None:
            close = b"" if keep_alive else b"connection: close\r\n"
            t.write(
                b"HTTP/1.1 %d %s\r\nserver: kunlun-gateway\r\ncontent-type: %s\r\ncontent-length: %d\r\n%s%s\r\n%s"
                % (status, _REASONS.get(status, b"Error"), content_type, len(body), extra, close, body)
            )
        self.finished(keep_alive)

    def error(self, status: int, message: str, keep_alive: bool, extra: bytes = b"") -> None:
        self.reply(status, error_body(status, message), keep_alive, extra)

    def finished(self, keep_alive: bool) -> None:
        self.exchange = None
        t = self.transport
        if t is None:
            return
        if not keep_alive:
            self.pending.clear()
            t.close()
            return
        if self.pending:
            req = self.pending.popleft()
            if self.paused_reading and len(self.pending) < 8:
                t.resume_reading()
                self.paused_reading = False
            self.proxy.handle(self, req)
        else:
            self.busy = False
