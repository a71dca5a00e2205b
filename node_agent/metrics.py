"""The agent's Prometheus metrics: its devices (from the samples it takes every
`health_interval_seconds`) and the instances its executor runs.

Device series carry `node`, `device`, `device_type` and `vendor`; instance series carry `node`,
`workload` (the workload id) and `instance`. Nothing unbounded goes into a label: a node has at
most 1024 devices and a bounded set of instances. Status and phase are one-hot gauges over fixed
value sets, so alerts read `kunlun_device_status{status="Unhealthy"} == 1`.

The vendor tools report utilization, memory, temperature, power and health; memory bandwidth and
PCIe throughput are not in the device contract yet, so they are not exported. Each instance's
memory and CPU come from its cgroup (v2 `memory.current` and `cpu.stat`; v1 `memory.usage_in_bytes`
and `cpuacct.usage`), read during the scrape in its worker thread.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from kunlun_common.api import agent_pb2, types_pb2
from kunlun_common.errors import ConfigError
from kunlun_common.names import VENDORS
from kunlun_common.states import InstancePhase
from node_agent.executor.cgroups import CgroupLayout, InstanceCgroup

MB = 1024 * 1024
STATUSES = ("Ready", "Unhealthy", "Unavailable", "Error")
PHASES = (
    InstancePhase.STARTING,
    InstancePhase.RUNNING,
    InstancePhase.FAILED,
    InstancePhase.STOPPED,
    InstancePhase.CRASH_LOOP,
)
DEVICE_LABELS = ("node", "device", "device_type", "vendor")
INSTANCE_LABELS = ("node", "workload", "instance")


def status_name(status: int) -> str:
    name = (
        types_pb2.DeviceStatus.Name(types_pb2.DeviceStatus.ValueType(status))
        if status in types_pb2.DeviceStatus.values()
        else ""
    )
    return name.removeprefix("DEVICE_STATUS_").capitalize() or "Unknown"


@dataclass(frozen=True)
class DeviceRow:
    labels: tuple[str, str, str, str]
    status: str
    utilization: float
    memory_used_bytes: float
    memory_total_bytes: float
    temperature_c: float
    power_w: float
    sampled_at_s: float
    has_sample: bool


@dataclass(frozen=True)
class InstanceRow:
    labels: tuple[str, str, str]
    phase: str
    restarts: int
    prepare_s: float
    first_token_s: float
    oom_killed: bool


def device_rows(node: str, devices: list[types_pb2.Device]) -> list[DeviceRow]:
    rows = []
    for d in devices:
        t = d.telemetry
        total = d.hbm_memory_mb or d.total_memory_mb
        rows.append(
            DeviceRow(
                labels=(node, d.name, d.device_type, VENDORS.get(d.device_type, "unknown")),
                status=status_name(d.status),
                utilization=t.utilization_pct / 100.0,
                memory_used_bytes=float(t.memory_used_mb * MB),
                memory_total_bytes=float(total * MB),
                temperature_c=t.temperature_c,
                power_w=t.power_w,
                sampled_at_s=t.sampled_at_unix_ms / 1000.0,
                has_sample=d.HasField("telemetry") and t.sampled_at_unix_ms > 0,
            )
        )
    return rows


def instance_rows(node: str, statuses: list[agent_pb2.InstanceStatus]) -> list[InstanceRow]:
    return [
        InstanceRow(
            labels=(node, s.workload_id, s.instance_id),
            phase=s.phase,
            restarts=s.restarts,
            prepare_s=s.prepare_seconds,
            first_token_s=s.first_token_ms / 1000.0,
            oom_killed=s.oom_killed,
        )
        for s in statuses
    ]


CgroupUsage = Callable[[str], tuple[int | None, float | None]]
"""Instance id -> (memory bytes, CPU seconds) read from its cgroup; None where not accounted."""


def cgroup_usage(layout: CgroupLayout, parent: str) -> CgroupUsage:
    """Reads an instance's memory and CPU from `<parent>/<instance>` in each hierarchy of `layout`
    (where its supervisor made it)."""

    def usage(instance_id: str) -> tuple[int | None, float | None]:
        try:
            cg = InstanceCgroup(layout, instance_id, parent)
        except ConfigError:  # not a name a cgroup can have: never created either
            return None, None
        return cg.memory_bytes(), cg.cpu_seconds()

    return usage


class AgentCollector(Collector):
    """Builds the metric families from the last snapshot (taken on the event loop by `prepare`);
    the instances' cgroup usage is read here, in the scrape's worker thread (file reads)."""

    def __init__(self, usage: CgroupUsage | None = None) -> None:
        self.devices: list[DeviceRow] = []
        self.instances: list[InstanceRow] = []
        self.connected = False
        self.usage = usage

    def collect(self) -> Iterator[Metric]:
        devices, instances = self.devices, self.instances
        util = GaugeMetricFamily(
            "kunlun_device_utilization_ratio", "Device compute utilization (0..1)", labels=DEVICE_LABELS
        )
        used = GaugeMetricFamily(
            "kunlun_device_memory_used_bytes", "Device memory (HBM) in use", labels=DEVICE_LABELS
        )
        total = GaugeMetricFamily(
            "kunlun_device_memory_total_bytes", "Device memory (HBM) size", labels=DEVICE_LABELS
        )
        temp = GaugeMetricFamily(
            "kunlun_device_temperature_celsius", "Device temperature", labels=DEVICE_LABELS
        )
        power = GaugeMetricFamily("kunlun_device_power_watts", "Device power draw", labels=DEVICE_LABELS)
        sampled = GaugeMetricFamily(
            "kunlun_device_sample_timestamp_seconds",
            "Unix time of the device's last sample from its vendor tool",
            labels=DEVICE_LABELS,
        )
        status = GaugeMetricFamily(
            "kunlun_device_status",
            "1 for the device's current status (Ready, Unhealthy, Unavailable, Error), 0 for the others",
            labels=(*DEVICE_LABELS, "status"),
        )
        for d in devices:
            lab = list(d.labels)
            total.add_metric(lab, d.memory_total_bytes)
            for s in STATUSES:
                status.add_metric([*lab, s], 1.0 if d.status == s else 0.0)
            if not d.has_sample:
                continue
            util.add_metric(lab, d.utilization)
            used.add_metric(lab, d.memory_used_bytes)
            temp.add_metric(lab, d.temperature_c)
            power.add_metric(lab, d.power_w)
            sampled.add_metric(lab, d.sampled_at_s)
        yield from (util, used, total, temp, power, sampled, status)

        phase = GaugeMetricFamily(
            "kunlun_instance_phase",
            "1 for the instance's current phase on this node, 0 for the others",
            labels=(*INSTANCE_LABELS, "phase"),
        )
        restarts = CounterMetricFamily(
            "kunlun_instance_restarts", "Engine restarts of the instance", labels=INSTANCE_LABELS
        )
        prepare = GaugeMetricFamily(
            "kunlun_instance_prepare_seconds",
            "Time the instance took from assignment to its engine's start (download, plan)",
            labels=INSTANCE_LABELS,
        )
        first = GaugeMetricFamily(
            "kunlun_instance_first_token_seconds",
            "Latency of the engine's first token in its readiness check",
            labels=INSTANCE_LABELS,
        )
        oom = GaugeMetricFamily(
            "kunlun_instance_oom_killed",
            "1 when the engine's last exit was an OOM kill",
            labels=INSTANCE_LABELS,
        )
        memory = GaugeMetricFamily(
            "kunlun_instance_memory_bytes",
            "Memory charged to the instance's cgroup (engine processes, page cache, kernel memory)",
            labels=INSTANCE_LABELS,
        )
        cpu = CounterMetricFamily(
            "kunlun_instance_cpu_seconds",
            "CPU time used by the processes of the instance's cgroup",
            labels=INSTANCE_LABELS,
        )
        for i in instances:
            lab = list(i.labels)
            if self.usage is not None:
                mem_b, cpu_s = self.usage(i.labels[2])
                if mem_b is not None:
                    memory.add_metric(lab, float(mem_b))
                if cpu_s is not None:
                    cpu.add_metric(lab, cpu_s)
            for p in PHASES:
                phase.add_metric([*lab, p], 1.0 if i.phase == p else 0.0)
            restarts.add_metric(lab, float(i.restarts))
            prepare.add_metric(lab, i.prepare_s)
            if i.first_token_s > 0:
                first.add_metric(lab, i.first_token_s)
            oom.add_metric(lab, 1.0 if i.oom_killed else 0.0)
        yield from (phase, restarts, prepare, first, oom, memory, cpu)
        up = GaugeMetricFamily(
            "kunlun_agent_connected", "1 while the agent's stream to a replica is acknowledged"
        )
        up.add_metric([], 1.0 if self.connected else 0.0)
        yield up


class AgentMetrics:
    """The agent's registry; `prepare()` copies the current state (call on the event loop)."""

    def __init__(
        self,
        node: str,
        devices: Callable[[], list[types_pb2.Device]],
        instances: Callable[[], list[agent_pb2.InstanceStatus]],
        connected: Callable[[], bool] = lambda: True,
        process_collector: bool = True,
        usage: CgroupUsage | None = None,
    ) -> None:
        self.node = node
        self._devices = devices
        self._instances = instances
        self._connected = connected
        self.registry = CollectorRegistry(auto_describe=False)
        self.collector = AgentCollector(usage)
        self.registry.register(self.collector)
        if process_collector:
            from prometheus_client import ProcessCollector

            ProcessCollector(registry=self.registry)

    async def prepare(self) -> None:
        self.collector.devices = device_rows(self.node, self._devices())
        self.collector.instances = instance_rows(self.node, self._instances())
        self.collector.connected = self._connected()
