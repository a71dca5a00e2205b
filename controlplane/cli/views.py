"""Turning API messages into the stable JSON shapes and table rows of the CLI."""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format

from kunlun_common.api import cluster_pb2, types_pb2
from kunlun_common.states import DeviceState, NodeState


def device_json(d: types_pb2.Device) -> dict[str, Any]:
    t = d.telemetry
    return {
        "name": d.name,
        "node": d.node,
        "device_type": d.device_type,
        "index": d.index,
        "model": d.model,
        "status": DeviceState.of(d.status),
        "status_reason": d.status_reason,
        "total_memory_mb": d.total_memory_mb,
        "hbm_memory_mb": d.hbm_memory_mb,
        "sys_memory_mb": d.sys_memory_mb,
        "memory_used_mb": t.memory_used_mb,
        "utilization_pct": round(t.utilization_pct, 1),
        "temperature_c": round(t.temperature_c, 1),
        "power_w": round(t.power_w, 1),
        "health": t.health,
        "fp16_tflops": d.fp16_tflops,
        "bf16_tflops": d.bf16_tflops,
        "int8_tflops": d.int8_tflops,
        "supported_dtypes": list(d.supported_dtypes),
        "p2p_enabled": d.p2p_enabled,
        "p2p_bandwidth_gbps": d.p2p_bandwidth_gbps,
        "topology_distance": list(d.topology_distance),
        "custom_attributes": json_format.MessageToDict(d.custom_attributes),
        "plugin": d.plugin,
    }


def device_row(d: types_pb2.Device) -> list[str]:
    t = d.telemetry
    status = DeviceState.of(d.status)
    online = d.status in (types_pb2.DEVICE_STATUS_READY, types_pb2.DEVICE_STATUS_UNHEALTHY)
    memory = f"{t.memory_used_mb}/{d.hbm_memory_mb} MB" if online else f"-/{d.hbm_memory_mb} MB"
    topo = ",".join(str(x) for x in d.topology_distance) or "-"
    if d.p2p_enabled:
        topo += " p2p"
    return [
        d.node,
        d.name,
        f"{d.device_type} {d.model}".strip(),
        status,
        memory,
        f"{t.utilization_pct:.0f}%" if online else "-",
        f"{t.temperature_c:.0f} C" if online else "-",
        topo,
    ]


DEVICE_HEADERS = ["NODE", "DEVICE", "TYPE", "STATUS", "MEMORY", "UTILIZATION", "TEMPERATURE", "TOPOLOGY"]


def node_json(n: types_pb2.Node) -> dict[str, Any]:
    return {
        "name": n.name,
        "address": n.address,
        "ready": n.ready,
        "status": NodeState.READY if n.ready else NodeState.NOT_READY,
        "simulated": n.simulated,
        "cordoned": n.cordoned,
        "devices": len(n.devices),
        "agent_version": n.agent_version,
        "pid": n.agent_pid,
        "connected_replica": n.connected_replica,
        "registered_at_unix_ms": n.registered_at_unix_ms,
        "config_path": n.config_path,
        "updated_by": n.updated_by,
    }


def replica_json(r: cluster_pb2.ReplicaInfo, healthy: bool) -> dict[str, Any]:
    return {
        "name": r.name,
        "address": r.address,
        "pid": r.pid,
        "healthy": healthy,
        "leader": r.leader,
        "version": r.version,
        "started_at_unix_ms": r.started_at_unix_ms,
    }


def member_json(m: cluster_pb2.EtcdMemberInfo) -> dict[str, Any]:
    return {
        "name": m.name,
        "endpoint": m.endpoint,
        "healthy": m.healthy,
        "leader": m.leader,
        "db_size_bytes": m.db_size_bytes,
        "error": m.error,
    }
