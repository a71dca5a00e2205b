"""Build the scheduler's inputs from the graph cache (pure: dict of keys -> plan inputs)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

from google.protobuf import json_format

from controlplane import keys
from controlplane.scheduler.config import SchedulerConfig, parse_scheduler_config
from controlplane.scheduler.model import (
    DeviceView,
    GraphSnapshot,
    NodeView,
    PendingInstance,
    RunningInstance,
    WorkloadReq,
)
from controlplane.store.contract import KV
from kunlun_common.api import rollout_pb2, types_pb2, workload_pb2
from kunlun_common.states import PLACED, DeviceState, InstancePhase

if TYPE_CHECKING:  # only handed in: the decisions built on these states do no I/O
    from controlplane.cache import GraphCache


@dataclass
class ClusterState:
    """Everything the leader decides from, decoded once per tick."""

    revision: int
    nodes: dict[str, types_pb2.Node] = field(default_factory=dict)
    alive: set[str] = field(default_factory=set)
    node_status: dict[str, dict[str, object]] = field(default_factory=dict)
    cordons: dict[str, dict[str, object]] = field(default_factory=dict)
    telemetry: dict[str, dict[str, object]] = field(default_factory=dict)
    workloads: dict[str, tuple[workload_pb2.Workload, KV]] = field(default_factory=dict)
    instances: dict[str, tuple[workload_pb2.Instance, KV]] = field(default_factory=dict)
    allocs: dict[str, tuple[str, KV]] = field(default_factory=dict)
    rollouts: dict[str, rollout_pb2.Rollout] = field(default_factory=dict)  # by workload id
    statuses: dict[str, tuple[str, str]] = field(default_factory=dict)
    """Per instance id: (node, phase) its agent last reported (observed state; rolling updates wait
    for Running)."""
    config: SchedulerConfig = field(default_factory=SchedulerConfig)
    config_error: str = ""
    views: dict[str, tuple[object, ...]] = field(default_factory=dict)
    """Each node's view from an earlier tick with the inputs it was built from (shared between
    ticks by `IncrementalState`): reused while the node record and telemetry are the same decoded
    objects and readiness, cordon and device holders are equal."""


SCHEDULING = (
    keys.NODES,
    keys.ALIVE,
    keys.NODE_STATUS,
    keys.CORDONS,
    keys.WORKLOADS,
    keys.INSTANCES,
    keys.ALLOC,
    keys.ROLLOUTS,
    keys.SCHEDULER_CONFIG,
)
"""Changes that can change a decision: the leader's loop wakes on these. Telemetry is kept current
(for scores) but does not wake it; the loop's periodic tick reads the latest."""


class IncrementalState:
    """The leader's decoded cluster state, kept current one changed key at a time.

    A cache `Listener`: a change decodes only its own record (a telemetry write decodes nothing:
    it is decoded, once, when the next tick reads it). `current()` hands each tick its own
    shallow copies of the indexes, so a tick never sees a half-applied change. Decoded records are
    shared between ticks: decisions copy a record before changing it (see `actions`).
    """

    def __init__(self, cache: GraphCache | None) -> None:
        self.cache = cache
        self.st = ClusterState(revision=0)
        self._telemetry_raw: dict[str, KV] = {}
        self._telemetry_dirty: set[str] = set()
        self._views: dict[str, tuple[object, ...]] = {}
        if cache is not None:  # instance statuses are kept current but do not wake the loop
            cache.listen((*SCHEDULING, keys.TELEMETRY, keys.INSTANCE_STATUS), self)

    def reset(self, kvs: Mapping[str, KV]) -> None:
        self.st = ClusterState(revision=0)
        self._telemetry_raw.clear()
        self._telemetry_dirty.clear()
        for key, kv in kvs.items():
            self.apply(key, kv)

    def apply(self, key: str, kv: KV | None) -> None:
        st = self.st
        name = keys.last_segment(key)
        work = self.cache.work if self.cache is not None else None
        if key.startswith(keys.TELEMETRY):
            if kv is None:
                self._telemetry_raw.pop(name, None)
            else:
                self._telemetry_raw[name] = kv
            self._telemetry_dirty.add(name)
            return
        if key.startswith(keys.ALIVE):
            if kv is None:
                st.alive.discard(name)
            else:
                st.alive.add(name)
            return
        if key.startswith(keys.INSTANCE_STATUS):
            if kv is None:
                st.statuses.pop(name, None)
            else:
                try:
                    data = keys.decode(kv.value)
                except ValueError:  # written by replicas; never crash the leader on one
                    st.statuses.pop(name, None)
                    return
                status = data.get("status", {})
                phase = str(status.get("phase", "")) if isinstance(status, dict) else ""
                st.statuses[name] = (str(data.get("node", "")), phase)
            return
        if work is not None:
            work.decodes += 1 if kv is not None else 0
        if key.startswith(keys.NODES):
            if kv is None:
                st.nodes.pop(name, None)
            else:
                n = types_pb2.Node()
                keys.decode_message(kv.value, n)
                st.nodes[name] = n
        elif key.startswith(keys.NODE_STATUS):
            _put(st.node_status, name, None if kv is None else keys.decode(kv.value))
        elif key.startswith(keys.CORDONS):
            _put(st.cordons, name, None if kv is None else keys.decode(kv.value))
        elif key.startswith(keys.WORKLOADS):
            if kv is None:
                st.workloads.pop(name, None)
            else:
                w = workload_pb2.Workload()
                keys.decode_message(kv.value, w)
                st.workloads[name] = (w, kv)
        elif key.startswith(keys.INSTANCES):
            if kv is None:
                st.instances.pop(name, None)
            else:
                i = workload_pb2.Instance()
                keys.decode_message(kv.value, i)
                st.instances[name] = (i, kv)
        elif key.startswith(keys.ALLOC):
            dev = keys.alloc_device(key)
            if kv is None:
                st.allocs.pop(dev, None)
            else:
                st.allocs[dev] = (str(keys.decode(kv.value)["instance"]), kv)
        elif key.startswith(keys.ROLLOUTS):
            if kv is None:
                st.rollouts.pop(name, None)
            else:
                r = rollout_pb2.Rollout()
                keys.decode_message(kv.value, r)
                st.rollouts[name] = r
        elif key == keys.SCHEDULER_CONFIG:
            st.config, st.config_error = SchedulerConfig(), ""
            if kv is not None:
                try:
                    st.config = parse_scheduler_config(str(keys.decode(kv.value)["yaml"]))
                except Exception as e:  # stored config was validated by the API; never crash on it
                    st.config_error = str(e)

    def current(self, revision: int | None = None) -> ClusterState:
        """The state for one tick (the indexes copied; records shared, never modified)."""
        st = self.st
        for name in self._telemetry_dirty:
            kv = self._telemetry_raw.get(name)
            _put(st.telemetry, name, None if kv is None else keys.decode(kv.value))
        self._telemetry_dirty.clear()
        if revision is None:
            revision = self.cache.revision if self.cache is not None else st.revision
        return ClusterState(
            revision=revision,
            nodes=dict(st.nodes),
            alive=set(st.alive),
            node_status=dict(st.node_status),
            cordons=dict(st.cordons),
            telemetry=dict(st.telemetry),
            workloads=dict(st.workloads),
            instances=dict(st.instances),
            allocs=dict(st.allocs),
            rollouts=dict(st.rollouts),
            statuses=dict(st.statuses),
            config=st.config,
            config_error=st.config_error,
            views=self._views,
        )


def _put(d: dict[str, dict[str, object]], name: str, value: dict[str, object] | None) -> None:
    if value is None:
        d.pop(name, None)
    else:
        d[name] = value


def cache_state(cache: GraphCache) -> ClusterState:
    """The decoded state of `cache` for one tick, kept incrementally between ticks."""
    return cache.derived(IncrementalState).current()


def decode_state(kvs: Mapping[str, KV], revision: int) -> ClusterState:
    """Decode a whole key set at once (tests and tools; the leader uses `cache_state`)."""
    inc = IncrementalState(None)
    inc.reset(kvs)
    return inc.current(revision)


def workload_req(w: workload_pb2.Workload) -> WorkloadReq:
    s = w.spec
    return WorkloadReq(
        workload_id=w.id,
        name=s.name,
        model=s.model,
        quantization=s.quantization or "none",
        dtype=s.dtype or "bf16",
        devices_per_instance=max(1, s.devices_per_instance),
        memory_per_device_mb=int(s.memory_per_device_mb),
        priority=s.priority or "normal",
        preferred_device_types=tuple(s.preferred_device_types),
        pin=s.pin or None,
        require_p2p=s.require_p2p,
        engine=s.engine or "sglang",
    )


def graph_snapshot(st: ClusterState, exclude_nodes: frozenset[str] = frozenset()) -> GraphSnapshot:
    """The scheduler's view of every node; a node whose inputs did not change since an earlier
    tick reuses that tick's view (no telemetry re-parsing: a tick costs O(changed nodes) decodes)."""
    nodes: list[NodeView] = []
    for name in sorted(st.nodes):
        n = st.nodes[name]
        ready = name in st.alive and name not in exclude_nodes
        cordoned = bool(st.cordons.get(name, {}).get("cordoned", False)) or name in exclude_nodes
        tele = st.telemetry.get(name, {}).get("devices", {})
        holders = tuple(st.allocs.get(d.name, _FREE)[0] for d in n.devices)
        memo = st.views.get(name)
        if memo is not None and memo[0] is n and memo[1] is tele and memo[2:5] == (ready, cordoned, holders):
            nodes.append(cast(NodeView, memo[5]))
            continue
        view = _node_view(name, n, tele, ready, cordoned, holders)
        st.views[name] = (n, tele, ready, cordoned, holders, view)
        nodes.append(view)
    if len(st.views) > len(st.nodes):
        for gone in [k for k in st.views if k not in st.nodes]:
            del st.views[gone]
    return GraphSnapshot(nodes=tuple(nodes), revision=st.revision)


_FREE: tuple[str, None] = ("", None)


def _node_view(
    name: str, n: types_pb2.Node, tele: object, ready: bool, cordoned: bool, holders: tuple[str, ...]
) -> NodeView:
    devices = []
    for d, holder in zip(n.devices, holders, strict=True):
        t = types_pb2.DeviceTelemetry()
        if isinstance(tele, dict) and d.name in tele:
            json_format.ParseDict(tele[d.name], t, ignore_unknown_fields=True)
        status = DeviceState.of(d.status) if ready else DeviceState.UNAVAILABLE
        if status is DeviceState.UNKNOWN:  # an unspecified status is a declaration error
            status = DeviceState.ERROR
        devices.append(
            DeviceView(
                name=d.name,
                node=name,
                device_type=d.device_type,
                index=d.index,
                model=d.model,
                hbm_memory_mb=int(d.hbm_memory_mb),
                supported_dtypes=tuple(d.supported_dtypes),
                fp16_tflops=d.fp16_tflops,
                bf16_tflops=d.bf16_tflops,
                int8_tflops=d.int8_tflops,
                p2p_enabled=d.p2p_enabled,
                topology_distance=tuple(d.topology_distance),
                status=status,
                utilization_pct=t.utilization_pct,
                temperature_c=t.temperature_c,
                allocated_to=holder or None,
                custom_attributes=json_format.MessageToDict(d.custom_attributes),
            )
        )
    return NodeView(name=name, ready=ready, cordoned=cordoned, devices=tuple(devices))


def queue_inputs(st: ClusterState) -> tuple[list[PendingInstance], list[RunningInstance]]:
    pending: list[PendingInstance] = []
    running: list[RunningInstance] = []
    for inst, _ in st.instances.values():
        wk = st.workloads.get(inst.workload_id)
        if wk is None or wk[0].deleting:
            continue
        req = workload_req(wk[0])
        if inst.phase == InstancePhase.PENDING:
            pending.append(PendingInstance(inst.id, req, inst.enqueued_at_unix_ms / 1000, int(inst.seq)))
        elif inst.phase in PLACED and inst.target_devices:
            started = inst.history[-1].at_unix_ms / 1000 if inst.history else 0.0
            running.append(RunningInstance(inst.id, req, tuple(inst.target_devices), started))
    return pending, running
