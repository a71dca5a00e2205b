"""The cluster-wide device view behind `kunlun-cli telemetry metrics`, its filters, and the
utilization spread of each workload (load balance).

The view is gathered from what the replicas already hold: node records and the instances from etcd,
and each device's latest sample — from the agent's heartbeats when the agent's stream is held by
this replica, else from the coarse snapshot its replica writes to etcd (`controlplane/nodes.py`).
Nodes are never polled for it.

Filter grammar (`--filter`): conditions separated by commas, all of which must hold, each
`FIELD OP VALUE` with OP one of `==`, `!=`, `=~`, `!~` (regular expressions, anchored like
PromQL's) for text fields and `==`, `!=`, `>`, `>=`, `<`, `<=` for numbers.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from dataclasses import dataclass

from controlplane import graph_pages, keys, paging
from controlplane.graph import load_nodes
from controlplane.metrics import WorkloadSpread, spread
from controlplane.nodes import NodeSessions
from controlplane.store import EtcdStore
from controlplane.store.contract import prefix_end
from controlplane.workloads import records
from kunlun_common.api import telemetry_pb2, types_pb2, workload_pb2
from kunlun_common.errors import InvalidInput
from kunlun_common.messages import msg
from kunlun_common.names import VENDORS
from kunlun_common.states import PLACED

MB = 1024 * 1024
PLACED_PHASES = PLACED
TEXT_FIELDS = ("node", "device", "device_type", "vendor", "model", "status", "health", "workload", "instance")
NUMBER_FIELDS = {
    "utilization": "utilization",
    "temperature": "temperature_c",
    "temperature_c": "temperature_c",
    "power": "power_w",
    "power_w": "power_w",
    "memory_used_bytes": "memory_used_bytes",
    "memory_total_bytes": "memory_total_bytes",
    "memory_used_ratio": "",
}
_OPS = ("==", "!=", "=~", "!~", ">=", "<=", ">", "<")
_COND_RE = re.compile(r"^\s*([a-z_]+)\s*(==|!=|=~|!~|>=|<=|>|<)\s*(.*?)\s*$")
MAX_FILTER_CHARS = 1000


class FilterError(InvalidInput):
    """A filter that cannot be parsed; the message names the condition and the fix."""


@dataclass(frozen=True)
class Condition:
    field: str
    op: str
    value: str
    test: Callable[[telemetry_pb2.DeviceMetric], bool]


def _number(m: telemetry_pb2.DeviceMetric, name: str) -> float:
    if name == "memory_used_ratio":
        return m.memory_used_bytes / m.memory_total_bytes if m.memory_total_bytes else 0.0
    return float(getattr(m, NUMBER_FIELDS[name]))


def parse_filter(expr: str) -> list[Condition]:
    """Parse `device_type==cambricon,node=~node-a|node-b,utilization>0.8`; FilterError when invalid."""
    if len(expr) > MAX_FILTER_CHARS:
        raise FilterError(
            msg(
                "telemetry.filter_at_most_characters",
                "filter: at most {max_filter_chars} characters, found {count}",
                max_filter_chars=MAX_FILTER_CHARS,
                count=len(expr),
            )
        )
    out: list[Condition] = []
    for raw in expr.split(","):
        if not raw.strip():
            continue
        m = _COND_RE.match(raw)
        if not m:
            raise FilterError(
                msg(
                    "telemetry.filter_not_field_op",
                    "filter: {strip!r} is not FIELD OP VALUE (e.g. device_type==cambricon, utilization>0.8, node=~node-a|node-b); operators: {items}",
                    strip=raw.strip(),
                    items=" ".join(_OPS),
                )
            )
        name, op, value = m.group(1), m.group(2), m.group(3).strip("'\"")
        out.append(_condition(name, op, value, raw.strip()))
    return out


def _condition(name: str, op: str, value: str, raw: str) -> Condition:
    if name in TEXT_FIELDS:
        if op in (">", ">=", "<", "<="):
            raise FilterError(
                msg(
                    "telemetry.filter_text_use",
                    "filter: {raw!r}: {name} is text; use ==, !=, =~ or !~",
                    raw=raw,
                    name=name,
                )
            )
        if op in ("=~", "!~"):
            try:
                rx = re.compile(value)
            except re.error as e:
                raise FilterError(
                    msg(
                        "telemetry.filter_invalid_regular_expression",
                        "filter: {raw!r}: invalid regular expression ({e})",
                        raw=raw,
                        e=e,
                    )
                ) from None
            want = op == "=~"
            return Condition(
                name, op, value, lambda m: (rx.fullmatch(str(getattr(m, name))) is not None) == want
            )
        if op == "==":
            return Condition(name, op, value, lambda m: str(getattr(m, name)) == value)
        return Condition(name, op, value, lambda m: str(getattr(m, name)) != value)
    if name in NUMBER_FIELDS:
        if op in ("=~", "!~"):
            raise FilterError(
                msg(
                    "telemetry.filter_number_use",
                    "filter: {raw!r}: {name} is a number; use ==, !=, >, >=, < or <=",
                    raw=raw,
                    name=name,
                )
            )
        try:
            x = float(value.rstrip("%")) / (100.0 if value.endswith("%") else 1.0)
        except ValueError:
            raise FilterError(
                msg(
                    "telemetry.filter_expected_number_after",
                    "filter: {raw!r}: expected a number after {op}, found {value!r}",
                    raw=raw,
                    op=op,
                    value=value,
                )
            ) from None
        cmp: dict[str, Callable[[float], bool]] = {
            "==": lambda v: v == x,
            "!=": lambda v: v != x,
            ">": lambda v: v > x,
            ">=": lambda v: v >= x,
            "<": lambda v: v < x,
            "<=": lambda v: v <= x,
        }
        f = cmp[op]
        return Condition(name, op, value, lambda m: f(_number(m, name)))
    known = ", ".join((*TEXT_FIELDS, *NUMBER_FIELDS))
    raise FilterError(
        msg(
            "telemetry.filter_unknown_field_known",
            "filter: {raw!r}: unknown field {name!r}; known fields: {known}",
            raw=raw,
            name=name,
            known=known,
        )
    )


def matches(m: telemetry_pb2.DeviceMetric, conditions: list[Condition]) -> bool:
    return all(c.test(m) for c in conditions)


def _status(status: int) -> str:
    name = (
        types_pb2.DeviceStatus.Name(types_pb2.DeviceStatus.ValueType(status))
        if status in types_pb2.DeviceStatus.values()
        else ""
    )
    return name.removeprefix("DEVICE_STATUS_").capitalize() or "Unknown"


def device_metrics(
    nodes: list[types_pb2.Node], holders: dict[str, workload_pb2.Instance]
) -> list[telemetry_pb2.DeviceMetric]:
    """One flattened row per device, with the instance (and workload) holding it."""
    return [metric_row(n.name, d, holders.get(d.name)) for n in nodes for d in n.devices]


def metric_row(
    node: str, d: types_pb2.Device, inst: workload_pb2.Instance | None
) -> telemetry_pb2.DeviceMetric:
    """One device's row, with the instance (and workload) holding it."""
    t = d.telemetry
    return telemetry_pb2.DeviceMetric(
        node=node,
        device=d.name,
        device_type=d.device_type,
        vendor=VENDORS.get(d.device_type, "unknown"),
        model=d.model,
        status=_status(d.status),
        health=t.health,
        utilization=t.utilization_pct / 100.0,
        memory_used_bytes=t.memory_used_mb * MB,
        memory_total_bytes=(d.hbm_memory_mb or d.total_memory_mb) * MB,
        temperature_c=t.temperature_c,
        power_w=t.power_w,
        sampled_at_unix_ms=t.sampled_at_unix_ms,
        instance=inst.id if inst else "",
        workload=inst.workload if inst else "",
    )


HOLDER_READS = 64
"""Instance records one page reads at once (each of a page's devices names at most one)."""


async def device_metrics_page(
    store: EtcdStore, sessions: NodeSessions | None, request: paging.PageRequest
) -> tuple[list[telemetry_pb2.DeviceMetric], str, int]:
    """One page of device rows (see controlplane/paging.py), their holders read at the page's
    revision: the page's allocation keys, then the instances they name (O(page), not O(cluster)).
    Returns (rows, next_page_token, revision)."""
    page = await graph_pages.device_page(store, sessions, request)
    holders = await holders_at(store, page.devices, page.revision)
    rows = [metric_row(d.node, d, holders.get(d.name)) for d in page.devices]
    return rows, page.next_page_token, page.revision


async def holders_at(
    store: EtcdStore, devices: list[types_pb2.Device], revision: int
) -> dict[str, workload_pb2.Instance]:
    """The placed instance holding each of `devices` (node by node, in name order) at `revision`."""
    if not devices:
        return {}
    wanted = {d.name for d in devices}
    first, last = devices[0].node, devices[-1].node
    kvs, _, _ = await paging.read_range(
        store, keys.ALLOC + first + "/", prefix_end(keys.ALLOC + last + "/"), 0, revision
    )
    held: dict[str, str] = {}
    for kv in kvs:
        dev = keys.alloc_device(kv.key)
        if dev in wanted:
            held[dev] = str(keys.decode(kv.value).get("instance", ""))
    insts: dict[str, workload_pb2.Instance] = {}
    ids = sorted(set(held.values()))
    for at in range(0, len(ids), HOLDER_READS):
        found = await asyncio.gather(
            *(
                paging.read_range(store, keys.instance(i), (keys.instance(i) + "\0").encode(), 1, revision)
                for i in ids[at : at + HOLDER_READS]
            )
        )
        for one, _, _ in found:
            for kv in one:
                inst = records.decode_instance(kv)
                if inst.phase in PLACED_PHASES and inst.target_devices:
                    insts[inst.id] = inst
    return {dev: insts[iid] for dev, iid in held.items() if iid in insts and dev in insts[iid].target_devices}


async def placed_instances(store: EtcdStore) -> list[workload_pb2.Instance]:
    kvs, _ = await store.get_prefix(keys.INSTANCES)
    out = []
    for kv in kvs:
        inst = records.decode_instance(kv)
        if inst.phase in PLACED_PHASES and inst.target_devices:
            out.append(inst)
    return out


def holders_of(instances: list[workload_pb2.Instance]) -> dict[str, workload_pb2.Instance]:
    return {d: inst for inst in instances for d in inst.target_devices}


async def cluster_view(
    store: EtcdStore, sessions: NodeSessions | None
) -> tuple[list[types_pb2.Node], list[workload_pb2.Instance]]:
    nodes, instances = await asyncio.gather(load_nodes(store, sessions), placed_instances(store))
    return nodes, instances


def spreads(nodes: list[types_pb2.Node], instances: list[workload_pb2.Instance]) -> list[WorkloadSpread]:
    """Utilization spread across the devices of each workload's placed instances."""
    util = {d.name: d.telemetry.utilization_pct / 100.0 for n in nodes for d in n.devices}
    by_workload: dict[str, list[float]] = {}
    for inst in instances:
        vals = by_workload.setdefault(inst.workload, [])
        vals.extend(util[d] for d in inst.target_devices if d in util)
    return [spread(w, v) for w, v in sorted(by_workload.items())]


async def nodes_and_spreads(
    store: EtcdStore, sessions: NodeSessions | None
) -> tuple[list[types_pb2.Node], list[WorkloadSpread]]:
    nodes, instances = await cluster_view(store, sessions)
    return nodes, spreads(nodes, instances)
