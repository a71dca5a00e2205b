"""The hot path: routing, retries, errors (connections, limits and deadlines: client.py).

Per request the gateway parses the HTTP head (httptools, C), parses the JSON body once to read
`model` (and the prompt prefix only for prefix_affinity), picks an instance, and writes the request
head it rebuilt (hop-by-hop headers and the client's API key dropped) plus the untouched body to a
pooled keep-alive upstream connection in one writev. Response bytes go to the client as they arrive
(SSE chunks included): no framework, no per-request task, no copy of the response.

A request that failed before any byte reached the client (connect refused, connection reset,
502/503/504 from the engine) is retried on another instance (`retries`, default once). Every error
the gateway itself answers is a JSON body `{"error": {"message", "type", "code"}}`:
400 malformed JSON or HTTP, 401 missing/invalid/revoked key, 404 unknown model or route, 405,
408 request not received in time, 413 body too large, 414 target too long, 429 the key's rate limit
(with Retry-After), 431 head too large, 502 instance failed (after the retry), 503 no instance can
take it (the message names the workload and why) or max_connections reached, 504 the engine did not
answer within request_timeout_s.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import structlog

from gateway import endpoints
from gateway.auth import ApiKeys
from gateway.backends import Registry
from gateway.client import ClientProtocol
from gateway.exchange import Exchange
from gateway.ratelimit import ClientRates, RateLimits
from gateway.routing import prompt_prefix
from gateway.settings import GatewaySettings
from gateway.wire import REASON_OF_STATUS, REFUSAL_REASONS, Refusal, Request

try:
    import orjson

    _loads: Callable[[bytes], Any] = orjson.loads
except ImportError:  # pragma: no cover - orjson is optional
    _loads = json.loads

log = structlog.get_logger("gateway.proxy")
_INFERENCE = frozenset((b"/v1/chat/completions", b"/v1/completions", b"/generate"))
_KEYED = _INFERENCE | {b"/v1/models", b"/kunlun/status"}
_HEALTH = frozenset((b"/health", b"/health_generate"))
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


_TRACE_RE = re.compile(rb"[A-Za-z0-9._-]{1,64}")


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
        self.limits = RateLimits(settings)
        self.client_rates = ClientRates(settings.client_rate_limit_per_s, settings.client_rate_limit_burst)
        self.refusals: Counter[int] = Counter()
        """Requests and connections refused before routing, by status (401, 408, 413, 429, ...)."""
        self.refused: Counter[str] = Counter({r: 0 for r in REFUSAL_REASONS})
        """The same by reason (`kunlun_gateway_refused_total{reason}`)."""

    def count_refusal(self, status: int, reason: str = "") -> None:
        self.refusals[status] += 1
        self.refused[reason or REASON_OF_STATUS.get(status, "malformed")] += 1

    def protocol(self) -> ClientProtocol:
        return ClientProtocol(self)

    async def sweep(self) -> None:
        """Apply the connections' deadlines (slow heads and bodies, idle keep-alive, lingering)."""
        s = self.settings
        tick = max(0.05, min(0.5, min(s.header_timeout_s, s.body_timeout_s, s.keepalive_timeout_s) / 4))
        while True:
            await asyncio.sleep(tick)
            now = self.loop.time()
            for c in [c for c in self.clients if c.deadline and c.deadline <= now]:
                c.expired(now)

    # ------------------------------------------------------------------ admission (request head only)
    def admit(self, url: bytes, auth: bytes | None, peer: str = "") -> Refusal | None:
        """None when the request may go on, else why not: the client address's rate, the key and
        its rate, from the head alone."""
        path = url.split(b"?", 1)[0]
        if self.client_rates.active and peer and path not in _HEALTH:
            wait = self.client_rates.check(peer, self.loop.time())
            if wait:
                s = self.settings
                msg = (
                    f"request rate of client {peer} over client_rate_limit_per_s "
                    f"({s.client_rate_limit_per_s:g}/s); retry in {wait} s"
                )
                return 429, msg, b"retry-after: %d\r\n" % wait, "client_rate"
        if not (path in _KEYED or path.startswith(endpoints.PREFIX)):
            return None
        why, identity = self.keys.identify(auth)
        if why is not None:
            if not self.keys.loaded:
                msg = "API keys are required but none were received from the control plane yet"
                return 503, msg, b"retry-after: 1\r\n", "keys_not_loaded"
            return 401, why, b"www-authenticate: Bearer\r\n", "api_key"
        if identity and self.limits.active:
            wait = self.limits.check(identity, self.loop.time())
            if wait:
                msg = f"rate limit of API key {identity} reached; retry in {wait} s"
                return 429, msg, b"retry-after: %d\r\n" % wait, "key_rate"
        return None

    # ------------------------------------------------------------------ routes
    def handle(self, client: ClientProtocol, req: Request) -> None:
        if req.refusal is not None:
            status, message, extra, reason = req.refusal
            if req.method:  # refused from its head, no body: answered in turn, connection kept
                self.count_refusal(status, reason)
            client.error(status, message, req.keep_alive, extra)
            return
        path = req.url.split(b"?", 1)[0]
        fwd, _, session, trace = _scan(req.headers, self.keys.required)
        if path in _INFERENCE:
            if req.method != b"POST":
                client.error(405, f"{path.decode()} takes POST", req.keep_alive)
                return
            self._inference(client, req, fwd + b"x-request-id: %s\r\n" % trace, session, trace)
            return
        if path == b"/health" or path == b"/health_generate":
            self._health(client, req)
            return
        if path == b"/v1/models" or path == b"/kunlun/status":
            if req.method != b"GET":
                client.error(405, f"{path.decode()} takes GET", req.keep_alive)
            else:
                body = self._models() if path == b"/v1/models" else self.status()
                client.reply(200, json.dumps(body, separators=(",", ":")).encode(), req.keep_alive)
            return
        if path.startswith(endpoints.PREFIX):
            endpoints.serve(self, client, req, path)
            return
        client.error(404, f"no route {path.decode('latin-1')}", req.keep_alive)

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

    def _inference(
        self, client: ClientProtocol, req: Request, fwd: bytes, session: bytes | None, trace: bytes = b""
    ) -> None:
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
        ex = Exchange(self, client, req, wl, key, head, tail, variant, trace.decode("ascii"))
        client.exchange = ex
        self.inflight += 1
        ex.start()


def _scan(
    headers: list[tuple[bytes, bytes]], strip_auth: bool
) -> tuple[bytes, bytes | None, bytes | None, bytes]:
    """(headers to forward, Authorization value, x-session-id value, trace id).

    The trace id is the client's `x-request-id` when it is a plain token (1-64 of
    `[A-Za-z0-9._-]`), else a new random one; it is forwarded to the engine by the caller (the
    client's own header is not), and logged with the request."""
    out: list[bytes] = []
    auth = session = None
    trace = b""
    for name, value in headers:
        low = name.lower()
        if low == b"authorization":
            auth = value
            if strip_auth:
                continue
        elif low == b"x-request-id":
            if _TRACE_RE.fullmatch(value):
                trace = value
            continue
        elif low == b"x-session-id":
            session = value
        elif low in _HOP:
            continue
        out.append(b"%s: %s\r\n" % (name, value))
    return b"".join(out), auth, session, trace or secrets.token_hex(8).encode()
