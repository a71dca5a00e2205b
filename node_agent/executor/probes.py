"""HTTP probes of an engine: health (readiness and liveness) and one tiny generation (first-token time).

A minimal HTTP/1.1 client on asyncio streams (one request per connection, `Connection: close`),
enough for an engine's `/health` and `/v1/completions`; the agent needs no HTTP library for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class HttpResponse:
    """Status and body of one response."""

    status: int
    """HTTP status code."""
    body: bytes
    """The whole body (de-chunked)."""


def endpoint(host: str, port: int) -> str:
    """`host:port` (`[v6]:port` for an IPv6 literal)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    out = bytearray()
    while True:
        size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
        if size == 0:
            return bytes(out)
        out += await reader.readexactly(size)
        await reader.readline()


async def http_request(
    host: str, port: int, method: str, path: str, body: bytes | None = None, timeout_s: float = 2.0
) -> HttpResponse:
    """One request; raises OSError, TimeoutError or ValueError (a malformed answer)."""
    async with asyncio.timeout(timeout_s):
        reader, writer = await asyncio.open_connection(host, port)
        try:
            head = [f"{method} {path} HTTP/1.1", f"Host: {endpoint(host, port)}", "Connection: close"]
            if body is not None:
                head += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
            writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + (body or b""))
            await writer.drain()
            status_line = await reader.readline()
            parts = status_line.split()
            if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
                raise ValueError(f"not an HTTP response: {status_line[:80]!r}")
            headers: dict[str, str] = {}
            while True:
                line = await reader.readline()
                if line in (b"\r\n", b"\n", b""):
                    break
                name, _, value = line.decode("latin-1").partition(":")
                headers[name.strip().lower()] = value.strip()
            if headers.get("transfer-encoding", "").lower() == "chunked":
                data = await _read_chunked(reader)
            elif "content-length" in headers:
                data = await reader.readexactly(int(headers["content-length"]))
            else:
                data = await reader.read()
            return HttpResponse(int(parts[1]), data)
        finally:
            writer.close()
            with contextlib.suppress(OSError, asyncio.CancelledError):
                await writer.wait_closed()


async def probe_health(host: str, port: int, path: str, timeout_s: float) -> str | None:
    """None when the engine answers `path` with a 2xx status; otherwise why not (one line)."""
    try:
        resp = await http_request(host, port, "GET", path, timeout_s=timeout_s)
    except TimeoutError:
        return f"GET {path} timed out after {timeout_s:g}s"
    except (OSError, ValueError, asyncio.IncompleteReadError) as e:
        return f"GET {path}: {e.strerror if isinstance(e, OSError) and e.strerror else e}"
    if 200 <= resp.status < 300:
        return None
    return f"GET {path} answered {resp.status}"


async def first_token_ms(host: str, port: int, model: str, timeout_s: float = 60.0) -> float | None:
    """Milliseconds one tiny generation (1 token) takes; None when the engine does not answer it."""
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0}).encode()
    started = time.monotonic()
    try:
        resp = await http_request(host, port, "POST", "/v1/completions", body, timeout_s=timeout_s)
    except (OSError, TimeoutError, ValueError, asyncio.IncompleteReadError):
        return None
    if resp.status != 200:
        return None
    return (time.monotonic() - started) * 1000.0
