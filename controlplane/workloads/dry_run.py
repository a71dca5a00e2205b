"""`workload submit --dry-run`: where a checked spec's instances would land now, and why; no write.

The same pure `schedule()` the leader runs, on a snapshot read from etcd (nodes, liveness, cordons,
allocations, instances, telemetry, scheduler config), with the new workload's instances queued after
everything already pending (weighted-fair order decides between priorities, as for real).
"""

from __future__ import annotations

import time

from controlplane import keys
from controlplane.scheduler.model import PendingInstance
from controlplane.scheduler.plan import schedule
from controlplane.scheduler.snapshot import (
    SCHEDULING,
    decode_state,
    graph_snapshot,
    queue_inputs,
    workload_req,
)
from controlplane.store import EtcdStore
from controlplane.store.contract import KV
from kunlun_common.api import workload_pb2

DRY = "dry-run/"


async def dry_run_plan(store: EtcdStore, spec: workload_pb2.WorkloadSpec) -> list[str]:
    kvs: dict[str, KV] = {}
    revision = 0
    for prefix in (*SCHEDULING, keys.TELEMETRY):
        got, rev = await store.get_prefix(prefix)
        kvs.update({kv.key: kv for kv in got})
        revision = max(revision, rev)
    st = decode_state(kvs, revision)
    pending, running = queue_inputs(st)
    req = workload_req(workload_pb2.Workload(id="dry-run", spec=spec))
    now = time.time()
    seq0 = max((p.seq for p in pending), default=0) + 1
    new = [PendingInstance(f"{DRY}{i}", req, now, seq0 + i) for i in range(max(1, spec.replicas))]
    plan = schedule(graph_snapshot(st), [*pending, *new], running, st.config, now)
    lines: list[str] = []
    for p in plan.placements:
        if p.instance_id.startswith(DRY):
            pre = f", preempting {', '.join(p.preempts)}" if p.preempts else ""
            lines.append(
                f"instance {p.instance_id[len(DRY) :]}: {', '.join(p.devices)} (score {p.score:.2f}{pre})"
            )
    for u in plan.unplaced:
        if u.instance_id.startswith(DRY):
            why = "; ".join(f"{n}: {r}" for n, r in u.reasons.items()) or "no node"
            lines.append(f"instance {u.instance_id[len(DRY) :]}: not placed now ({why})")
    return lines
