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
from controlplane.scheduler.reasons import node_reason_message
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
from kunlun_common.messages import Message, msg, msg_list

DRY = "dry-run/"


async def dry_run_plan(store: EtcdStore, spec: workload_pb2.WorkloadSpec) -> list[Message]:
    """One message per new instance: the devices it would take now (score, whom it would preempt),
    or why no node takes it, per node (the filters' reasons, `reasons.node_reason_message`)."""
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
    lines: list[Message] = []
    for p in plan.placements:
        if p.instance_id.startswith(DRY):
            ordinal, devices, score = p.instance_id[len(DRY) :], ", ".join(p.devices), f"{p.score:.2f}"
            if p.preempts:
                lines.append(
                    msg(
                        "dry_run.placed_preempting",
                        "instance {ordinal}: {devices} (score {score}, preempting {victims})",
                        ordinal=ordinal,
                        devices=devices,
                        score=score,
                        victims=", ".join(p.preempts),
                    )
                )
            else:
                lines.append(
                    msg(
                        "dry_run.placed",
                        "instance {ordinal}: {devices} (score {score})",
                        ordinal=ordinal,
                        devices=devices,
                        score=score,
                    )
                )
    for u in plan.unplaced:
        if u.instance_id.startswith(DRY):
            why: Message = (
                msg_list(
                    "dry_run.reasons",
                    "{parts}",
                    [node_reason_message(n, r) for n, r in u.reasons.items()],
                    bullet="",
                    sep="; ",
                )
                if u.reasons
                else msg("instance.no_node", "no node")
            )
            lines.append(
                msg(
                    "dry_run.not_placed",
                    "instance {ordinal}: not placed now ({why})",
                    ordinal=u.instance_id[len(DRY) :],
                    why=why,
                )
            )
    return lines
