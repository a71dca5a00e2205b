"""`kunlun-gateway`: run one gateway (the OpenAI-compatible data plane)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import ssl
import sys
import time
from typing import Any

import structlog

from gateway.auth import ApiKeys
from gateway.backends import HealthChecker, Registry
from gateway.https import HttpsCertificate
from gateway.metrics import GatewayExport, PoolRow
from gateway.proxy import Proxy
from gateway.settings import GatewaySettings, is_loopback, split_host_port
from kunlun_common import revocation
from kunlun_common.api import types_pb2, workload_pb2
from kunlun_common.errors import ConfigError, KunlunError
from kunlun_common.i18n import _, error_text
from kunlun_common.logs import log_json, setup_logging
from kunlun_common.messages import msg
from kunlun_common.profiling import Profiler, ProfilerCollector, ProfilingMode
from kunlun_common.revocation import RevokedSerials
from kunlun_common.settings import from_mapping, load_yaml_mapping
from kunlun_common.tls import TlsMaterial
from kunlun_common.version import version

log = structlog.get_logger("gateway")
VERSION = version()


class Gateway:
    """The HTTP server, the control-plane feed, health checks and the optional router sync."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.registry = Registry(settings)
        self.keys = ApiKeys(settings.require_api_key)
        self.material = None
        if settings.endpoints or settings.metrics_listen:
            from kunlun_common import tls

            self.material = tls.load_tls(settings.cert_paths(), expect_roles=("gateway",))
            if self.material.identity.name != settings.name:
                raise ConfigError(
                    msg(
                        "gateway.cert_name",
                        "{cert}: certificate is for gateway {cert_name!r} but this gateway is named {name!r}",
                        cert=str(settings.cert_paths().cert),
                        cert_name=self.material.identity.name,
                        name=settings.name,
                    )
                )
        elif settings.require_api_key:
            raise ConfigError(
                msg(
                    "gateway.keys_need_endpoints",
                    "require_api_key: API keys come from the control plane; give endpoints",
                )
            )
        self.server: asyncio.AbstractServer | None = None
        self.proxy: Proxy | None = None
        self.feed: Any = None
        self.router_sync: Any = None
        self._tasks: list[asyncio.Task[None]] = []
        self.started = time.time()
        self.metrics: Any = None
        self.metrics_address = ""
        self.https: HttpsCertificate | None = None
        """The HTTPS listener's certificate (tls_cert/tls_key), reloaded on SIGHUP."""
        self.revoked = RevokedSerials()
        """Revoked serials, fetched from the replicas (the metrics exporter refuses them)."""
        self.profiler = Profiler(settings.profiling, f"gateway.{settings.name}")
        """Run-time profiling, switched by the replicas (scheduler settings) in the gateway config."""

    def _profiling(self, p: types_pb2.ProfilingSettings) -> None:
        self.profiler.apply(ProfilingMode(p.enabled, p.interval_ms))

    def reload_certificates(self) -> None:
        """SIGHUP after `kunlun-cli certs rotate`: re-read the HTTPS certificate (tls_cert/tls_key:
        new client connections get it) and the control-plane certificate (the next connection to a
        replica and every new scrape use it); open connections and streams carry on."""
        if self.https is not None:
            self.https.reload()
        if self.material is None:
            return
        from kunlun_common.reload import LiveTls

        live = LiveTls(self.material, expect_roles=("gateway",))
        if not live.reload():
            return
        self.material = live.material
        if self.feed is not None:
            self.feed.reload(self.material)
        if self.metrics is not None:
            self.metrics.reload(self.material)

    def _material(self) -> TlsMaterial:
        assert self.material is not None
        return self.material

    def _pool_rows(self) -> list[PoolRow]:
        now = time.monotonic()
        rows = []
        for wl in self.registry.served():
            row = PoolRow(wl.name, instances=len(wl.backends))
            for b in wl.backends:
                row.ejected += b.ejected_until > now
                row.inflight += b.inflight
                row.idle_connections += len(b.pool.idle)
                row.opened_connections += b.pool.opened
            rows.append(row)
        return rows

    async def _start_metrics(self) -> None:
        if not self.settings.metrics_listen or self.material is None:
            return
        from kunlun_common.metrics_http import MetricsServer

        export = GatewayExport(
            self.settings.name,
            self.registry.metrics,
            self._pool_rows,
            lambda: (self.proxy.inflight if self.proxy else 0, len(self.proxy.clients) if self.proxy else 0),
            lambda: dict(self.proxy.refused) if self.proxy else {},
        )
        export.registry.register(ProfilerCollector(self.profiler))
        self.metrics = MetricsServer(
            self.settings.metrics_listen, self.material, export.registry, export.prepare, revoked=self.revoked
        )
        self.metrics_address = await self.metrics.start()

    def status(self) -> dict[str, Any]:
        return {
            "name": self.settings.name,
            "uptime_s": round(time.time() - self.started, 1),
            "inflight": self.proxy.inflight if self.proxy else 0,
            "clients": len(self.proxy.clients) if self.proxy else 0,
            "synced": self.registry.synced,
            "api_keys": {
                "required": self.keys.required,
                "loaded": self.keys.loaded,
                "count": len(self.keys.hashes),
            },
            "refused": {str(k): v for k, v in sorted(self.proxy.refusals.items())} if self.proxy else {},
            "feed": self.feed.status() if self.feed is not None else {"static": True},
            "router_sync": self.router_sync.status() if self.router_sync is not None else None,
            "workloads": self.registry.status_json(),
        }

    def _changed(self) -> None:
        if self.router_sync is not None:
            self.router_sync.kick()

    async def _feed_after_first_list(self) -> None:
        """Trust a replica only once the revocation list is in (revocation.first_fetch): a fresh
        gateway knows no revocation before it."""
        await revocation.first_fetch(self.settings.endpoints, self._material, self.revoked)
        assert self.feed is not None
        await self.feed.run()

    async def start(self) -> None:
        s = self.settings
        loop = asyncio.get_running_loop()
        self.proxy = Proxy(s, self.registry, self.keys, self.status)
        self._tasks.append(asyncio.create_task(self.proxy.sweep(), name="gateway-deadlines"))
        _raise_open_files(s.max_connections)
        await self._start_metrics()
        if self.material is not None and s.endpoints:
            from gateway.feed import ControlPlaneFeed

            self.feed = ControlPlaneFeed(
                s,
                self.material,
                self.registry,
                self.keys,
                VERSION,
                self._changed,
                self._profiling,
                revoked=self.revoked,
            )
            self.feed.info.metrics_address = self.metrics_address
            self._tasks.append(asyncio.create_task(self._feed_after_first_list(), name="gateway-feed"))
            self._tasks.append(
                asyncio.create_task(
                    revocation.follow(s.endpoints, self._material, self.revoked), name="revocations"
                )
            )
        else:
            eps = [
                workload_pb2.Endpoint(instance_id=f"{w}-{i}", address=a, workload=w)
                for w, addrs in s.static_map().items()
                for i, a in enumerate(addrs)
            ]
            self.registry.apply_endpoints(eps)
        if self.feed is not None and s.start_sync_s > 0:
            await self._first_feed(s.start_sync_s)
        if s.health_check_interval_s > 0:
            checker = HealthChecker(self.registry, s)
            self._tasks.append(asyncio.create_task(checker.run(), name="gateway-health"))
        if s.sglang_router_url:
            from gateway.routersync import RouterSync

            self.router_sync = RouterSync(s.sglang_router_url, self.registry, s.sglang_router_workload)
            self._tasks.append(asyncio.create_task(self.router_sync.run(), name="gateway-router-sync"))
        ctx: ssl.SSLContext | None = None
        if s.tls_cert:
            self.https = HttpsCertificate(s.tls_cert, s.tls_key)
            ctx = self.https.context
        host, port = split_host_port(s.listen, "listen")
        proxy = self.proxy
        try:
            self.server = await loop.create_server(
                proxy.protocol,
                host,
                port,
                ssl=ctx,
                backlog=4096,
                reuse_address=True,
                ssl_handshake_timeout=s.header_timeout_s if ctx else None,
            )
        except OSError as e:
            raise ConfigError(
                msg(
                    "settings.cannot_listen",
                    "{what}: cannot listen on {address} ({reason}); is the port in use?",
                    what="listen",
                    address=s.listen,
                    reason=e.strerror,
                )
            ) from None
        log.info(
            "gateway serving",
            name=s.name,
            listen=s.listen,
            https=bool(ctx),
            replicas=list(s.endpoints),
            static=bool(s.static_endpoints),
            api_keys=s.require_api_key,
            max_connections=s.max_connections,
        )
        if ctx is None or not s.require_api_key:
            missing = " and ".join(
                w for w, off in (("plain HTTP", ctx is None), ("no API keys", not s.require_api_key)) if off
            )
            where = "on loopback" if is_loopback(host) else "allowed by allow_insecure_listen"
            log.warning(
                f"{missing} {where}: for development only; production configs set tls_cert/tls_key and "
                "require_api_key (deploy/examples/gateway.example.yaml)",
                listen=s.listen,
            )

    async def _first_feed(self, within_s: float) -> None:
        """Wait (at most `within_s`) for the first endpoint snapshot and, with keys required, the
        first key list: listening before would answer 503 to clients a peer gateway could serve."""
        loop = asyncio.get_running_loop()
        end = loop.time() + within_s
        while loop.time() < end:
            if self.registry.synced and (self.keys.loaded or not self.settings.require_api_key):
                return
            await asyncio.sleep(0.02)
        log.warning(
            "listening without a snapshot from the control plane (503 until it comes)",
            waited_s=within_s,
            endpoints_synced=self.registry.synced,
            keys_loaded=self.keys.loaded,
        )

    async def stop(self) -> None:
        """Stop accepting; let requests in flight finish (at most drain_s); close everything."""
        log.info("gateway stopping", name=self.settings.name)
        if self.server is not None:
            self.server.close()
        for _step in range(int(self.settings.drain_s / 0.05)):
            if self.proxy is None or self.proxy.inflight <= 0:
                break
            await asyncio.sleep(0.05)
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.proxy is not None:
            for c in list(self.proxy.clients):
                if c.transport is not None:
                    c.transport.close()
        self.registry.close()
        if self.metrics is not None:
            await self.metrics.stop()
        await asyncio.to_thread(self.profiler.close)


def _raise_open_files(connections: int) -> None:
    """Lift the soft open-files limit towards the hard one so max_connections can be reached."""
    import resource

    want = connections * 2 + 256  # a client and an engine connection each, plus the rest
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
        if soft < want:
            log.warning(
                "open-files limit below what max_connections needs; raise LimitNOFILE or lower max_connections",
                limit=soft,
                needed=want,
            )


async def serve(settings: GatewaySettings) -> None:
    """Run a gateway until SIGTERM/SIGINT."""
    gw = Gateway(settings)
    await gw.start()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, gw.reload_certificates)
    waiter = asyncio.create_task(stop.wait())
    done, _pending = await asyncio.wait([waiter, *gw._tasks], return_when=asyncio.FIRST_COMPLETED)
    for t in done:
        if t is not waiter and not t.cancelled() and t.exception() is not None:
            log.error("background task died", task=t.get_name(), error=str(t.exception()))
    waiter.cancel()
    await gw.stop()


def build_settings(argv: list[str] | None = None) -> GatewaySettings:
    p = argparse.ArgumentParser(prog="kunlun-gateway", description="Run a Kunlun Platform inference gateway.")
    p.add_argument("--config", help="YAML settings file (keys: the GatewaySettings fields)")
    p.add_argument("--name", help="gateway name (must match its certificate, role gateway)")
    p.add_argument("--listen", help="host:port for the HTTP API (default 127.0.0.1:8080)")
    p.add_argument("--advertise", help="host:port clients use to reach this gateway")
    p.add_argument("--endpoints", help="comma-separated replica addresses")
    p.add_argument("--cert-dir", help="certificate folder from `kunlun-cli certs init`")
    p.add_argument("--static-endpoints", help="no control plane: comma-separated WORKLOAD=HOST:PORT")
    p.add_argument("--tls-cert", help="PEM certificate for HTTPS (with --tls-key)")
    p.add_argument("--tls-key", help="PEM private key for HTTPS")
    p.add_argument(
        "--require-api-key", action="store_true", default=None, help="refuse requests without a key"
    )
    p.add_argument(
        "--allow-insecure-listen",
        action="store_true",
        default=None,
        help="allow plain HTTP or no API keys on a non-loopback address (behind a TLS proxy only)",
    )
    p.add_argument("--policy", dest="default_policy", help="default routing policy")
    p.add_argument("--request-timeout", type=float, help="seconds to the first byte / between bytes")
    p.add_argument("--connect-timeout", type=float, help="seconds to connect to an engine")
    p.add_argument("--max-inflight", type=int, help="requests in flight per instance")
    p.add_argument("--retries", type=int, help="retries on another instance before any byte was sent")
    p.add_argument("--health-interval", type=float, help="active health checks every N s (0: off)")
    p.add_argument("--health-timeout", type=float, help="health check timeout, seconds")
    p.add_argument("--eject-seconds", type=float, help="passive ejection period after errors")
    p.add_argument("--heartbeat-interval", type=float, help="registration heartbeat, seconds")
    p.add_argument("--sglang-router", help="http://host:port of an sglang-router to keep in sync")
    p.add_argument("--sglang-router-workload", help="mirror only this workload into the sglang-router")
    p.add_argument(
        "--metrics-listen", help="host:port of the Prometheus exporter (HTTPS, mTLS; port 0: free)"
    )
    p.add_argument("--log-level", help="debug, info, warning, error")
    p.add_argument(
        "--log-format",
        choices=["json", "console"],
        help="log lines as JSON or readable (default: JSON unless a tty)",
    )
    p.add_argument(
        "--profile-dir",
        help="folder of run-time profiles (Chrome trace files), written while the scheduler settings switch advanced_profiling on",
    )
    a = p.parse_args(argv)
    data: dict[str, Any] = load_yaml_mapping(a.config) if a.config else {}
    if a.profile_dir is not None:
        data["profiling"] = {**(data.get("profiling") or {}), "dir": a.profile_dir}
    for flag, key in (
        ("name", "name"),
        ("listen", "listen"),
        ("advertise", "advertise"),
        ("cert_dir", "cert_dir"),
        ("tls_cert", "tls_cert"),
        ("tls_key", "tls_key"),
        ("require_api_key", "require_api_key"),
        ("allow_insecure_listen", "allow_insecure_listen"),
        ("default_policy", "default_policy"),
        ("request_timeout", "request_timeout_s"),
        ("connect_timeout", "connect_timeout_s"),
        ("max_inflight", "max_inflight_per_instance"),
        ("retries", "retries"),
        ("health_interval", "health_check_interval_s"),
        ("health_timeout", "health_check_timeout_s"),
        ("eject_seconds", "eject_s"),
        ("heartbeat_interval", "heartbeat_interval_s"),
        ("sglang_router", "sglang_router_url"),
        ("sglang_router_workload", "sglang_router_workload"),
        ("log_level", "log_level"),
        ("log_format", "log_format"),
        ("metrics_listen", "metrics_listen"),
    ):
        if getattr(a, flag) is not None:
            data[key] = getattr(a, flag)
    for flag, key in (("endpoints", "endpoints"), ("static_endpoints", "static_endpoints")):
        if getattr(a, flag):
            data[key] = [e.strip() for e in getattr(a, flag).split(",") if e.strip()]
    return from_mapping(GatewaySettings, data, a.config or "flags")


def main(argv: list[str] | None = None) -> None:
    try:
        settings = build_settings(argv)
    except ConfigError as e:
        print(_("kunlun-gateway: {error}").format(error=error_text(e)), file=sys.stderr)
        sys.exit(2)
    setup_logging("kunlun-gateway", settings.log_level, log_json(settings.log_format))
    try:
        import uvloop

        factory: Any = uvloop.new_event_loop
    except ImportError:  # pragma: no cover
        factory = None
    try:
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(serve(settings))
    except ConfigError as e:
        print(_("kunlun-gateway: {error}").format(error=error_text(e)), file=sys.stderr)
        sys.exit(2)
    except KunlunError as e:
        print(_("kunlun-gateway: {error}").format(error=error_text(e)), file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        pass
    with contextlib.suppress(Exception):
        sys.stdout.flush()


if __name__ == "__main__":
    main()
