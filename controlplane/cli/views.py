"""Turning API messages into the stable JSON shapes and table rows of the CLI."""

from __future__ import annotations

import unicodedata
from typing import Any, Protocol

from google.protobuf import json_format

from kunlun_common.api import cluster_pb2, types_pb2
from kunlun_common.i18n import localize, pgettext
from kunlun_common.messages import Message, from_stored, plain
from kunlun_common.states import DeviceState, NodeState


class _WithReason(Protocol):
    @property
    def reason(self) -> str: ...
    @property
    def reason_message(self) -> str: ...


def reason_of(record: _WithReason) -> Message:
    """A stored reason (an instance's, a rollout's, an analysis', a history event's) as the message
    the replica stored beside it; its English text as is when there is none (an older record, a
    reason a node reported) or it no longer matches the text."""
    return from_stored(record.reason_message, record.reason) or plain(record.reason)


def shown_reason(record: _WithReason) -> str:
    """A stored reason in the reader's language (`-o json` keeps `reason` as stored)."""
    return localize(reason_of(record), record.reason)


def shown_status_reason(d: types_pb2.Device) -> str:
    """A device's status reason in the reader's language: the message its agent (or replica) set
    beside it (`status_reason_message`), else its text as is (an older agent, a plugin's own text);
    `-o json` keeps `status_reason` as stored."""
    m = from_stored(d.status_reason_message, d.status_reason)
    return d.status_reason if m is None else localize(m, d.status_reason)


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


def describe_labels() -> dict[str, str]:
    """The labels `device describe` and `node describe` show before each field, by its JSON key, in
    the reader's language (in English: the key with spaces, capitalized, as always)."""
    return {
        "name": pgettext("describe", "Name"),
        "node": pgettext("describe", "Node"),
        "device_type": pgettext("describe", "Device type"),
        "index": pgettext("describe", "Index"),
        "model": pgettext("describe", "Model"),
        "status": pgettext("describe", "Status"),
        "status_reason": pgettext("describe", "Status reason"),
        "total_memory_mb": pgettext("describe", "Total memory mb"),
        "hbm_memory_mb": pgettext("describe", "Hbm memory mb"),
        "sys_memory_mb": pgettext("describe", "Sys memory mb"),
        "memory_used_mb": pgettext("describe", "Memory used mb"),
        "utilization_pct": pgettext("describe", "Utilization pct"),
        "temperature_c": pgettext("describe", "Temperature c"),
        "power_w": pgettext("describe", "Power w"),
        "health": pgettext("describe", "Health"),
        "fp16_tflops": pgettext("describe", "Fp16 tflops"),
        "bf16_tflops": pgettext("describe", "Bf16 tflops"),
        "int8_tflops": pgettext("describe", "Int8 tflops"),
        "supported_dtypes": pgettext("describe", "Supported dtypes"),
        "p2p_enabled": pgettext("describe", "P2p enabled"),
        "p2p_bandwidth_gbps": pgettext("describe", "P2p bandwidth gbps"),
        "topology_distance": pgettext("describe", "Topology distance"),
        "custom_attributes": pgettext("describe", "Custom attributes"),
        "plugin": pgettext("describe", "Plugin"),
        "node_ready": pgettext("describe", "Node ready"),
        "node_address": pgettext("describe", "Node address"),
        "address": pgettext("describe", "Address"),
        "ready": pgettext("describe", "Ready"),
        "simulated": pgettext("describe", "Simulated"),
        "cordoned": pgettext("describe", "Cordoned"),
        "devices": pgettext("describe", "Devices"),
        "agent_version": pgettext("describe", "Agent version"),
        "pid": pgettext("describe", "Pid"),
        "connected_replica": pgettext("describe", "Connected replica"),
        "registered_at_unix_ms": pgettext("describe", "Registered at unix ms"),
        "config_path": pgettext("describe", "Config path"),
        "updated_by": pgettext("describe", "Updated by"),
        "protections": pgettext("describe", "Protections"),
        "note": pgettext("describe", "Note"),
        "device_names": pgettext("describe", "Device names"),
    }


def display_width(text: str) -> int:
    """Terminal columns of `text`: wide (CJK) characters take two."""
    return sum(2 if unicodedata.east_asian_width(c) in ("W", "F") else 1 for c in text)


def describe_lines(d: dict[str, Any], width: int | None = None) -> list[str]:
    """`LABEL  value` lines of a describe command (labels padded to `width` columns; None: to the
    widest label plus one); lists joined with ", " ("-" when empty). A key without a label is shown
    as itself, with spaces."""
    labels = describe_labels()
    shown = {k: labels.get(k) or k.replace("_", " ").capitalize() for k in d}
    pad = max((display_width(t) for t in shown.values()), default=0) + 1 if width is None else width
    out = []
    for k, v in d.items():
        if isinstance(v, list):
            v = ", ".join(str(x) for x in v) or "-"
        out.append(f"{shown[k]}{' ' * max(0, pad - display_width(shown[k]))} {v}")
    return out


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
