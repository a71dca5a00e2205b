"""A small asyncio HTTP/1.1 client (httptools): health checks, the sglang-router sync, tests, bench.

One `HttpConnection` carries one request at a time over a keep-alive connection. `request()`
returns the whole response; `stream()` yields body pieces as they arrive (for SSE), with the
status and headers known first. Not the proxy's hot path (that is upstream.py).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import httptools


class HttpError(Exception):
    """The connection failed, closed early, or the response was not HTTP."""


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes = b""
    chunks: list[bytes] = field(default_factory=list)

    def json(self) -> Any:
        import json

        return json.loads(self.body)


class _Proto(asyncio.Protocol):
    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.head: asyncio.Future[Response] | None = None
        self.done: asyncio.Future[Response] | None = None
        self.pieces: asyncio.Queue[bytes | None] | None = None
        self.resp = Response(0, {})
        self.keep_alive = True
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(HttpError(f"malformed HTTP response: {e}"))
            if self.transport is not None:
                self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._fail(HttpError(f"connection closed before the response ended ({exc or 'EOF'})"))

    def _fail(self, err: Exception) -> None:
        for fut in (self.head, self.done):
            if fut is not None and not fut.done():
                fut.set_exception(err)
        if self.pieces is not None:
            self.pieces.put_nowait(None)

    def on_header(self, name: bytes, value: bytes) -> None:
        self.resp.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.resp.status = self.parser.get_status_code()
        self.keep_alive = bool(self.parser.should_keep_alive())
        if self.head is not None and not self.head.done():
            self.head.set_result(self.resp)

    def on_body(self, body: bytes) -> None:
        if self.pieces is not None:
            self.pieces.put_nowait(body)
        else:
            self.resp.chunks.append(body)

    def on_message_complete(self) -> None:
        self.resp.body = b"".join(self.resp.chunks)
        if self.pieces is not None:
            self.pieces.put_nowait(None)
            self.pieces = None
        if self.done is not None and not self.done.done():
            self.done.set_result(self.resp)


class HttpConnection:
    """A keep-alive connection to host:port; `request()` / `stream()` one at a time."""

    def __init__(self, host: str, port: int, tls: ssl.SSLContext | None = None) -> None:
        self.host = host
        self.port = port
        self.tls = tls
        self._proto: _Proto | None = None

    async def _ensure(self, timeout_s: float) -> _Proto:
        p = self._proto
        if p is not None and not p.lost and p.keep_alive:
            return p
        await self.close()
        loop = asyncio.get_running_loop()
        try:
            _, proto = await asyncio.wait_for(
                loop.create_connection(
                    _Proto,
                    self.host,
                    self.port,
                    ssl=self.tls,
                    server_hostname=self.host if self.tls else None,
                ),
                timeout_s,
            )
        except (OSError, TimeoutError) as e:
            raise HttpError(f"cannot connect to {self.host}:{self.port}: {e or 'timed out'}") from None
        self._proto = proto
        return proto

    def _encode(self, method: str, path: str, body: bytes | None, headers: Mapping[str, str] | None) -> bytes:
        lines = [f"{method} {path} HTTP/1.1", f"host: {self.host}:{self.port}"]
        for k, v in (headers or {}).items():
            lines.append(f"{k}: {v}")
        if body is not None or method in ("POST", "PUT", "PATCH"):
            lines.append(f"content-length: {len(body or b'')}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b"")

    def _start(self, proto: _Proto, data: bytes, streaming: bool) -> None:
        loop = asyncio.get_running_loop()
        proto.resp = Response(0, {})
        proto.head = loop.create_future()
        proto.done = loop.create_future()
        proto.pieces = asyncio.Queue() if streaming else None
        assert proto.transport is not None
        proto.transport.write(data)

    async def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        timeout_s: float = 30.0,
    ) -> Response:
        """Send one request and return the whole response; HttpError on failure or timeout."""
        proto = await self._ensure(timeout_s)
        self._start(proto, self._encode(method, path, body, headers), streaming=False)
        assert proto.done is not None
        try:
            return await asyncio.wait_for(asyncio.shield(proto.done), timeout_s)
        except TimeoutError:
            await self.close()
            raise HttpError(f"no complete answer from {self.host}:{self.port} within {timeout_s}s") from None
        finally:
            assert proto.head is not None
            if proto.head.done() and not proto.head.cancelled():
                proto.head.exception()  # consumed: no "exception never retrieved"

    async def stream(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        timeout_s: float = 30.0,
    ) -> tuple[Response, AsyncIterator[bytes]]:
        """Send one request; return the status/headers and an iterator of body pieces as they come."""
        proto = await self._ensure(timeout_s)
        self._start(proto, self._encode(method, path, body, headers), streaming=True)
        assert proto.head is not None and proto.pieces is not None
        queue = proto.pieces
        try:
            resp = await asyncio.wait_for(asyncio.shield(proto.head), timeout_s)
        except TimeoutError:
            await self.close()
            raise HttpError(f"no answer from {self.host}:{self.port} within {timeout_s}s") from None

        async def pieces() -> AsyncIterator[bytes]:
            while True:
                try:
                    item = await asyncio.wait_for(queue.get(), timeout_s)
                except TimeoutError:
                    await self.close()
                    raise HttpError(f"{self.host}:{self.port} went silent for {timeout_s}s") from None
                if item is None:
                    done = proto.done
                    if done is not None and done.done() and done.exception() is not None:
                        raise cast(BaseException, done.exception())
                    return
                yield item

        return resp, pieces()

    async def close(self) -> None:
        p, self._proto = self._proto, None
        if p is not None and p.transport is not None:
            p.transport.close()
            for fut in (p.head, p.done):
                if fut is not None and not fut.done():
                    fut.cancel()
                elif fut is not None and not fut.cancelled():
                    fut.exception()


async def fetch(
    host: str,
    port: int,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: Mapping[str, str] | None = None,
    timeout_s: float = 5.0,
) -> Response:
    """One request on a fresh connection (closed afterwards)."""
    conn = HttpConnection(host, port)
    try:
        return await conn.request(method, path, body, headers, timeout_s)
    finally:
        await conn.close()
