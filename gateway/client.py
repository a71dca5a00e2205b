"""One client connection (asyncio.Protocol + httptools): parsing, limits, deadlines, answers in order.

Hostile clients are handled on the request head, before any body byte is kept:

- the target and the head are counted as they arrive (414 over max_url_bytes, 431 over
  max_header_bytes or max_headers; a single endless header line is cut off too);
- the API key and the key's rate are checked once the head is complete (401 / 503 / 429), and a
  Content-Length over max_body_bytes is refused (413), all without reading the body;
- a refused request without a body is answered in turn and the keep-alive connection stays open;
  with a body, the answer goes out in turn, the rest of the request is never parsed nor kept, and
  the connection is closed after a short lingering close (the unread body is discarded for at most
  LINGER_S, so the client reads the answer instead of a reset);
- deadlines (checked by Proxy.sweep): the head within header_timeout_s of its first byte (of the
  connect for a new connection), the body within body_timeout_s of the head (408 and close),
  idle keep-alive connections closed after keepalive_timeout_s without an answer;
- pipelining: requests queue behind the one being answered; past max_pipelined queued requests or
  max_body_bytes of queued bodies, reading stops until answers went out (back-pressure).
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING, cast

import httptools
import structlog

from gateway.wire import REASON_OF_STATUS, REASONS, Refusal, Request, error_body

if TYPE_CHECKING:
    from gateway.exchange import Exchange
    from gateway.proxy import Proxy

log = structlog.get_logger("gateway.client")

# what the deadline of a connection stands for
NONE, FRESH, IDLE, HEAD, BODY, LINGER = range(6)
LINGER_S = 5.0
"""A refused connection's unread input is discarded for at most this long before it is closed."""
LINGER_QUIET_S = 0.5
"""... and closed earlier once the client sent nothing for this long."""


class _Stop(Exception):
    """Raised in a parser callback to stop parsing a refused connection."""


class ClientProtocol(asyncio.Protocol):
    """One client connection: keep-alive, pipelined requests answered in order."""

    def __init__(self, proxy: Proxy) -> None:
        self.proxy = proxy
        self.settings = proxy.settings
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.size = 0
        self.head_bytes = 0
        self.head_unparsed = 0
        self.auth: bytes | None = None
        self.content_length = -1
        self.chunked = False
        self.expect_continue = False
        self.refusal: Refusal | None = None
        self.pending: deque[Request] = deque()
        self.pending_bytes = 0
        self.busy = False
        self.reading = False
        self.in_head = False
        self.head_began_here = False
        self.stopped = False
        self.exchange: Exchange | None = None
        self.paused_reading = False
        self.deadline = 0.0
        self.kind = NONE
        self.linger_until = 0.0
        self.peer = ""
        """The client's address (the TCP peer), for the per-address rate limit."""

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = t = cast(asyncio.Transport, transport)
        proxy = self.proxy
        if len(proxy.clients) >= self.settings.max_connections:
            proxy.count_refusal(503, "max_connections")
            self.stopped = True
            body = error_body(
                503,
                f"the gateway holds its max_connections ({self.settings.max_connections}) client "
                "connections; retry shortly or use another gateway",
            )
            t.write(
                b"HTTP/1.1 503 Service Unavailable\r\nserver: kunlun-gateway\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\nretry-after: 1\r\nconnection: close\r\n\r\n%s" % (len(body), body)
            )
            t.close()
            return
        proxy.clients.add(self)
        peer = t.get_extra_info("peername")
        self.peer = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        self._expect(FRESH, self.settings.header_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.proxy.clients.discard(self)
        self.pending.clear()
        self.kind, self.deadline = NONE, 0.0
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
        if self.stopped:  # refused: the rest is discarded until the lingering close
            if self.kind == LINGER:
                self.deadline = min(self.linger_until, self.proxy.loop.time() + LINGER_QUIET_S)
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.refuse(400, "protocol upgrades are not supported")
        except httptools.HttpParserCallbackError as e:
            if not isinstance(e.__context__, _Stop):
                log.error("request handling failed", error=repr(e.__context__))
                self.refuse(400, f"request could not be handled ({e.__context__!r})")
        except httptools.HttpParserError as e:
            self.refuse(400, f"malformed HTTP request ({e})")
        if self.in_head and not self.stopped:
            # httptools keeps a header line until it ends: count the chunks spent inside one head
            if self.head_began_here:
                self.head_began_here = False
            else:
                self.head_unparsed += len(data)
                if self.head_unparsed > self.settings.max_header_bytes:
                    self.refuse(431, self._head_message())

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.url = b""
        self.headers = []
        self.body = []
        self.size = 0
        self.head_bytes = 0
        self.head_unparsed = 0
        self.auth = None
        self.content_length = -1
        self.chunked = False
        self.expect_continue = False
        self.refusal = None
        self.reading = self.in_head = self.head_began_here = True
        if self.kind == FRESH:  # a new connection's first head: counted from the connect
            self.kind = HEAD
        else:
            self._expect(HEAD, self.settings.header_timeout_s)

    def on_url(self, url: bytes) -> None:
        self.url += url
        if len(self.url) > self.settings.max_url_bytes:
            self.refuse(414, f"request target longer than max_url_bytes ({self.settings.max_url_bytes})")
            raise _Stop

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))
        self.head_bytes += len(name) + len(value) + 4
        s = self.settings
        if len(self.headers) > s.max_headers or self.head_bytes + len(self.url) > s.max_header_bytes:
            self.refuse(431, self._head_message())
            raise _Stop
        n = len(name)
        if n == 13 and name.lower() == b"authorization":
            self.auth = value
        elif n == 14 and name.lower() == b"content-length":
            try:
                self.content_length = int(value)
            except ValueError:
                self.content_length = -1  # the parser refuses it
        elif n == 17 and name.lower() == b"transfer-encoding":
            self.chunked = b"chunked" in value.lower()
        elif n == 6 and name.lower() == b"expect" and value.lower() == b"100-continue":
            self.expect_continue = True

    def on_headers_complete(self) -> None:
        self.in_head = False
        s = self.settings
        refusal = self.proxy.admit(
            self.url, self.auth, self.peer
        )  # the key first: strangers learn nothing more
        if refusal is None and self.content_length > s.max_body_bytes:
            msg = f"request body of {self.content_length} bytes is over max_body_bytes ({s.max_body_bytes})"
            refusal = (413, msg, b"", "body_too_large")
        if refusal is not None:
            if self.content_length > 0 or self.chunked:
                self.refuse(*refusal)
                raise _Stop
            self.refusal = refusal  # no body: answered in turn, the connection stays open
        elif self.expect_continue and not self.busy and self.transport is not None:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        self._expect(BODY, s.body_timeout_s)

    def on_body(self, body: bytes) -> None:
        self.size += len(body)
        if self.size > self.settings.max_body_bytes:
            self.refuse(413, f"request body is over max_body_bytes ({self.settings.max_body_bytes})")
            raise _Stop
        self.body.append(body)

    def on_message_complete(self) -> None:
        p = self.parser
        self.reading = False
        self.kind, self.deadline = NONE, 0.0
        body = self.body[0] if len(self.body) == 1 else b"".join(self.body)
        self.body = []
        req = Request(
            p.get_method(),
            self.url,
            self.headers,
            body,
            bool(p.should_keep_alive()),
            p.get_http_version() == "1.0",
            self.refusal,
        )
        self._queue(req)

    # refusals and deadlines
    def _head_message(self) -> str:
        s = self.settings
        return f"request head over max_header_bytes ({s.max_header_bytes}) or max_headers ({s.max_headers})"

    def refuse(self, status: int, message: str, extra: bytes = b"", reason: str = "") -> None:
        """Answer `status` in turn, parse nothing more, close after the answer (lingering)."""
        if self.stopped:
            return
        self.stopped = True
        reason = reason or REASON_OF_STATUS.get(status, "malformed")
        self.proxy.count_refusal(status, reason)
        self.kind, self.deadline = NONE, 0.0
        self.reading = self.in_head = False
        t = self.transport
        if t is not None and not self.paused_reading:
            t.pause_reading()
            self.paused_reading = True
        self._queue(Request(b"", b"", [], b"", False, False, (status, message, extra, reason)))

    def _queue(self, req: Request) -> None:
        if self.busy:
            self.pending.append(req)
            self.pending_bytes += len(req.body)
            s = self.settings
            t = self.transport
            full = len(self.pending) >= s.max_pipelined or self.pending_bytes >= s.max_body_bytes
            if full and t is not None and not self.paused_reading:
                t.pause_reading()
                self.paused_reading = True
            return
        self.busy = True
        self.proxy.handle(self, req)

    def _expect(self, kind: int, within_s: float) -> None:
        self.kind = kind
        self.deadline = self.proxy.loop.time() + within_s

    def expired(self, now: float) -> None:
        """The deadline passed (Proxy.sweep)."""
        kind, t = self.kind, self.transport
        if t is None or kind == NONE:
            return
        if kind in (FRESH, IDLE, LINGER):
            self.kind, self.deadline = NONE, 0.0
            t.close()
        elif self.paused_reading:  # not reading on purpose (back-pressure): not the client's delay
            self.deadline = now + (
                self.settings.header_timeout_s if kind == HEAD else self.settings.body_timeout_s
            )
        elif kind == HEAD:
            self.refuse(
                408, f"request head not received within header_timeout_s ({self.settings.header_timeout_s} s)"
            )
        else:
            self.refuse(
                408, f"request body not received within body_timeout_s ({self.settings.body_timeout_s} s)"
            )

    def _linger(self, t: asyncio.Transport) -> None:
        """Close after the refusal: first let the client's unread input drain (discarded)."""
        if t.can_write_eof():
            t.write_eof()
        now = self.proxy.loop.time()
        self.linger_until = now + LINGER_S
        self.kind, self.deadline = LINGER, now + LINGER_QUIET_S
        if self.paused_reading:
            t.resume_reading()
            self.paused_reading = False

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
                % (status, REASONS.get(status, b"Error"), content_type, len(body), extra, close, body)
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
            self.pending_bytes = 0
            if self.stopped:
                self._linger(t)
            else:
                t.close()
            return
        if self.pending:
            req = self.pending.popleft()
            self.pending_bytes -= len(req.body)
            s = self.settings
            if (
                self.paused_reading
                and not self.stopped
                and len(self.pending) <= s.max_pipelined // 2
                and self.pending_bytes < s.max_body_bytes // 2
            ):
                t.resume_reading()
                self.paused_reading = False
            self.proxy.handle(self, req)
        else:
            self.busy = False
            if not self.reading and not self.stopped:
                self._expect(IDLE, self.settings.keepalive_timeout_s)
