"""Settings of a gateway (`kunlun-gateway`), loadable from YAML and flags."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from kunlun_common.errors import ConfigError
from kunlun_common.messages import msg
from kunlun_common.pki import CertPaths, paths_for
from kunlun_common.trace_ring import ProfileOutput
from kunlun_common.traffic import ROUTING_POLICIES

POLICIES = ROUTING_POLICIES


def split_host_port(address: str, what: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ConfigError(
            msg("settings.host_port", "{what}: expected host:port, found {found!r}", what=what, found=address)
        )
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class KeyRateLimit:
    """The request rate of one API key (overrides rate_limit_per_s / rate_limit_burst)."""

    key: str
    """Key id as `kunlun-cli gateway keys list` shows it (the `kl-<id>-` part of the secret)."""
    per_s: float
    """Sustained requests per second; 0: no limit for this key."""
    burst: int = 0
    """Requests let through at once after a quiet spell; 0: per_s rounded up (at least 1)."""


def _key_limits(items: tuple[Any, ...]) -> tuple[KeyRateLimit, ...]:
    """YAML mappings -> KeyRateLimit, every problem named by its index and field."""
    known = [f.name for f in fields(KeyRateLimit)]
    out: list[KeyRateLimit] = []
    seen: set[str] = set()
    for i, item in enumerate(items):
        at = f"key_rate_limits[{i}]"
        if isinstance(item, KeyRateLimit):
            item = {"key": item.key, "per_s": item.per_s, "burst": item.burst}
        if not isinstance(item, dict):
            raise ConfigError(
                msg(
                    "gateway.settings.key_limit_mapping",
                    "{at}: expected a mapping with key, per_s and burst, found {found}",
                    at=at,
                    found=repr(item),
                )
            )
        unknown = sorted(set(item) - set(known))
        if unknown:
            raise ConfigError(
                msg(
                    "gateway.settings.key_limit_field",
                    "{at}: unknown field {field!r}; known fields: {known}",
                    at=at,
                    field=unknown[0],
                    known=", ".join(known),
                )
            )
        key, per_s, burst = item.get("key"), item.get("per_s"), item.get("burst", 0)
        if not isinstance(key, str) or not key or len(key) > 64:
            raise ConfigError(
                msg(
                    "gateway.settings.key_limit_key",
                    "{at}.key: expected the key id (`kunlun-cli gateway keys list`), found {found}",
                    at=at,
                    found=repr(key),
                )
            )
        if key in seen:
            raise ConfigError(
                msg(
                    "gateway.settings.key_limit_twice",
                    "{at}.key: {key!r} is listed twice; keep one entry per key",
                    at=at,
                    key=key,
                )
            )
        seen.add(key)
        if isinstance(per_s, bool) or not isinstance(per_s, int | float) or per_s < 0:
            raise ConfigError(
                msg(
                    "gateway.settings.key_limit_per_s",
                    "{at}.per_s: expected requests per second >= 0 (0: no limit), found {found}",
                    at=at,
                    found=repr(per_s),
                )
            )
        if isinstance(burst, bool) or not isinstance(burst, int) or burst < 0:
            raise ConfigError(
                msg(
                    "gateway.settings.key_limit_burst",
                    "{at}.burst: expected a whole number >= 0 (0: per_s rounded up), found {found}",
                    at=at,
                    found=repr(burst),
                )
            )
        out.append(KeyRateLimit(key, float(per_s), burst))
    return tuple(out)


@dataclass(frozen=True)
class GatewaySettings:
    """Everything one gateway needs; YAML keys are these field names."""

    name: str = "gateway-1"
    """Gateway name; with a control plane it must equal the CN of its certificate (role `gateway`)."""
    listen: str = "127.0.0.1:8080"
    """host:port the HTTP API listens on."""
    advertise: str = ""
    """host:port clients use to reach this gateway (default: listen); shown by `gateway list`."""
    endpoints: tuple[str, ...] = ()
    """Replica addresses host:port (all of them: the gateway fails over between them)."""
    cert_dir: str = ""
    """Certificate folder from `kunlun-cli certs init` (uses ca.crt and gateway/<name>.crt/.key)."""
    static_endpoints: tuple[str, ...] = ()
    """Without a control plane (benchmarks, local tests): WORKLOAD=HOST:PORT entries."""
    tls_cert: str = ""
    """PEM certificate for HTTPS on the client side (with tls_key); empty: plain HTTP."""
    tls_key: str = ""
    """PEM private key for tls_cert."""
    require_api_key: bool = False
    """Refuse requests without a valid `Authorization: Bearer <key>` (keys: `kunlun-cli gateway keys`)."""
    default_policy: str = "round_robin"
    """Routing policy of workloads without one of their own (`kunlun-cli gateway policy set`)."""
    balance_factor: float = 1.25
    """prefix_affinity: an instance takes at most ceil(factor * average in-flight) before shedding."""
    prefix_chars: int = 256
    """prefix_affinity: characters of the prompt that are hashed."""
    request_timeout_s: float = 300.0
    """Longest wait for an engine's first response byte, and longest silence between bytes after it."""
    connect_timeout_s: float = 2.0
    """Longest wait to open a connection to an engine."""
    max_inflight_per_instance: int = 256
    """Requests in flight per instance; when every instance is full the gateway answers 503."""
    max_idle_per_instance: int = 128
    """Idle keep-alive connections kept per instance."""
    retries: int = 1
    """Times a request that failed before any byte reached the client is retried on another instance."""
    health_check_interval_s: float = 5.0
    """Active health checks (GET health_check_path) every this many seconds; 0 switches them off."""
    health_check_timeout_s: float = 1.0
    """An instance that does not answer its health check within this is ejected."""
    health_check_path: str = "/health"
    """Path of the engines' health endpoint."""
    eject_s: float = 5.0
    """Passive ejection after connection errors: first period, doubled on each repeat (at most 60 s)."""
    max_body_bytes: int = 16 * 1024 * 1024
    """Largest accepted request body; a larger one is answered 413 as soon as its head (or the chunk
    that passes the limit) arrives, without reading the rest, and the connection is closed."""
    max_url_bytes: int = 8192
    """Longest request target (path and query); longer: 414 and the connection is closed."""
    max_header_bytes: int = 32768
    """Largest request head (target and header lines); larger: 431 and the connection is closed."""
    max_headers: int = 100
    """Most header lines in one request; more: 431 and the connection is closed."""
    max_pipelined: int = 16
    """Requests one connection may queue behind the one being answered; beyond that (or beyond
    max_body_bytes of queued bodies) the gateway stops reading it until answers go out (TCP
    back-pressure: nothing is refused)."""
    header_timeout_s: float = 10.0
    """Longest time to receive a request head, counted from its first byte (a new connection's first
    head: from the connect); slower: 408 and the connection is closed (slowloris)."""
    body_timeout_s: float = 60.0
    """Longest time to receive a request body once its head arrived; slower: 408 and closed."""
    keepalive_timeout_s: float = 60.0
    """An idle keep-alive connection (no request in progress or queued) is closed after this long,
    without an answer."""
    access_log_sample: float = 0.01
    """Share of successful requests written to the access log (one JSON line per request: trace id,
    workload, version, instance, status, times, sizes; never prompt text or keys); refusals and
    errors (status >= 400) are always written. 0..1; the default 1 % keeps logging off the hot
    path (every request logged cost about half the proxy's throughput in `make bench-check`)."""
    max_connections: int = 4096
    """Client connections open at once; one more is answered 503 and closed at once."""
    rate_limit_per_s: float = 0.0
    """Requests per second each API key may send, sustained (token bucket); over it: 429 with
    Retry-After. 0: no limit. Needs require_api_key."""
    rate_limit_burst: int = 0
    """Requests a key may send at once after a quiet spell; 0: rate_limit_per_s rounded up (at least 1)."""
    key_rate_limits: tuple[KeyRateLimit, ...] = ()
    """Per-key overrides: a list of {key: ID, per_s: N, burst: N} (per_s 0: that key is not limited)."""
    client_rate_limit_per_s: float = 0.0
    """Requests per second each client address (the TCP peer) may send, sustained, whatever the
    path except /health (token bucket, checked before the API key); over it: 429 with Retry-After.
    0: no limit (the default). Behind a proxy every client shares the proxy's address: keep it off
    or generous there."""
    client_rate_limit_burst: int = 0
    """Requests an address may send at once after a quiet spell; 0: client_rate_limit_per_s
    rounded up (at least 1)."""
    allow_insecure_listen: bool = False
    """Let a non-loopback listen address serve plain HTTP or without API keys (only behind a proxy
    that terminates TLS and authenticates); by default such a config is refused."""
    heartbeat_interval_s: float = 2.0
    """Registration heartbeat to the replica; a replica that misses it is left for the next one."""
    feed_timeout_s: float = 5.0
    """A replica that sends no endpoint snapshot or heartbeat answer within this is left."""
    sglang_router_url: str = ""
    """Optional http://host:port of an sglang-router whose workers are kept equal to our instances."""
    sglang_router_workload: str = ""
    """Mirror only this workload's instances into the sglang-router (empty: every workload)."""
    drain_s: float = 10.0
    """On SIGTERM: stop accepting, wait this long at most for requests in flight."""
    start_sync_s: float = 10.0
    """At start: listen only once the control plane sent the first endpoint snapshot (and the API
    keys, when required), waiting at most this long; a restarted gateway (an upgrade) then never
    answers 503 while its peers serve. After it, listen anyway (503 until fed). 0: listen at once."""
    metrics_listen: str = ""
    """host:port of the Prometheus exporter (HTTPS with the gateway's certificate, client certificates
    of role `monitoring`; needs cert_dir); port 0 picks a free one; empty: no exporter."""
    log_level: str = "info"
    """debug, info, warning or error."""
    log_format: str = ""
    """`json` (one JSON object a line, for production), `console` (readable), or empty: JSON unless
    stderr is a terminal."""
    profiling: ProfileOutput = field(default_factory=ProfileOutput)
    """Where run-time profiles go when the scheduler settings switch `advanced_profiling` on: folder,
    most files kept, most bytes per file (`--profile-dir` sets the folder)."""

    def __post_init__(self) -> None:
        listen_host, _ = split_host_port(self.listen, "listen")
        if self.metrics_listen:
            if not self.cert_dir:
                raise ConfigError(
                    msg(
                        "gateway.settings.metrics_cert",
                        "metrics_listen: the exporter serves HTTPS with the gateway's certificate; give cert_dir",
                    )
                )
            host, sep, port = self.metrics_listen.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ConfigError(
                    msg(
                        "settings.metrics_listen",
                        "metrics_listen: expected host:port (port 0: a free one), found {found!r}",
                        found=self.metrics_listen,
                    )
                )
        for ep in self.endpoints:
            split_host_port(ep, "endpoints")
        for item in self.static_endpoints:
            workload, sep, address = item.partition("=")
            if not sep or not workload:
                raise ConfigError(
                    msg(
                        "gateway.settings.static_endpoint",
                        "static_endpoints: expected WORKLOAD=HOST:PORT, found {found!r}",
                        found=item,
                    )
                )
            split_host_port(address, "static_endpoints")
        if not self.endpoints and not self.static_endpoints:
            raise ConfigError(
                msg(
                    "gateway.settings.no_endpoints",
                    "endpoints: name the replicas (host:port, comma-separated), or give static_endpoints",
                )
            )
        if self.endpoints and not self.cert_dir:
            raise ConfigError(
                msg(
                    "gateway.settings.cert_dir",
                    "cert_dir: the certificate folder is required to talk to the replicas",
                )
            )
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError(
                msg(
                    "gateway.settings.tls_pair",
                    "tls_cert and tls_key: give both (HTTPS) or neither (plain HTTP)",
                )
            )
        if self.default_policy not in POLICIES:
            raise ConfigError(
                msg(
                    "gateway.settings.policy",
                    "default_policy: expected one of {policies}, found {found!r}",
                    policies=", ".join(POLICIES),
                    found=self.default_policy,
                )
            )
        for name in ("request_timeout_s", "connect_timeout_s", "health_check_timeout_s", "eject_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(
                    msg(
                        "settings.positive_seconds",
                        "{name}: expected a positive number of seconds, found {found}",
                        name=name,
                        found=getattr(self, name),
                    )
                )
        if self.health_check_interval_s < 0:
            raise ConfigError(
                msg(
                    "gateway.settings.health_interval",
                    "health_check_interval_s: expected 0 (off) or a positive number of seconds",
                )
            )
        if self.max_inflight_per_instance < 1:
            raise ConfigError(
                msg("gateway.settings.max_inflight", "max_inflight_per_instance: expected at least 1")
            )
        if not 0 <= self.retries <= 3:
            raise ConfigError(
                msg("gateway.settings.retries", "retries: expected 0..3, found {found}", found=self.retries)
            )
        if self.balance_factor < 1.0:
            raise ConfigError(
                msg(
                    "gateway.settings.balance_factor",
                    "balance_factor: expected at least 1.0, found {found}",
                    found=self.balance_factor,
                )
            )
        if self.log_format not in ("", "json", "console"):
            raise ConfigError(
                msg(
                    "settings.log_format",
                    "log_format: expected json or console, found {found!r}",
                    found=self.log_format,
                )
            )
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise ConfigError(
                msg(
                    "settings.log_level",
                    "log_level: expected debug, info, warning or error, found {found!r}",
                    found=self.log_level,
                )
            )
        self._check_limits()
        if not is_loopback(listen_host) and not self.allow_insecure_listen:
            if not self.tls_cert and not self.require_api_key:
                raise ConfigError(
                    msg(
                        "gateway.settings.insecure_listen_both",
                        "listen: {listen} is reachable from the network, so the gateway needs tls_cert/tls_key "
                        "and require_api_key: true (HTTPS and API keys; see deploy/examples/gateway.example.yaml); "
                        "only behind a proxy that terminates TLS and authenticates, set allow_insecure_listen: true",
                        listen=self.listen,
                    )
                )
            missing = [
                n
                for n, on in (
                    ("tls_cert/tls_key", self.tls_cert),
                    ("require_api_key: true", self.require_api_key),
                )
                if not on
            ]
            if missing:
                raise ConfigError(
                    msg(
                        "gateway.settings.insecure_listen",
                        "listen: {listen} is reachable from the network, so the gateway needs {missing} "
                        "(HTTPS and API keys; see deploy/examples/gateway.example.yaml); only behind a proxy "
                        "that terminates TLS and authenticates, set allow_insecure_listen: true",
                        listen=self.listen,
                        missing=missing[0],
                    )
                )

    def _check_limits(self) -> None:
        minimum = {
            "max_body_bytes": 1,
            "max_url_bytes": 16,
            "max_header_bytes": 1024,
            "max_headers": 8,
            "max_pipelined": 1,
            "max_connections": 1,
        }
        for name, least in minimum.items():
            if getattr(self, name) < least:
                raise ConfigError(
                    msg(
                        "gateway.settings.at_least",
                        "{name}: expected at least {least}, found {found}",
                        name=name,
                        least=least,
                        found=getattr(self, name),
                    )
                )
        if self.max_url_bytes > self.max_header_bytes:
            raise ConfigError(
                msg(
                    "gateway.settings.url_above_header",
                    "max_url_bytes: {url} is above max_header_bytes ({header}), "
                    "which counts the target too; raise max_header_bytes or lower max_url_bytes",
                    url=self.max_url_bytes,
                    header=self.max_header_bytes,
                )
            )
        for name in ("header_timeout_s", "body_timeout_s", "keepalive_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(
                    msg(
                        "settings.positive_seconds",
                        "{name}: expected a positive number of seconds, found {found}",
                        name=name,
                        found=getattr(self, name),
                    )
                )
        if not 0.0 <= self.access_log_sample <= 1.0:
            raise ConfigError(
                msg(
                    "gateway.settings.access_log_sample",
                    "access_log_sample: expected a share from 0 to 1, found {found}",
                    found=self.access_log_sample,
                )
            )
        if self.rate_limit_per_s < 0 or self.rate_limit_burst < 0:
            raise ConfigError(
                msg(
                    "gateway.settings.rate_limit",
                    "rate_limit_per_s / rate_limit_burst: expected 0 (no limit) or a positive number",
                )
            )
        if self.client_rate_limit_per_s < 0 or self.client_rate_limit_burst < 0:
            raise ConfigError(
                msg(
                    "gateway.settings.client_rate_limit",
                    "client_rate_limit_per_s / client_rate_limit_burst: expected 0 (no limit) or a positive number",
                )
            )
        object.__setattr__(self, "key_rate_limits", _key_limits(tuple(self.key_rate_limits)))
        if (self.rate_limit_per_s > 0 or self.key_rate_limits) and not self.require_api_key:
            raise ConfigError(
                msg(
                    "gateway.settings.rate_limit_needs_keys",
                    "rate_limit_per_s / key_rate_limits: rate limits are per API key; set require_api_key: true",
                )
            )

    @property
    def advertise_address(self) -> str:
        return self.advertise or self.listen

    def cert_paths(self) -> CertPaths:
        return paths_for(Path(self.cert_dir), "gateway", self.name)

    def static_map(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for item in self.static_endpoints:
            workload, _, address = item.partition("=")
            out.setdefault(workload, []).append(address)
        return out
