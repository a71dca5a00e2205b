"""The Prometheus exporter endpoint every process serves: `GET /metrics` over HTTPS with mutual TLS.

Authentication is the cluster's own: the exporter presents the process's certificate and requires
a client certificate signed by the cluster CA whose role (OU) is `monitoring` (`kunlun-cli certs
init` issues `monitoring/prometheus.crt`). We chose mTLS over a bearer token because every process
already holds cluster certificates, a token would be one more secret to distribute, rotate and keep
out of logs, and Prometheus's `tls_config` speaks mTLS natively. Any other role is answered 403.

Each process keeps its own metrics module (controlplane/metrics.py, node_agent/metrics.py,
gateway/metrics.py) and hands this server a registry plus a `prepare` coroutine. A scrape runs
`prepare()` on the event loop (it copies the process's in-memory state into plain values, cheap and
race-free), then renders the text format in a worker thread, so the loop never blocks on
formatting. Scrapes are serialised (one at a time); a slow or silent client is cut after
`CLIENT_TIMEOUT_S`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Awaitable, Callable, Iterator

import structlog
from cryptography import x509
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from kunlun_common.errors import ConfigError
from kunlun_common.messages import msg
from kunlun_common.revocation import RevokedSerials
from kunlun_common.tls import TlsMaterial, identity_of

log = structlog.get_logger("metrics")
ALLOWED_ROLES = ("monitoring",)
CLIENT_TIMEOUT_S = 10.0
MAX_HEADER_BYTES = 16 * 1024


def split_listen(address: str, what: str = "metrics_listen") -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(
            msg(
                "settings.listen_address",
                "{what}: expected host:port (port 0 picks a free one), found {found!r}",
                what=what,
                found=address,
            )
        )
    return host.strip("[]"), int(port)


def server_context(material: TlsMaterial) -> ssl.SSLContext:
    """TLS context of the exporter: our certificate, and a client certificate from the cluster CA."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_verify_locations(cadata=material.ca.decode())
    load_pair(ctx, material)
    return ctx


def load_pair(ctx: ssl.SSLContext, material: TlsMaterial) -> None:
    """Put `material`'s certificate and key into `ctx` (again on reload: new handshakes use it)."""
    import os
    import tempfile

    # ssl wants files for the key pair: load from the process's own certificate folder when the paths
    # hold exactly the loaded material, else from a private temporary copy removed at once
    paths = material.paths
    try:
        if paths.cert.read_bytes() == material.cert and paths.key.read_bytes() == material.key:
            ctx.load_cert_chain(str(paths.cert), str(paths.key))
            return
    except OSError:
        pass
    fd, tmp = tempfile.mkstemp(prefix="kunlun-metrics-", suffix=".pem")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(material.cert + b"\n" + material.key)
        ctx.load_cert_chain(tmp)
    finally:
        os.unlink(tmp)


class CertificateCollector(Collector):
    """`kunlun_certificate_expiry_timestamp_seconds` of the process's own certificate and its CA."""

    def __init__(self, material: TlsMaterial) -> None:
        self.update(material)

    def update(self, material: TlsMaterial) -> None:
        cert = x509.load_pem_x509_certificate(material.cert)
        ca = x509.load_pem_x509_certificate(material.ca)
        ident = material.identity
        self.rows = [
            (ident.role, ident.name, cert.not_valid_after_utc.timestamp()),
            ("ca", "ca", ca.not_valid_after_utc.timestamp()),
        ]

    def collect(self) -> Iterator[Metric]:
        g = GaugeMetricFamily(
            "kunlun_certificate_expiry_timestamp_seconds",
            "Unix time at which the process's certificate (and the cluster CA) expires",
            labels=("role", "name"),
        )
        for role, name, at in self.rows:
            g.add_metric([role, name], at)
        yield g


class MetricsServer:
    """`GET /metrics` on `listen` (HTTPS, mTLS, role `monitoring`), rendering `registry`."""

    def __init__(
        self,
        listen: str,
        material: TlsMaterial,
        registry: CollectorRegistry,
        prepare: Callable[[], Awaitable[None]] | None = None,
        revoked: RevokedSerials | None = None,
    ) -> None:
        self.listen = listen
        self.revoked = revoked
        self.material = material
        self.registry = registry
        self.prepare = prepare
        self.server: asyncio.AbstractServer | None = None
        self.address = ""
        self.scrapes = 0
        self._lock = asyncio.Lock()
        self.cert_rows = CertificateCollector(material)
        registry.register(self.cert_rows)
        self.ctx: ssl.SSLContext | None = None

    async def start(self) -> str:
        """Start serving; return the bound host:port (port 0 in `listen` picks a free one)."""
        host, port = split_listen(self.listen)
        try:
            self.server = await asyncio.start_server(
                self._client, host, port, ssl=self._context(), limit=MAX_HEADER_BYTES
            )
        except OSError as e:
            raise ConfigError(
                msg(
                    "settings.cannot_listen",
                    "{what}: cannot listen on {address} ({reason}); is the port in use?",
                    what="metrics_listen",
                    address=self.listen,
                    reason=e.strerror,
                )
            ) from None
        bound = self.server.sockets[0].getsockname()
        self.address = f"{host}:{bound[1]}"
        log.info("metrics exporter serving", address=self.address, scheme="https", client_role="monitoring")
        return self.address

    def _context(self) -> ssl.SSLContext:
        self.ctx = server_context(self.material)
        return self.ctx

    def reload(self, material: TlsMaterial) -> None:
        """Serve new connections with `material` (SIGHUP after `certs rotate`)."""
        self.material = material
        self.cert_rows.update(material)
        if self.ctx is not None:
            load_pair(self.ctx, material)

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.server.wait_closed(), 2.0)
            self.server = None

    async def render(self) -> bytes:
        """One scrape's body (also used by benchmarks and tests)."""
        async with self._lock:
            if self.prepare is not None:
                await self.prepare()
            body = await asyncio.to_thread(generate_latest, self.registry)
            self.scrapes += 1
            return body

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(CLIENT_TIMEOUT_S):
                head = await reader.readuntil(b"\r\n\r\n")
                status, ctype, body = await self._answer(head, writer)
                writer.write(
                    b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
                    % (status, _REASONS.get(status, b"Error"), ctype.encode(), len(body))
                )
                writer.write(body)
                await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        except ssl.SSLError:
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _answer(self, head: bytes, writer: asyncio.StreamWriter) -> tuple[int, str, bytes]:
        text = "text/plain; charset=utf-8"
        line = head.split(b"\r\n", 1)[0].split()
        if len(line) != 3 or not line[2].startswith(b"HTTP/1."):
            return 400, text, b"bad request line\n"
        ssl_obj = writer.get_extra_info("ssl_object")
        der = ssl_obj.getpeercert(binary_form=True) if ssl_obj is not None else None
        if not der:
            return 401, text, b"a client certificate signed by the cluster CA is required\n"
        cert = x509.load_der_x509_certificate(der)
        ident = identity_of(cert)
        if self.revoked is not None and self.revoked.revoked(cert):
            log.warning("refused revoked certificate", identity=str(ident), serial=f"{cert.serial_number:x}")
            return 403, text, f"certificate serial {cert.serial_number:x} ({ident}) was revoked\n".encode()
        if ident.role not in ALLOWED_ROLES:
            log.warning("refused metrics scrape", identity=str(ident), allowed=list(ALLOWED_ROLES))
            return 403, text, f"{ident} may not scrape metrics (allowed roles: monitoring)\n".encode()
        method, target = line[0], line[1].split(b"?", 1)[0]
        if target != b"/metrics":
            return 404, text, b"not found; metrics are at /metrics\n"
        if method not in (b"GET", b"HEAD"):
            return 405, text, b"only GET /metrics\n"
        body = await self.render()
        return 200, CONTENT_TYPE_LATEST, b"" if method == b"HEAD" else body


_REASONS = {
    200: b"OK",
    400: b"Bad Request",
    401: b"Unauthorized",
    403: b"Forbidden",
    404: b"Not Found",
    405: b"Method Not Allowed",
}
