"""One proxied request: attempts on instances, the request timeout, and the response relay.

An Exchange is the `upstream.Sink` of the connection that carries its current attempt. Each attempt
takes one in-flight slot of its instance (given back exactly once, whatever ends the attempt). A
failure before any byte reached the client is retried on an instance not tried yet (`retries`);
after that, a broken upstream cuts the client's response (the client sees a truncated stream, never
a made-up one). `request_timeout_s` bounds the wait for the first byte and each silence after it.
"""

from __future__ import annotations

import asyncio
import random
import secrets
from typing import TYPE_CHECKING

import structlog

from gateway.backends import Backend, WorkloadRoutes
from gateway.upstream import UpstreamConn

if TYPE_CHECKING:
    from gateway.client import ClientProtocol
    from gateway.proxy import Proxy
    from gateway.wire import Request

log = structlog.get_logger("gateway.proxy")


class Exchange:
    """One proxied request: attempts on instances, the timeout, and the response relay."""

    __slots__ = (
        "backend",
        "began",
        "client",
        "conn",
        "connecting",
        "done",
        "first_byte",
        "head",
        "key",
        "last",
        "last_error",
        "proxy",
        "refreshed",
        "req",
        "started",
        "tail",
        "timer",
        "trace",
        "tried",
        "variant",
        "wl",
    )

    def __init__(
        self,
        proxy: Proxy,
        client: ClientProtocol,
        req: Request,
        wl: WorkloadRoutes,
        key: str | None,
        head: bytes,
        tail: bytes,
        variant: str | None = None,
        trace: str = "",
    ) -> None:
        self.proxy = proxy
        self.trace = trace or secrets.token_hex(8)
        self.client = client
        self.req = req
        self.wl = wl
        self.key = key
        self.head = head
        self.tail = tail
        self.variant = variant
        self.tried: list[Backend] = []
        self.backend: Backend | None = None
        self.conn: UpstreamConn | None = None
        self.connecting: asyncio.Task[None] | None = None
        self.started = False
        self.refreshed = False
        self.done = False
        self.last_error = ""
        self.last = 0.0
        self.began = 0.0
        self.first_byte = 0.0
        self.timer: asyncio.TimerHandle | None = None

    def start(self) -> None:
        loop = self.proxy.loop
        self.last = self.began = loop.time()
        self.timer = loop.call_later(self.proxy.settings.request_timeout_s, self._on_timer)
        self._dispatch()

    def _dispatch(self) -> None:
        picked = self.proxy.registry.pick(self.wl, self.key, self.tried, self.variant)
        if isinstance(picked, str):
            if self.tried:
                self._error(502, f"instance {self.last_error}; no other instance to retry on ({picked})")
            else:
                self._error(503, picked, b"retry-after: 1\r\n")
            return
        self.tried.append(picked)
        self._attempt(picked, fresh=False)

    def _attempt(self, b: Backend, fresh: bool) -> None:
        b.inflight += 1
        b.requests += 1
        self.backend = b
        conn = None if fresh else b.pool.acquire()
        if conn is None:
            self.connecting = self.proxy.loop.create_task(self._connect(b))
        else:
            self._send(conn)

    async def _connect(self, b: Backend) -> None:
        try:
            conn = await b.pool.connect()
        except (OSError, TimeoutError) as e:
            self.connecting = None
            if self.backend is b and not self.done:
                self.upstream_failed(f"cannot connect ({e or 'timed out'})", "connect", False)
            return
        self.connecting = None
        if self.done or self.backend is not b:
            conn.detach()
            return
        self._send(conn)

    def _send(self, conn: UpstreamConn) -> None:
        self.conn = conn
        assert self.backend is not None
        conn.send(self, (self.head, self.backend.host_header, self.tail, self.req.body))

    def _release(self) -> Backend | None:
        b, self.backend = self.backend, None
        if b is not None:
            b.inflight -= 1
        return b

    def _record(self, status: int) -> None:
        """Count the request for its workload and version (the last instance tried decides)."""
        variant = self.tried[-1].variant if self.tried else (self.variant or "")
        seconds = self.proxy.loop.time() - self.began
        reg = self.proxy.registry
        reg.stats.record(self.wl.name, variant, seconds, status >= 500)
        ttfb = self.first_byte - self.began if self.first_byte else None
        reg.metrics.record(self.wl.name, variant, status, seconds, ttfb)
        sample = self.proxy.settings.access_log_sample
        if status >= 400 or (sample > 0 and (sample >= 1 or random.random() < sample)):
            last = self.tried[-1] if self.tried else None
            log.info(
                "access",
                trace_id=self.trace,
                method=self.req.method.decode("latin-1"),
                path=self.req.url.split(b"?", 1)[0].decode("latin-1"),
                workload=self.wl.name,
                version=variant or "baseline",
                instance=last.address if last is not None else "",
                status=status,
                attempts=len(self.tried),
                ms=round(seconds * 1000, 1),
                ttfb_ms=None if ttfb is None else round(ttfb * 1000, 1),
                bytes_in=len(self.req.body),
            )

    def _finish(self, keep_alive: bool, status: int) -> None:
        self.done = True
        self._record(status)
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.proxy.inflight -= 1
        self.client.finished(keep_alive and self.req.keep_alive)

    def _error(self, status: int, message: str, extra: bytes = b"") -> None:
        self.done = True
        self._record(status)
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.proxy.inflight -= 1
        self.client.error(status, message, self.req.keep_alive, extra)

    # --- upstream.Sink
    def may_retry(self) -> bool:
        if self.done or len(self.tried) > self.proxy.settings.retries:
            return False
        return any(b not in self.tried for b in self.wl.backends)

    def upstream_data(self, data: bytes) -> None:
        self.started = True
        self.last = self.proxy.loop.time()
        if not self.first_byte:
            self.first_byte = self.last
        t = self.client.transport
        if t is not None:
            t.write(data)

    def upstream_done(self, keep_alive: bool) -> None:
        status = self.conn.status if self.conn is not None else 0
        self.conn = None
        b = self._release()
        if b is not None:
            self.proxy.registry.succeeded(b)
        self._finish(keep_alive, status)

    def upstream_failed(self, reason: str, kind: str, reused: bool) -> None:
        self.conn = None
        b = self._release()
        if b is None or self.done:
            return
        if kind == "reset" and reused and not self.refreshed and not b.removed:
            # the pooled keep-alive connection had gone stale (the engine closed it as we sent):
            # once, the same instance on a new connection, not counted as the instance failing
            self.refreshed = True
            self._attempt(b, fresh=True)
            return
        self.proxy.registry.failed(b, kind, reason, reused)
        self.last_error = f"{b.instance_id} ({b.address}) of workload {self.wl.name!r} failed: {reason}"
        if len(self.tried) <= self.proxy.settings.retries:
            log.info("retrying on another instance", error=self.last_error)
            self.proxy.registry.metrics.retry(self.wl.name)
            self._dispatch()
        else:
            self._error(502, f"instance {self.last_error}")

    def upstream_broken(self, reason: str) -> None:
        self.conn = None
        b = self._release()
        if b is not None:
            self.proxy.registry.failed(b, "reset", reason, True)
            log.warning("response cut", instance=b.instance_id, workload=self.wl.name, reason=reason)
        self._finish(False, 502)  # the response was cut: counted as failed

    # --- timeouts and the client going away
    def _on_timer(self) -> None:
        self.timer = None
        if self.done:
            return
        loop = self.proxy.loop
        timeout = self.proxy.settings.request_timeout_s
        idle = loop.time() - self.last
        if idle < timeout:
            self.timer = loop.call_later(timeout - idle, self._on_timer)
            return
        self._drop_upstream()
        b = self._release()
        what = f"instance {b.instance_id} ({b.address})" if b is not None else "no instance"
        if b is not None:
            self.proxy.registry.failed(b, "timeout", f"no answer within {timeout:g}s")
        if self.started:
            log.warning("response timed out mid-way", workload=self.wl.name, instance=what)
            self._finish(False, 504)
        else:
            self._error(504, f"{what} of workload {self.wl.name!r} did not answer within {timeout:g}s")

    def _drop_upstream(self) -> None:
        conn, self.conn = self.conn, None
        if conn is not None:
            conn.detach()
        task, self.connecting = self.connecting, None
        if task is not None:
            task.cancel()

    def abort(self) -> None:
        """The client went away."""
        if self.done:
            return
        self.done = True
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self._drop_upstream()
        self._release()
        self.proxy.inflight -= 1

    def pause(self) -> None:
        if self.conn is not None:
            self.conn.pause()

    def resume(self) -> None:
        if self.conn is not None:
            self.conn.resume()
