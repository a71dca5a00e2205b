"""Helpers the layers share: options, text tables for evidence, device choice and the busy check."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from controlplane.cli.verify.api import NAME_PREFIX, Api
from controlplane.cli.verify.model import Evidence, evidence
from controlplane.cli.views import DEVICE_HEADERS, device_row
from kunlun_common.api import telemetry_pb2, types_pb2, workload_pb2
from kunlun_common.messages import Message, msg, msg_list, plain

READY = types_pb2.DEVICE_STATUS_READY


@dataclass(frozen=True)
class Options:
    """What the operator asked of a verify run (command-line flags)."""

    device: str = ""
    """Layer 2: the card to use (NODE/TYPE:INDEX); empty: the first free Ready one."""
    node: str = ""
    """Layer 3: the node whose cards to use; empty: the node with the most free Ready cards of one type."""
    requests: int = 1000
    """Requests of the layer 3 and layer 5 bursts (layer 2 sends a fifth of it, layer 4 half)."""
    concurrency: int = 32
    """Concurrent connections of a burst."""
    burst_timeout_s: float = 120.0
    """A burst stops after this many seconds whatever is left (counted as not sent)."""
    ready_timeout_s: float = 180.0
    """How long a test workload may take to be Running and routed."""
    allow_busy: bool = False
    """Run layers 2-5 even when devices they need are held by workloads this run did not create."""
    declared: tuple[str, ...] = ()
    """Device-plugin-config files whose topology matrices layer 1 compares with the graph's."""
    disruptive: bool = False
    """Layer 5 stops a replica; it runs only with this."""
    replica: str = ""
    """Layer 5: the replica to drain; empty: the leader (its handover is part of the check)."""


def text_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells)


def devices_evidence(devices: Sequence[types_pb2.Device], node: str = "") -> Evidence:
    cmd = f"kunlun-cli device list --node {node}" if node else "kunlun-cli device list"
    return evidence(cmd, text_table(DEVICE_HEADERS, [device_row(d) for d in devices]))


def metrics_evidence(rows: Sequence[telemetry_pb2.DeviceMetric], flt: str) -> Evidence:
    table = text_table(
        ["DEVICE", "TYPE", "STATUS", "UTIL", "MEM USED", "WORKLOAD"],
        [
            (
                r.device,
                r.device_type,
                r.status,
                f"{r.utilization * 100:.1f}%",
                f"{r.memory_used_bytes // 2**20} MB",
                r.workload or "-",
            )
            for r in rows
        ],
    )
    return evidence(f"kunlun-cli telemetry metrics --filter '{flt}'", table)


def workload_evidence(s: workload_pb2.WorkloadSummary) -> Evidence:
    data = {
        "name": s.workload.spec.name,
        "phase": s.phase,
        "instances": [
            {
                "id": i.id,
                "phase": i.phase,
                "devices": list(i.target_devices),
                "endpoint": i.endpoint,
                "prepare_seconds": round(i.prepare_seconds, 3),
                "first_token_ms": round(i.first_token_ms, 1),
                "restarts": i.restarts,
                "reason": i.reason,
            }
            for i in s.instances
        ],
    }
    return evidence(
        f"kunlun-cli workload describe {s.workload.spec.name} -o json", json.dumps(data, indent=1)
    )


def foreign_holders(api: Api, devices: Sequence[str]) -> dict[str, str]:
    """Device -> workload for the `devices` held by a workload this tool did not create."""
    want = set(devices)
    return {
        m.device: m.workload
        for m in api.metrics()
        if m.device in want and m.workload and not m.workload.startswith(NAME_PREFIX)
    }


def free_ready(api: Api) -> list[telemetry_pb2.DeviceMetric]:
    """Ready devices that no instance holds, by name."""
    return sorted(
        (m for m in api.metrics() if m.status == "Ready" and not m.workload), key=lambda m: m.device
    )


def pct(x: float) -> str:
    return f"{x:.1f} %"


def held_by(held: dict[str, str]) -> Message:
    """ "DEVICE held by WORKLOAD, ..." for the cards other workloads hold."""
    return msg_list(
        "verify.held",
        "{parts}",
        [
            msg("verify.held_by", "{device} held by {workload}", device=d, workload=w)
            for d, w in sorted(held.items())
        ],
        bullet="",
        sep=", ",
    )


def burst_command(gateway: str, requests: int, concurrency: int) -> Message:
    """The evidence command of a burst: what `wrk` would be asked."""
    return msg(
        "verify.ev.burst",
        "POST http://{gateway}/v1/chat/completions x{requests}, {concurrency} concurrent",
        gateway=gateway,
        requests=requests,
        concurrency=concurrency,
    )


def busy_threshold() -> Message:
    return msg("verify.busy_threshold", "held by no workload this run did not create (or --allow-busy)")


def cut(m: Message, chars: int) -> Message:
    """`m`, or its English text cut to `chars` characters (as it is) when it is longer."""
    text = str(m)
    return m if len(text) <= chars else plain(text[:chars])


def tool_command(command: Sequence[str], node: str) -> Message:
    """The evidence command of a vendor tool's reading taken on `node` through its agent."""
    return msg(
        "verify.ev.tool",
        "{command}   (on {node}, via kunlun.v1.LedgerService/NodeToolReading)",
        command=" ".join(command),
        node=node,
    )
