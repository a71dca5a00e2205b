"""Pooled keep-alive HTTP/1.1 connections to one engine instance; response bytes forwarded raw.

An `UpstreamConn` carries one request at a time. Response bytes are handed to the request's
`Sink` exactly as they arrive from the socket (no re-encoding, no copy), while httptools follows
the framing (content-length or chunked) only to know where the response ends. Until the response
head is complete nothing is forwarded, so a 502/503/504 answer can still be retried elsewhere.
Idle connections are kept LIFO (the warmest first); a connection the engine closed leaves the pool
by itself (connection_lost).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Protocol, cast

import httptools

RETRYABLE_STATUS = frozenset((502, 503, 504))


class Sink(Protocol):
    """The request an upstream connection serves (proxy.Exchange)."""

    def may_retry(self) -> bool:
        """True while nothing reached the client and a retry is left."""

    def upstream_data(self, data: bytes) -> None:
        """Response bytes, to forward as they are."""

    def upstream_done(self, keep_alive: bool) -> None:
        """The response ended (the connection is back in the pool or closed)."""

    def upstream_failed(self, reason: str, kind: str, reused: bool) -> None:
        """Nothing was forwarded and the request failed: kind is "connect", "reset" or "status"."""

    def upstream_broken(self, reason: str) -> None:
        """The connection failed after bytes were forwarded (the client's response is cut)."""


class UpstreamConn(asyncio.Protocol):
    __slots__ = (
        "complete",
        "forwarded",
        "head_done",
        "held",
        "keep_alive",
        "parser",
        "paused",
        "pool",
        "reused",
        "sink",
        "status",
        "transport",
    )

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.sink: Sink | None = None
        self.head_done = False
        self.complete = False
        self.forwarded = False
        self.keep_alive = True
        self.reused = False
        self.paused = False
        self.status = 0
        self.held: list[bytes] | None = None

    # --- used by the proxy
    def send(self, sink: Sink, data: Sequence[bytes]) -> None:
        self.sink = sink
        self.head_done = self.complete = self.forwarded = False
        self.held = None
        assert self.transport is not None
        if self.paused:
            self.resume()
        self.transport.writelines(data)

    def detach(self) -> None:
        """The request is over on our side (client gone, timeout): drop this connection."""
        self.sink = None
        if self.transport is not None:
            self.transport.close()

    def pause(self) -> None:
        if self.transport is not None and not self.paused:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.transport is not None and self.paused:
            self.paused = False
            self.transport.resume_reading()

    # --- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.pool.forget(self)
        sink, self.sink = self.sink, None
        if sink is None:
            return
        reason = f"connection lost ({exc})" if exc else "connection closed by the engine"
        if self.forwarded:
            sink.upstream_broken(reason)
        else:
            sink.upstream_failed(reason, "reset", self.reused)

    def data_received(self, data: bytes) -> None:
        sink = self.sink
        if sink is None:  # nothing asked: an engine closing an idle connection, or garbage
            if self.transport is not None:
                self.transport.close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self.sink = None
            assert self.transport is not None
            self.transport.close()
            if self.forwarded:
                sink.upstream_broken(f"malformed HTTP from the engine ({e})")
            else:
                sink.upstream_failed(f"malformed HTTP from the engine ({e})", "reset", self.reused)
            return
        if not self.forwarded:
            if not self.head_done:
                if self.held is None:
                    self.held = [data]
                else:
                    self.held.append(data)
                return
            if self.status in RETRYABLE_STATUS and sink.may_retry():
                self.sink = None
                assert self.transport is not None
                self.transport.close()
                sink.upstream_failed(f"answered HTTP {self.status}", "status", self.reused)
                return
            if self.held is not None:
                self.held.append(data)
                data = b"".join(self.held)
                self.held = None
            self.forwarded = True
        sink.upstream_data(data)
        if self.complete:
            self.sink = None
            keep = self.keep_alive
            if keep:
                self.pool.release(self)
            elif self.transport is not None:
                self.transport.close()
            sink.upstream_done(keep)

    # --- httptools callbacks
    def on_headers_complete(self) -> None:
        self.head_done = True
        self.status = self.parser.get_status_code()
        self.keep_alive = bool(self.parser.should_keep_alive())

    def on_message_complete(self) -> None:
        self.complete = True


class Pool:
    """Keep-alive connections to one instance."""

    __slots__ = ("closed", "connect_timeout", "host", "idle", "max_idle", "opened", "port")

    def __init__(self, host: str, port: int, max_idle: int, connect_timeout: float) -> None:
        self.host = host
        self.port = port
        self.max_idle = max_idle
        self.connect_timeout = connect_timeout
        self.idle: list[UpstreamConn] = []
        self.closed = False
        self.opened = 0

    def acquire(self) -> UpstreamConn | None:
        """An idle connection, or None (then `connect()`)."""
        idle = self.idle
        while idle:
            conn = idle.pop()
            t = conn.transport
            if t is not None and not t.is_closing():
                conn.reused = True
                return conn
        return None

    async def connect(self) -> UpstreamConn:
        """A new connection; OSError or TimeoutError when the instance cannot be reached."""
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.connect_timeout):
            _, conn = await loop.create_connection(lambda: UpstreamConn(self), self.host, self.port)
        self.opened += 1
        return conn

    def release(self, conn: UpstreamConn) -> None:
        if self.closed or len(self.idle) >= self.max_idle:
            if conn.transport is not None:
                conn.transport.close()
            return
        self.idle.append(conn)

    def forget(self, conn: UpstreamConn) -> None:
        try:
            self.idle.remove(conn)
        except ValueError:
            pass

    def close(self) -> None:
        """Close the idle connections; those in use close when their request ends."""
        self.closed = True
        idle, self.idle = self.idle, []
        for conn in idle:
            if conn.transport is not None:
                conn.transport.close()
