"""What the gateway's client side exchanges: one parsed request, and the JSON error answer."""

from __future__ import annotations

import json

REASONS = {
    200: b"OK",
    400: b"Bad Request",
    401: b"Unauthorized",
    404: b"Not Found",
    405: b"Method Not Allowed",
    408: b"Request Timeout",
    413: b"Payload Too Large",
    414: b"URI Too Long",
    429: b"Too Many Requests",
    431: b"Request Header Fields Too Large",
    502: b"Bad Gateway",
    503: b"Service Unavailable",
    504: b"Gateway Timeout",
}
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    414: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}

Refusal = tuple[int, str, bytes, str]
"""(status, message, extra header lines, reason) of a request refused before it is routed; the
reason labels `kunlun_gateway_refused_total` (one of REFUSAL_REASONS)."""

REFUSAL_REASONS = (
    "malformed",
    "api_key",
    "keys_not_loaded",
    "key_rate",
    "client_rate",
    "body_too_large",
    "url_too_long",
    "head_too_large",
    "timeout",
    "max_connections",
)
"""Why the gateway refused a request or a connection before routing it."""
REASON_OF_STATUS = {
    400: "malformed",
    401: "api_key",
    408: "timeout",
    413: "body_too_large",
    414: "url_too_long",
    429: "key_rate",
    431: "head_too_large",
    503: "max_connections",
}
"""The reason of a refusal made without naming one."""


def error_body(status: int, message: str) -> bytes:
    err = {"message": message, "type": _TYPES.get(status, "error"), "param": None, "code": status}
    return json.dumps({"error": err}, separators=(",", ":")).encode()


class Request:
    __slots__ = ("body", "headers", "http10", "keep_alive", "method", "refusal", "url")

    def __init__(
        self,
        method: bytes,
        url: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        keep_alive: bool,
        http10: bool,
        refusal: Refusal | None = None,
    ) -> None:
        self.method = method
        self.url = url
        self.headers = headers
        self.body = body
        self.keep_alive = keep_alive
        self.http10 = http10
        self.refusal = refusal
        """Set when the head was refused (key, rate, limits, timeout): answered in turn, never routed."""
