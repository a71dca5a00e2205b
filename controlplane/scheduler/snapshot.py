"""Build the scheduler's inputs from the graph cache (pure: dict of keys -> plan inputs)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

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
from controlplane.store import KV
from kunlun_common.api import rollout_pb2, types_pb2, workload_pb2
from kunlun_common.states import PLACED, DeviceState, InstancePhase


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
    config: SchedulerConfig = field(default_factory=SchedulerConfig)
    config_error: str = ""


def decode_state(kvs: Mapping[str, KV], revision: int) -> ClusterState:
    st = ClusterState(revision=revision)
    for key, kv in kvs.items():
        if key.startswith(keys.NODES):
            n = types_pb2.Node()
            keys.decode_message(kv.value, n)
            st.nodes[n.name] = n
        elif key.startswith(keys.ALIVE):
            st.alive.add(keys.last_segment(key))
        elif key.startswith(keys.NODE_STATUS):
            st.node_status[keys.last_segment(key)] = keys.decode(kv.value)
        elif key.startswith(keys.CORDONS):
            st.cordons[keys.last_segment(key)] = keys.decode(kv.value)
        elif key.startswith(keys.TELEMETRY):
            st.telemetry[keys.last_segment(key)] = keys.decode(kv.value)
        elif key.startswith(keys.WORKLOADS):
            w = workload_pb2.Workload()
            keys.decode_message(kv.value, w)
            st.workloads[w.id] = (w, kv)
        elif key.startswith(keys.INSTANCES):
            i = workload_pb2.Instance()
            keys.decode_message(kv.value, i)
            st.instances[i.id] = (i, kv)
        elif key.startswith(keys.ALLOC):
            st.allocs[keys.alloc_device(key)] = (str(keys.decode(kv.value)["instance"]), kv)
        elif key.startswith(keys.ROLLOUTS):
            r = rollout_pb2.Rollout()
            keys.decode_message(kv.value, r)
            st.rollouts[r.workload_id] = r
        elif key == keys.SCHEDULER_CONFIG:
            try:
                st.config = parse_scheduler_config(str(keys.decode(kv.value)["yaml"]))
            except Exception as e:  # stored config was validated by the API; never crash on it
                st.config_error = str(e)
    return st


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
    )


def graph_snapshot(st: ClusterState, exclude_nodes: frozenset[str] = frozenset()) -> GraphSnapshot:
    nodes = []
    for name in sorted(st.nodes):
        n = st.nodes[name]
        ready = name in st.alive and name not in exclude_nodes
        cordoned = bool(st.cordons.get(name, {}).get("cordoned", False)) or name in exclude_nodes
        tele = st.telemetry.get(name, {}).get("devices", {})
        devices = []
        for d in n.devices:
            t = types_pb2.DeviceTelemetry()
            if isinstance(tele, dict) and d.name in tele:
                json_format.ParseDict(tele[d.name], t, ignore_unknown_fields=True)
            status = DeviceState.of(d.status) if ready else DeviceState.UNAVAILABLE
            if status is DeviceState.UNKNOWN:  # an unspecified status is a declaration error
                status = DeviceState.ERROR
            holder = st.allocs.get(d.name)
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
                    allocated_to=holder[0] if holder else None,
                    custom_attributes=json_format.MessageToDict(d.custom_attributes),
                )
            )
        nodes.append(NodeView(name=name, ready=ready, cordoned=cordoned, devices=tuple(devices)))
    return GraphSnapshot(nodes=tuple(nodes), revision=st.revision)


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
