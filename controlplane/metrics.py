"""The replica's Prometheus metrics: leadership, API and etcd latency, the scheduler and rollouts.

- every replica: `kunlun_replica_leader` / `kunlun_replica_leader_epoch`, its watch lag
  (`kunlun_replica_watch_lag_seconds`, controlplane/watch_lag.py), API latency by method
  and code (every unary handler's `@rpc` wrapper calls `api_observed`), etcd request latency and errors by operation (`EtcdStore`
  calls `etcd_observed`);
- the leader only (the others would repeat it): scheduler queue depth per priority, placements,
  preemptions, decision latency and the reasons instances stay unplaced (`SchedulerLoop` reports
  each tick through `scheduler_tick`), rollout phase and canary weight per workload, node
  readiness, and the utilization spread across each workload's devices (`load_balance`).

Labels stay bounded: methods and etcd operations are fixed sets, reasons are the first word of
the scheduler's per-node reason (`CardTypeMismatch`, `InsufficientMemory`, ...), workloads and
nodes are what the cluster holds. The snapshot part is copied on the event loop by `prepare()`
and rendered in the exporter's thread (`kunlun_common.metrics_http`).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from kunlun_common.api import rollout_pb2
from kunlun_common.states import RolloutPhase

log = structlog.get_logger("metrics")

PRIORITIES = ("high", "normal", "low")
ROLLOUT_PHASES = tuple(RolloutPhase)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass(frozen=True)
class WorkloadSpread:
    """The spread of utilization across one workload's devices (0..1 ratios)."""

    workload: str
    devices: int
    mean: float
    stddev: float
    max_min: float


def spread(workload: str, utilizations: list[float]) -> WorkloadSpread:
    """Population standard deviation and max - min of the given utilization ratios."""
    n = len(utilizations)
    if not n:
        return WorkloadSpread(workload, 0, 0.0, 0.0, 0.0)
    mean = sum(utilizations) / n
    var = sum((u - mean) ** 2 for u in utilizations) / n
    return WorkloadSpread(workload, n, mean, math.sqrt(var), max(utilizations) - min(utilizations))


@dataclass
class LeaderView:
    """What the leader exports, copied on the event loop."""

    etcd: list[tuple[str, bool, int]] = field(default_factory=list)  # member, healthy, db size
    rollouts: list[tuple[str, str, float]] = field(default_factory=list)  # workload, phase, weight
    nodes: list[tuple[str, bool]] = field(default_factory=list)
    spreads: list[WorkloadSpread] = field(default_factory=list)


class ReplicaCollector(Collector):
    def __init__(self, name: str) -> None:
        self.name = name
        self.leader = False
        self.epoch = 0
        self.terms = 0
        self.temperature_limit_c = 0.0
        self.etcd_quota_bytes = 0
        self.watch_lag_s: float | None = None
        self.view: LeaderView | None = None

    def collect(self) -> Iterator[Metric]:
        leader = GaugeMetricFamily(
            "kunlun_replica_leader", "1 while this replica is the elected leader", labels=("replica",)
        )
        leader.add_metric([self.name], 1.0 if self.leader else 0.0)
        yield leader
        epoch = GaugeMetricFamily(
            "kunlun_replica_leader_epoch",
            "Epoch (leader key create revision) of the leadership this replica holds; 0 when following",
            labels=("replica",),
        )
        epoch.add_metric([self.name], float(self.epoch))
        yield epoch
        terms = CounterMetricFamily(
            "kunlun_replica_leader_terms",
            "Leaderships this replica has won since it started",
            labels=("replica",),
        )
        terms.add_metric([self.name], float(self.terms))
        yield terms
        lag = GaugeMetricFamily(
            "kunlun_replica_watch_lag_seconds",
            "Time from this replica's heartbeat write to its watch-fed cache seeing it (at least the age "
            "of a heartbeat not seen yet)",
            labels=("replica",),
        )
        if self.watch_lag_s is not None:
            lag.add_metric([self.name], self.watch_lag_s)
        yield lag
        view = self.view
        if view is None:
            return
        limit = GaugeMetricFamily(
            "kunlun_scheduler_temperature_limit_celsius",
            "The scheduler's temperature_limit_c: hotter devices get no new placement",
        )
        if self.temperature_limit_c:
            limit.add_metric([], self.temperature_limit_c)
        yield limit
        db = GaugeMetricFamily(
            "kunlun_etcd_db_size_bytes", "etcd database size per member", labels=("member",)
        )
        healthy = GaugeMetricFamily(
            "kunlun_etcd_member_healthy", "1 while the member answers", labels=("member",)
        )
        for member, ok, size in view.etcd:
            healthy.add_metric([member], 1.0 if ok else 0.0)
            if ok:
                db.add_metric([member], float(size))
        yield db
        yield healthy
        quota = GaugeMetricFamily(
            "kunlun_etcd_db_quota_bytes", "etcd's space quota (replica setting etcd_quota_bytes)"
        )
        quota.add_metric([], float(self.etcd_quota_bytes))
        yield quota
        phase = GaugeMetricFamily(
            "kunlun_rollout_phase", "1 for the rollout's current phase", labels=("workload", "phase")
        )
        weight = GaugeMetricFamily(
            "kunlun_rollout_canary_weight_ratio",
            "Share of the workload's traffic sent to its canary",
            labels=("workload",),
        )
        for wl, ph, w in view.rollouts:
            for p in ROLLOUT_PHASES:
                phase.add_metric([wl, p], 1.0 if p == ph else 0.0)
            weight.add_metric([wl], w)
        yield phase
        yield weight
        ready = GaugeMetricFamily(
            "kunlun_node_ready", "1 while the node's agent is heard from", labels=("node",)
        )
        for node, ok in view.nodes:
            ready.add_metric([node], 1.0 if ok else 0.0)
        yield ready
        sd = GaugeMetricFamily(
            "kunlun_workload_utilization_stddev_ratio",
            "Standard deviation of utilization across the workload's devices",
            labels=("workload",),
        )
        mm = GaugeMetricFamily(
            "kunlun_workload_utilization_spread_ratio",
            "Max minus min utilization across the workload's devices",
            labels=("workload",),
        )
        for s in view.spreads:
            if s.devices:
                sd.add_metric([s.workload], s.stddev)
                mm.add_metric([s.workload], s.max_min)
        yield sd
        yield mm


class ReplicaMetrics:
    """The replica's registry: live instruments plus the leader view copied by `prepare()`."""

    def __init__(self, name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.api_latency = Histogram(
            "kunlun_api_request_duration_seconds",
            "gRPC API calls served by this replica, by method and status code",
            ("method", "code"),
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.etcd_latency = Histogram(
            "kunlun_etcd_request_duration_seconds",
            "etcd requests made by this replica, by operation (retries included)",
            ("op",),
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.etcd_errors = Counter(
            "kunlun_etcd_request_errors", "etcd requests that failed, by operation", ("op",), registry=r
        )
        self.queue_depth = Gauge(
            "kunlun_scheduler_queue_depth",
            "Pending instances per priority (leader only)",
            ("priority",),
            registry=r,
        )
        self.placements = Counter("kunlun_scheduler_placements", "Instances placed on devices", registry=r)
        self.preemptions = Counter(
            "kunlun_scheduler_preemptions", "Instances evicted for higher-priority ones", registry=r
        )
        self.decision = Histogram(
            "kunlun_scheduler_decision_duration_seconds",
            "Time one scheduler tick took to decide (before commit)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.unplaced = Gauge(
            "kunlun_scheduler_unplaced_instances",
            "Instances left unplaced by the last tick, by the most common reason across nodes",
            ("reason",),
            registry=r,
        )
        self.collector = ReplicaCollector(name)
        r.register(self.collector)
        ProcessCollector(registry=r)
        self.leader_state: Callable[[], tuple[bool, int, int]] = lambda: (False, 0, 0)
        self.temperature_limit_c = 0.0
        self.leader_view: Callable[[], Awaitable[LeaderView]] | None = None
        self.watch_lag: Callable[[], float | None] = lambda: None

    # ------------------------------------------------------------------ hooks
    def api_observed(self, method: str, code: str, seconds: float) -> None:
        """One unary API call ended (told by controlplane/api/rpc.py)."""
        self.api_latency.labels(method, code).observe(seconds)

    def etcd_observed(self, op: str, seconds: float, failed: bool) -> None:
        self.etcd_latency.labels(op).observe(seconds)
        if failed:
            self.etcd_errors.labels(op).inc()

    def scheduler_tick(
        self,
        queue: dict[str, int],
        placed: int,
        evicted: int,
        decision_s: float,
        unplaced_reasons: dict[str, int],
    ) -> None:
        for p in PRIORITIES:
            self.queue_depth.labels(p).set(queue.get(p, 0))
        if placed:
            self.placements.inc(placed)
        if evicted:
            self.preemptions.inc(evicted)
        self.decision.observe(decision_s)
        self.unplaced.clear()
        for reason, n in unplaced_reasons.items():
            self.unplaced.labels(reason).set(n)

    def not_leader(self) -> None:
        """Stop exporting the leader-only scheduler gauges (another replica now decides)."""
        self.queue_depth.clear()
        self.unplaced.clear()

    async def prepare(self) -> None:
        leader, epoch, terms = self.leader_state()
        c = self.collector
        c.leader, c.epoch, c.terms, c.temperature_limit_c = leader, epoch, terms, self.temperature_limit_c
        c.watch_lag_s = self.watch_lag()
        if not leader:
            self.not_leader()
        view = None
        if leader and self.leader_view is not None:
            try:
                view = await self.leader_view()
            except Exception as e:  # etcd unreachable: export what this replica knows by itself
                log.warning("leader metrics unavailable", error=str(e)[:200])
        self.collector.view = view


def reason_class(reason: str) -> str:
    """`InsufficientMemory (needs 40000 MB, 32768 free)` -> `InsufficientMemory` (a bounded label)."""
    word = reason.split(" ", 1)[0].split(":", 1)[0].strip("(;,")
    return word if word.isidentifier() and len(word) <= 48 else "Other"


def rollout_rows(rollouts: list[rollout_pb2.Rollout]) -> list[tuple[str, str, float]]:
    return [(r.workload, r.phase, r.weight_pct / 100.0) for r in rollouts]
