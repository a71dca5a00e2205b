"""The leader's reconcile decisions, pure: (cluster state, clocks, observations) -> units.

Which instances to create or remove (replicas, canaries, rolling updates, deletions, orphans),
which to move off NotReady nodes and Unhealthy devices once their grace passed, which to move off
drained nodes, and where to place the pending ones (with preemption). The scheduler loop
(`leader.py`) does the I/O around them: it decodes the state from its watch-fed cache, calls
these functions, commits the units in fenced transactions, logs and reports metrics.

No I/O here (no store, gRPC, etcd or asyncio: an import-linter contract in pyproject.toml), no
clock read: the wall clock `now` (queue ages) and this process's monotonic clock `mono` (graces)
are inputs. The only thing decisions remember between ticks is the `Observations` record, passed
in and handed back explicitly: when this leader term first saw each node without its lease, each
device Unhealthy and each instance retiring.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace
from functools import partial

from controlplane import keys
from controlplane.scheduler.actions import (
    Unit,
    create_instance,
    note_unplaced,
    place_instance,
    release_instance,
    remove_instance,
    retire_instance,
)
from controlplane.scheduler.canary import CANARY, canary_count
from controlplane.scheduler.model import PendingInstance, Placement, Unplaced
from controlplane.scheduler.plan import schedule
from controlplane.scheduler.reasons import more_nodes, node_reason_message
from controlplane.scheduler.rolling import observed_phase, rolling_units
from controlplane.scheduler.snapshot import ClusterState, graph_snapshot, queue_inputs, workload_req
from controlplane.store.contract import KV, Compare, DeleteOp, Op
from kunlun_common.api import workload_pb2
from kunlun_common.messages import Message, msg, msg_list
from kunlun_common.states import PLACED, DeviceState, InstancePhase

MAX_REASON_NODES = 32
DRAIN_S = 2.0
"""A retiring instance (rolling update) is out of routing this long before its engine is stopped:
time for every gateway to hear of it and for requests in flight to finish."""
MAX_NOTES_PER_TICK = 512  # explanations of unplaced instances written per tick (placements go first)


@dataclass(frozen=True)
class Observations:
    """What this leader term observed, on its own monotonic clock. Graces count from here, never
    from a time another replica wrote, so a failover can only lengthen a grace, never shorten it.
    A new term starts from an empty record."""

    unhealthy_since: Mapping[str, float] = field(default_factory=dict)
    """Device name -> when this term first saw it Unhealthy (forgotten once it is fine again)."""
    not_ready_since: Mapping[str, float] = field(default_factory=dict)
    """Node name -> when this term first saw it without its liveness lease."""
    retiring_since: Mapping[str, float] = field(default_factory=dict)
    """Instance id -> when this term first saw it retiring (rolling update drain period)."""
    paused_moves: str = ""
    """Why moves of `fencing: available` instances off NotReady nodes are paused ("" if not)."""


@dataclass(frozen=True)
class PlacementDecision:
    """One tick's placement: the units, and what the loop reports about them."""

    units: list[Unit]
    placed: int
    unplaced: list[Unplaced]
    evicted: int
    queue: dict[str, int]
    """Pending instances per priority."""


def observe(obs: Observations, st: ClusterState, mono: float) -> Observations:
    """`obs` with the nodes without their liveness lease and the Unhealthy devices of `st` as seen
    at `mono` (kept from when first seen; dropped as soon as they are fine again)."""
    unhealthy = {
        d.name
        for n in st.nodes.values()
        for d in n.devices
        if DeviceState.of(d.status) is DeviceState.UNHEALTHY
    }
    placed_on = {i.node for i, _ in st.instances.values() if i.node}
    gone = {n for n in (set(st.nodes) | placed_on) if n not in st.alive}
    return replace(
        obs,
        unhealthy_since={d: obs.unhealthy_since.get(d, mono) for d in unhealthy},
        not_ready_since={n: obs.not_ready_since.get(n, mono) for n in gone},
    )


def mass_not_ready(st: ClusterState, fraction: float) -> str:
    """Why moves off NotReady nodes are paused for `fencing: available` instances ("" if not):
    at least `fraction` of the known nodes, and at least two, are without their liveness lease."""
    nodes = set(st.nodes)
    lost = nodes - set(st.alive)
    if len(lost) >= 2 and len(lost) >= fraction * len(nodes):
        return f"{len(lost)} of {len(nodes)} nodes NotReady at once (pause_moves_not_ready_fraction {fraction:g})"
    return ""


def blocked_reason(reasons: dict[str, str]) -> str:
    """Why an instance is not placed, in English (the per-node reasons are the filters' codes and
    texts, as they are); compared with the stored reason on every tick, so kept cheap."""
    if reasons and all(r == "NoFreeDevice" for r in reasons.values()):
        return "NoFreeDevice"
    return "; ".join(f"{n}: {r}" for n, r in sorted(reasons.items())[:MAX_REASON_NODES]) or "no node"


def drain_blocked_message(node: str, reasons: dict[str, str]) -> Message:
    """Why an instance on a drained node cannot move, as a message."""
    return msg(
        "instance.drain_blocked",
        "DrainBlocked: cannot move off {node}: {why}",
        node=node,
        why=blocked_message(reasons),
    )


def blocked_message(reasons: dict[str, str]) -> Message:
    """`blocked_reason` as a message (made only when the reason is written)."""
    if reasons and all(r == "NoFreeDevice" for r in reasons.values()):
        return msg("instance.no_free_device", "NoFreeDevice")
    if not reasons:
        return msg("instance.no_node", "no node")
    return msg_list(
        "instance.blocked",
        "{parts}",
        [node_reason_message(n, r) for n, r in sorted(reasons.items())[:MAX_REASON_NODES]],
        bullet="",
        sep="; ",
    )


def bounded_reasons(reasons: dict[str, str]) -> dict[str, str]:
    """Per-node reasons, bounded for big clusters: every node while there are few; else the first
    nodes of each distinct reason plus one `(N more nodes)` entry per reason, so a record stays small."""
    if len(reasons) <= MAX_REASON_NODES:
        return reasons
    by_reason: dict[str, list[str]] = {}
    for node, why in sorted(reasons.items()):
        by_reason.setdefault(why, []).append(node)
    out: dict[str, str] = {}
    for why, nodes in sorted(by_reason.items(), key=lambda kv: -len(kv[1])):
        for node in nodes[:3]:
            out[node] = why
        if len(nodes) > 3:
            out[more_nodes(len(nodes) - 3)] = why
    return out


# ---------------------------------------------------------------------- lifecycle
def lifecycle(
    st: ClusterState, obs: Observations, mono: float, by: str, drain_s: float = DRAIN_S
) -> tuple[list[Unit], Observations]:
    """Instances to create or remove so each workload has `replicas` instances; rolling updates
    (`rolling`); deletions; orphans. `mono`: this process's monotonic clock (drain periods)."""
    retiring = {iid: obs.retiring_since.get(iid, mono) for iid, (i, _) in st.instances.items() if i.retiring}
    obs = replace(obs, retiring_since=retiring)
    drained = {iid for iid, t in retiring.items() if mono - t >= drain_s}
    units: list[Unit] = []
    by_workload: dict[str, list[tuple[int, str]]] = {}
    canaries: dict[str, list[tuple[int, str]]] = {}
    for inst, kv in st.instances.values():
        if inst.workload_id not in st.workloads:
            units.append(remove_instance(inst, kv, st.allocs))  # orphan
            continue
        group = canaries if inst.variant == CANARY else by_workload
        group.setdefault(inst.workload_id, []).append((inst.ordinal, inst.id))
    for wid, (w, wkv) in st.workloads.items():
        units += canary_units(st, w, wkv, canaries.get(wid, []), by, drained)
        have = {o for o, _ in by_workload.get(wid, [])}
        if w.deleting:
            for _, iid in by_workload.get(wid, []):
                inst, kv = st.instances[iid]
                units.append(remove_instance(inst, kv, st.allocs))
            if not have and not canaries.get(wid):
                ops: list[Op] = [
                    DeleteOp(wkv.key),
                    DeleteOp(keys.workload_name(w.spec.name)),
                    DeleteOp(keys.rollout(w.id)),  # its rollout (if any) goes with it
                ]
                units.append(
                    Unit(
                        f"delete workload {w.spec.name}",
                        [Compare.unchanged(wkv.key, wkv.mod_revision)],
                        ops,
                    )
                )
            continue
        want = w.spec.replicas
        for ordinal in range(want):
            if ordinal not in have:
                units.append(create_instance(w, wkv, ordinal, by, st.revision))
        own = [st.instances[iid] for _, iid in by_workload.get(wid, [])]
        units += rolling_units(w, wkv, own, st.statuses, st.allocs, drained, by, st.revision)
        for ordinal, iid in by_workload.get(wid, []):
            if ordinal >= want:
                inst, kv = st.instances[iid]
                units.append(remove_instance(inst, kv, st.allocs))
    # allocations nobody holds (never expected; keeps the graph clean after any bug)
    for dev, (holder, kv) in st.allocs.items():
        inst_kv = st.instances.get(holder)
        if inst_kv is None or dev not in inst_kv[0].target_devices:
            units.append(
                Unit(
                    f"free orphan allocation {dev}",
                    [Compare.unchanged(kv.key, kv.mod_revision)],
                    [DeleteOp(kv.key)],
                )
            )
    return units, obs


def canary_units(
    st: ClusterState,
    w: workload_pb2.Workload,
    wkv: KV,
    have: list[tuple[int, str]],
    by: str,
    drained: Collection[str] = (),
) -> list[Unit]:
    """Canary instances to create or remove so their count follows the rollout's weight.

    A canary no longer wanted (the rollout completed, was aborted or lowered its weight) that still
    serves is first taken out of routing (`retiring`) and removed once it has drained, as a rolling
    update drains an old instance, so requests in flight on it finish; one that serves nobody (not
    Running) or whose workload is being deleted is removed at once. `drained`: ids of retiring
    instances whose drain period has passed."""
    want = canary_count(w, st.rollouts.get(w.id))
    units = [
        create_instance(w, wkv, o, by, st.revision, CANARY)
        for o in range(want)
        if o not in {h[0] for h in have}
    ]
    for ordinal, iid in have:
        if ordinal < want:
            continue
        inst, kv = st.instances[iid]
        serving = observed_phase(inst, st.statuses) == InstancePhase.RUNNING
        if w.deleting or iid in drained or not serving:
            units.append(remove_instance(inst, kv, st.allocs))
        elif not inst.retiring:
            units.append(
                retire_instance(
                    inst,
                    kv,
                    by,
                    msg(
                        "instance.canary_unwanted",
                        "canary no longer wanted: out of routing, stopped after draining",
                    ),
                )
            )
    return units


# ---------------------------------------------------------------------- moves
def reschedule(st: ClusterState, obs: Observations, mono: float, by: str) -> tuple[list[Unit], Observations]:
    """Instances on nodes NotReady past the grace period, or on devices Unhealthy past theirs.

    `mono` is this process's monotonic clock; a grace counts from when this leader term first
    observed the node without its lease (`observe`), never from a time another replica wrote.
    The returned observations also say whether moves are paused (`paused_moves`)."""
    cfg = st.config
    units: list[Unit] = []
    obs = observe(obs, st, mono)
    paused = mass_not_ready(st, cfg.pause_moves_not_ready_fraction)
    obs = replace(obs, paused_moves=paused)
    for inst, kv in st.instances.values():
        if inst.phase not in PLACED or not inst.node:
            continue
        owner = st.workloads.get(inst.workload_id)
        if owner is None or owner[0].deleting:
            continue
        generation = owner[0].generation
        reason: Message | None = None
        if inst.node not in st.alive and paused and owner[0].spec.fencing == "available":
            continue  # its engine keeps serving; the node more likely lost us than its work
        if inst.node not in st.alive:
            down_for = mono - obs.not_ready_since.get(inst.node, mono)
            if down_for >= cfg.node_not_ready_grace_seconds:
                reason = msg(
                    "instance.node_not_ready",
                    "Rescheduled: node {node} NotReady for {down_for:.1f}s (grace {grace:g}s, as seen by this leader)",
                    node=inst.node,
                    down_for=down_for,
                    grace=cfg.node_not_ready_grace_seconds,
                )
        bad = [
            d
            for d in inst.target_devices
            if d in obs.unhealthy_since
            and mono - obs.unhealthy_since[d] >= cfg.device_unhealthy_grace_seconds
        ]
        if bad and reason is None:
            reason = msg("instance.device_unhealthy", "Rescheduled: device {device} Unhealthy", device=bad[0])
        if reason is None:
            continue  # a spec change replaces instances by a rolling update (`rolling`), not here
        if inst.retiring or (not inst.variant and inst.generation and inst.generation != generation):
            # an old instance is not moved: its successor (rolling update) takes the ordinal
            units.append(remove_instance(inst, kv, st.allocs))
        else:
            units.append(release_instance(inst, kv, st.allocs, by, reason))
    return units, obs


def drain(st: ClusterState, now: float, by: str) -> list[Unit]:
    """Instances on drained nodes moved where they fit; the others told why they cannot move."""
    drained = frozenset(n for n, c in st.cordons.items() if c.get("drain"))
    if not drained:
        return []
    movers = [(i, kv) for i, kv in st.instances.values() if i.node in drained and i.phase in PLACED]
    if not movers:
        return []
    snap = graph_snapshot(st, exclude_nodes=drained)
    pending = [
        PendingInstance(i.id, workload_req(st.workloads[i.workload_id][0]), now, int(i.seq))
        for i, _ in movers
        if i.workload_id in st.workloads
    ]
    plan = schedule(snap, pending, [], st.config, now)
    units: list[Unit] = []
    for p in plan.placements:
        inst, kv = st.instances[p.instance_id]
        units.append(
            place_instance(
                inst,
                kv,
                p.node,
                p.devices,
                by,
                inst.generation,
                allocs=st.allocs,
                reason=msg("instance.moved_off", "moved off drained node {node}", node=inst.node),
            )
        )
    for u in plan.unplaced:
        inst, kv = st.instances[u.instance_id]
        blocked = bounded_reasons(dict(u.reasons))
        why = f"DrainBlocked: cannot move off {inst.node}: {blocked_reason(blocked)}"
        unit = note_unplaced(
            inst,
            kv,
            dict(inst.unplaced_reasons),
            why,
            partial(drain_blocked_message, inst.node, blocked),
        )
        if unit:
            units.append(unit)
    return units


# ---------------------------------------------------------------------- placement
def placement(st: ClusterState, now: float, by: str) -> PlacementDecision:
    """The pending instances placed by the pure `schedule()` (preemption first frees the victims'
    devices; their preemptor is placed on a later tick), the others explained, head of queue first."""
    pending, running = queue_inputs(st)
    queue: dict[str, int] = {}
    for p_ in pending:
        queue[p_.workload.priority] = queue.get(p_.workload.priority, 0) + 1
    if not pending:
        return PlacementDecision([], 0, [], 0, queue)
    plan = schedule(graph_snapshot(st), pending, running, st.config, now)
    units: list[Unit] = []
    evicted: set[str] = set()
    placed = 0
    for p in plan.placements:
        if p.preempts:
            for victim in p.preempts:
                if victim in evicted or victim not in st.instances:
                    continue
                evicted.add(victim)
                vi, vkv = st.instances[victim]
                units.append(
                    release_instance(
                        vi,
                        vkv,
                        st.allocs,
                        by,
                        msg("instance.preempted", "Preempted by {id} (priority high)", id=p.instance_id),
                    )
                )
            continue  # placed on the next tick, once the victims' devices are free
        units.append(place(st, p, by))
        placed += 1
    noted = 0
    for u in plan.unplaced:  # queue order: the head of the queue is explained first
        if noted >= MAX_NOTES_PER_TICK:
            break
        inst, kv = st.instances[u.instance_id]
        reasons = bounded_reasons(dict(u.reasons))
        unit = note_unplaced(inst, kv, reasons, blocked_reason(reasons), partial(blocked_message, reasons))
        if unit:
            units.append(unit)
            noted += 1
    return PlacementDecision(units, placed, list(plan.unplaced), len(evicted), queue)


def place(st: ClusterState, p: Placement, by: str) -> Unit:
    inst, kv = st.instances[p.instance_id]
    w = st.workloads[inst.workload_id][0]
    spec = None if inst.variant else w.spec  # a canary's spec comes from its rollout
    return place_instance(inst, kv, p.node, p.devices, by, w.generation, spec=spec)
