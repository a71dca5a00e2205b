"""The gateway's Prometheus metrics: requests by workload, version and status, latency and
time-to-first-byte histograms, in-flight requests, retries, ejections and the upstream pools.

The hot path only touches plain dicts and lists (`record`, `retry`, `ejected`: a dict lookup, an
add and a bisect); the Prometheus families are built from a copy of them at scrape time, in the
exporter's worker thread (`kunlun_common.metrics_http`). Labels are `workload` (a workload the
control plane serves: requests for unknown models are refused before they are counted), `version`
(`baseline` or `canary`) and `status` (the HTTP status code); nothing per request or per client.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

# seconds; covers a fast test engine (ms) up to long generations (minutes)
BOUNDS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def version_of(variant: str) -> str:
    return variant or "baseline"


class Hist:
    __slots__ = ("buckets", "count", "total")

    def __init__(self) -> None:
        self.buckets = [0] * (len(BOUNDS_S) + 1)
        self.count = 0
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        self.buckets[bisect_left(BOUNDS_S, seconds)] += 1
        self.count += 1
        self.total += seconds

    def copy(self) -> Hist:
        h = Hist()
        h.buckets, h.count, h.total = list(self.buckets), self.count, self.total
        return h


@dataclass
class PoolRow:
    workload: str
    instances: int = 0
    ejected: int = 0
    inflight: int = 0
    idle_connections: int = 0
    opened_connections: int = 0


@dataclass
class Snapshot:
    requests: dict[tuple[str, str, str], int] = field(default_factory=dict)
    latency: dict[tuple[str, str], Hist] = field(default_factory=dict)
    ttfb: dict[tuple[str, str], Hist] = field(default_factory=dict)
    retries: dict[str, int] = field(default_factory=dict)
    ejections: dict[str, int] = field(default_factory=dict)
    pools: list[PoolRow] = field(default_factory=list)
    inflight: int = 0
    clients: int = 0
    refused: dict[str, int] = field(default_factory=dict)


class GatewayMetrics:
    """Counters fed by the hot path; `snapshot()` copies them (on the event loop)."""

    def __init__(self) -> None:
        self.requests: dict[tuple[str, str, str], int] = {}
        self.latency: dict[tuple[str, str], Hist] = {}
        self.ttfb: dict[tuple[str, str], Hist] = {}
        self.retries: dict[str, int] = {}
        self.ejections: dict[str, int] = {}

    def record(self, workload: str, variant: str, status: int, seconds: float, ttfb: float | None) -> None:
        version = version_of(variant)
        key = (workload, version, str(status))
        self.requests[key] = self.requests.get(key, 0) + 1
        wv = (workload, version)
        h = self.latency.get(wv)
        if h is None:
            h = self.latency[wv] = Hist()
        h.observe(seconds)
        if ttfb is not None:
            t = self.ttfb.get(wv)
            if t is None:
                t = self.ttfb[wv] = Hist()
            t.observe(ttfb)

    def retry(self, workload: str) -> None:
        self.retries[workload] = self.retries.get(workload, 0) + 1

    def ejected(self, workload: str) -> None:
        self.ejections[workload] = self.ejections.get(workload, 0) + 1

    def snapshot(self) -> Snapshot:
        return Snapshot(
            requests=dict(self.requests),
            latency={k: h.copy() for k, h in self.latency.items()},
            ttfb={k: h.copy() for k, h in self.ttfb.items()},
            retries=dict(self.retries),
            ejections=dict(self.ejections),
        )


def _hist(family: HistogramMetricFamily, labels: list[str], h: Hist) -> None:
    cumulative: list[tuple[str, float]] = []
    running = 0
    for bound, n in zip(BOUNDS_S, h.buckets, strict=False):
        running += n
        cumulative.append((repr(bound), float(running)))
    cumulative.append(("+Inf", float(h.count)))
    family.add_metric(labels, cumulative, h.total)


class GatewayCollector(Collector):
    def __init__(self, name: str) -> None:
        self.name = name
        self.snap = Snapshot()

    def collect(self) -> Iterator[Metric]:
        s = self.snap
        req = CounterMetricFamily(
            "kunlun_gateway_requests",
            "Requests answered, by workload, version (baseline/canary) and HTTP status",
            labels=("workload", "version", "status"),
        )
        for (w, v, code), n in sorted(s.requests.items()):
            req.add_metric([w, v, code], float(n))
        yield req
        lat = HistogramMetricFamily(
            "kunlun_gateway_request_duration_seconds",
            "Time from the request's dispatch to its last byte",
            labels=("workload", "version"),
        )
        for (w, v), h in sorted(s.latency.items()):
            _hist(lat, [w, v], h)
        yield lat
        ttfb = HistogramMetricFamily(
            "kunlun_gateway_time_to_first_byte_seconds",
            "Time from the request's dispatch to the engine's first response byte",
            labels=("workload", "version"),
        )
        for (w, v), h in sorted(s.ttfb.items()):
            _hist(ttfb, [w, v], h)
        yield ttfb
        retries = CounterMetricFamily(
            "kunlun_gateway_retries", "Requests retried on another instance", labels=("workload",)
        )
        for w, n in sorted(s.retries.items()):
            retries.add_metric([w], float(n))
        yield retries
        ej = CounterMetricFamily(
            "kunlun_gateway_ejections", "Instances ejected after errors (passive)", labels=("workload",)
        )
        for w, n in sorted(s.ejections.items()):
            ej.add_metric([w], float(n))
        yield ej
        inflight = GaugeMetricFamily("kunlun_gateway_inflight_requests", "Requests in flight")
        inflight.add_metric([], float(s.inflight))
        yield inflight
        refused = CounterMetricFamily(
            "kunlun_gateway_refused",
            "Requests and connections refused before routing, by reason (api_key, client_rate, key_rate, ...)",
            labels=("reason",),
        )
        for reason, n in sorted(s.refused.items()):
            refused.add_metric([reason], float(n))
        yield refused
        clients = GaugeMetricFamily("kunlun_gateway_client_connections", "Open client connections")
        clients.add_metric([], float(s.clients))
        yield clients
        families = {
            "instances": GaugeMetricFamily(
                "kunlun_gateway_instances", "Instances the gateway routes to", labels=("workload",)
            ),
            "ejected": GaugeMetricFamily(
                "kunlun_gateway_ejected_instances", "Instances ejected now", labels=("workload",)
            ),
            "inflight": GaugeMetricFamily(
                "kunlun_gateway_upstream_inflight_requests",
                "Requests in flight to the workload's instances",
                labels=("workload",),
            ),
            "idle_connections": GaugeMetricFamily(
                "kunlun_gateway_upstream_idle_connections",
                "Idle keep-alive connections to the workload's instances",
                labels=("workload",),
            ),
        }
        opened = CounterMetricFamily(
            "kunlun_gateway_upstream_connections_opened",
            "Connections opened to the workload's current instances",
            labels=("workload",),
        )
        for p in s.pools:
            for attr, fam in families.items():
                fam.add_metric([p.workload], float(getattr(p, attr)))
            opened.add_metric([p.workload], float(p.opened_connections))
        yield from families.values()
        yield opened


class GatewayExport:
    """The gateway's registry; `prepare()` copies the counters and pool state (on the event loop)."""

    def __init__(
        self,
        name: str,
        metrics: GatewayMetrics,
        pools: Callable[[], list[PoolRow]],
        proxy_state: Callable[[], tuple[int, int]],
        refused: Callable[[], dict[str, int]] | None = None,
    ) -> None:
        self._refused = refused
        self.metrics = metrics
        self._pools = pools
        self._proxy_state = proxy_state
        self.registry = CollectorRegistry(auto_describe=False)
        self.collector = GatewayCollector(name)
        self.registry.register(self.collector)
        from prometheus_client import ProcessCollector

        ProcessCollector(registry=self.registry)

    async def prepare(self) -> None:
        snap = self.metrics.snapshot()
        snap.pools = self._pools()
        snap.inflight, snap.clients = self._proxy_state()
        snap.refused = self._refused() if self._refused is not None else {}
        self.collector.snap = snap
