"""The leader's scheduling loop: reconcile instances with workloads, reschedule, drain, place.

Driven by the graph cache (watch events) plus a 1 s tick. Each tick decodes the cache, decides
(pure functions), and commits the decisions as fenced transactions; a rejected commit (something
changed under the plan) is simply recomputed on the next tick from the newer state. Idempotent:
a new leader continues where the old one stopped. One log line per tick that decided something.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import structlog

from controlplane import keys
from controlplane.cache import GraphCache
from controlplane.election import Fence
from controlplane.metrics import ReplicaMetrics, reason_class
from controlplane.rollout import CANARY, canary_count
from controlplane.scheduler.actions import (
    Unit,
    create_instance,
    disjoint,
    note_unplaced,
    pack,
    place_instance,
    release_instance,
    remove_instance,
)
from controlplane.scheduler.model import Placement
from controlplane.scheduler.plan import schedule
from controlplane.scheduler.rolling import rolling_units
from controlplane.scheduler.snapshot import (
    SCHEDULING,
    ClusterState,
    cache_state,
    graph_snapshot,
    queue_inputs,
)
from controlplane.store import KV, Compare, DeleteOp, EtcdStore, Op
from kunlun_common.api import workload_pb2
from kunlun_common.errors import TemporaryError
from kunlun_common.names import DEVICE_TYPES
from kunlun_common.states import PLACED, DeviceState

log = structlog.get_logger("scheduler")
COMMITS_IN_FLIGHT = 16
MAX_REASON_NODES = 32
DRAIN_S = 2.0
"""A retiring instance (rolling update) is out of routing this long before its engine is stopped:
time for every gateway to hear of it and for requests in flight to finish."""
DEBOUNCE_S = 0.1  # coalesce a burst of watch events (a registration storm) into one tick
MAX_NOTES_PER_TICK = 512  # explanations of unplaced instances written per tick (placements go first)


def _blocked_reason(reasons: dict[str, str]) -> str:
    if reasons and all(r == "NoFreeDevice" for r in reasons.values()):
        return "NoFreeDevice"
    return "; ".join(f"{n}: {r}" for n, r in sorted(reasons.items())[:MAX_REASON_NODES]) or "no node"


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
            out[f"({len(nodes) - 3} more nodes)"] = why
    return out


def mass_not_ready(st: ClusterState, fraction: float) -> str:
    """Why moves off NotReady nodes are paused for `fencing: available` instances ("" if not):
    at least `fraction` of the known nodes, and at least two, are without their liveness lease."""
    nodes = set(st.nodes)
    lost = nodes - set(st.alive)
    if len(lost) >= 2 and len(lost) >= fraction * len(nodes):
        return f"{len(lost)} of {len(nodes)} nodes NotReady at once (pause_moves_not_ready_fraction {fraction:g})"
    return ""


class SchedulerLoop:
    def __init__(self, store: EtcdStore, replica: str) -> None:
        self.store = store
        self.by = f"scheduler@{replica}"
        self.unhealthy_since: dict[str, float] = {}
        self.not_ready_since: dict[str, float] = {}
        self.paused_moves = ""
        """Why moves of `fencing: available` instances off NotReady nodes are paused ("" if not)."""
        self.retiring_since: dict[str, float] = {}
        self.drain_s = DRAIN_S
        self.ticks = 0
        # the replica's metrics (controlplane/metrics.py), told about every tick's decisions
        self.metrics: ReplicaMetrics | None = None
        self._queue: dict[str, int] = {}
        self._unplaced_reasons: dict[str, int] = {}

    def new_term(self) -> None:
        """Forget what an earlier term observed: graces are measured from what THIS term saw, on this
        process's monotonic clock, so a failover can only lengthen a grace, never shorten it."""
        self.unhealthy_since = {}
        self.not_ready_since = {}
        self.retiring_since = {}

    async def run(self, fence: Fence) -> None:
        self.new_term()
        cache = GraphCache(self.store)
        await cache.start()
        log.info("scheduler started", epoch=fence.epoch, revision=cache.revision, keys=len(cache.kvs))
        try:
            wake, seen = cache.topic(SCHEDULING), -1  # scheduling-relevant changes only, not telemetry
            while not fence.lost.is_set():
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(1.0):
                        seen = await wake.wait(seen)
                        await asyncio.sleep(DEBOUNCE_S)  # let a burst of changes land: one tick for all
                seen = wake.version
                rev = await self.tick(fence, cache)
                if rev and not await cache.wait_for_revision(rev):
                    log.warning("graph cache did not catch up with our commit", revision=rev)
        finally:
            await cache.stop()

    # ------------------------------------------------------------------ decisions
    def lifecycle_units(self, st: ClusterState, mono: float | None = None) -> list[Unit]:
        """Instances to create or remove so each workload has `replicas` instances; rolling updates
        (`rolling`); deletions. `mono`: this process's monotonic clock (drain periods)."""
        mono = time.monotonic() if mono is None else mono
        self.retiring_since = {
            iid: self.retiring_since.get(iid, mono) for iid, (i, _) in st.instances.items() if i.retiring
        }
        drained = {iid for iid, t in self.retiring_since.items() if mono - t >= self.drain_s}
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
            units += self._canary_units(st, w, wkv, canaries.get(wid, []))
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
                    units.append(create_instance(w, wkv, ordinal, self.by, st.revision))
            own = [st.instances[iid] for _, iid in by_workload.get(wid, [])]
            units += rolling_units(w, wkv, own, st.statuses, st.allocs, drained, self.by, st.revision)
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
        return units

    def _canary_units(
        self, st: ClusterState, w: workload_pb2.Workload, wkv: KV, have: list[tuple[int, str]]
    ) -> list[Unit]:
        """Canary instances to create or remove so their count follows the rollout's weight."""
        want = canary_count(w, st.rollouts.get(w.id))
        units = [
            create_instance(w, wkv, o, self.by, st.revision, CANARY)
            for o in range(want)
            if o not in {h[0] for h in have}
        ]
        for ordinal, iid in have:
            if ordinal >= want:
                inst, kv = st.instances[iid]
                units.append(remove_instance(inst, kv, st.allocs))
        return units

    def observe(self, st: ClusterState, mono: float) -> None:
        """Record, on this leader's monotonic clock, when it first saw each node without its liveness
        lease and each device Unhealthy (forgotten as soon as they are fine again)."""
        unhealthy = {
            d.name
            for n in st.nodes.values()
            for d in n.devices
            if DeviceState.of(d.status) is DeviceState.UNHEALTHY
        }
        self.unhealthy_since = {d: self.unhealthy_since.get(d, mono) for d in unhealthy}
        placed_on = {i.node for i, _ in st.instances.values() if i.node}
        gone = {n for n in (set(st.nodes) | placed_on) if n not in st.alive}
        self.not_ready_since = {n: self.not_ready_since.get(n, mono) for n in gone}

    def reschedule_units(self, st: ClusterState, mono: float) -> list[Unit]:
        """Instances on nodes NotReady past the grace period, or on devices Unhealthy past theirs.

        `mono` is this process's monotonic clock; a grace counts from when this leader term first
        observed the node without its lease (`observe`), never from a time another replica wrote."""
        cfg = st.config
        units: list[Unit] = []
        self.observe(st, mono)
        paused = mass_not_ready(st, cfg.pause_moves_not_ready_fraction)
        if paused != self.paused_moves:
            if paused:
                log.warning("moves of fencing: available instances paused", why=paused)
            else:
                log.info("moves of fencing: available instances resumed")
            self.paused_moves = paused
        for inst, kv in st.instances.values():
            if inst.phase not in PLACED or not inst.node:
                continue
            owner = st.workloads.get(inst.workload_id)
            if owner is None or owner[0].deleting:
                continue
            generation = owner[0].generation
            reason = ""
            if inst.node not in st.alive and paused and owner[0].spec.fencing == "available":
                continue  # its engine keeps serving; the node more likely lost us than its work
            if inst.node not in st.alive:
                down_for = mono - self.not_ready_since.get(inst.node, mono)
                if down_for >= cfg.node_not_ready_grace_seconds:
                    reason = (
                        f"Rescheduled: node {inst.node} NotReady for {down_for:.1f}s "
                        f"(grace {cfg.node_not_ready_grace_seconds:g}s, as seen by this leader)"
                    )
            bad = [
                d
                for d in inst.target_devices
                if d in self.unhealthy_since
                and mono - self.unhealthy_since[d] >= cfg.device_unhealthy_grace_seconds
            ]
            if bad and not reason:
                reason = f"Rescheduled: device {bad[0]} Unhealthy"
            if not reason:
                continue  # a spec change replaces instances by a rolling update (`rolling`), not here
            if inst.retiring or (not inst.variant and inst.generation and inst.generation != generation):
                # an old instance is not moved: its successor (rolling update) takes the ordinal
                units.append(remove_instance(inst, kv, st.allocs))
            else:
                units.append(release_instance(inst, kv, st.allocs, self.by, reason))
        return units

    def drain_units(self, st: ClusterState, now: float) -> list[Unit]:
        drained = frozenset(n for n, c in st.cordons.items() if c.get("drain"))
        if not drained:
            return []
        from controlplane.scheduler.model import PendingInstance
        from controlplane.scheduler.snapshot import workload_req

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
                    self.by,
                    inst.generation,
                    allocs=st.allocs,
                    reason=f"moved off drained node {inst.node}",
                )
            )
        for u in plan.unplaced:
            inst, kv = st.instances[u.instance_id]
            why = f"DrainBlocked: cannot move off {inst.node}: {_blocked_reason(bounded_reasons(dict(u.reasons)))}"
            unit = note_unplaced(inst, kv, dict(inst.unplaced_reasons), why)
            if unit:
                units.append(unit)
        return units

    def placement_units(self, st: ClusterState, now: float) -> tuple[list[Unit], int, int, int]:
        pending, running = queue_inputs(st)
        self._queue = {}
        self._unplaced_reasons = {}
        for p_ in pending:
            self._queue[p_.workload.priority] = self._queue.get(p_.workload.priority, 0) + 1
        if not pending:
            return [], 0, 0, 0
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
                            vi, vkv, st.allocs, self.by, f"Preempted by {p.instance_id} (priority high)"
                        )
                    )
                continue  # placed on the next tick, once the victims' devices are free
            units.append(self._place(st, p))
            placed += 1
        for u in plan.unplaced:
            if u.reasons:
                counts: dict[str, int] = {}
                for why in u.reasons.values():
                    counts[reason_class(why)] = counts.get(reason_class(why), 0) + 1
                top = max(sorted(counts), key=lambda k: counts[k])
            else:
                top = "NoNode"
            self._unplaced_reasons[top] = self._unplaced_reasons.get(top, 0) + 1
        noted = 0
        for u in plan.unplaced:  # queue order: the head of the queue is explained first
            if noted >= MAX_NOTES_PER_TICK:
                break
            inst, kv = st.instances[u.instance_id]
            reasons = bounded_reasons(dict(u.reasons))
            unit = note_unplaced(inst, kv, reasons, _blocked_reason(reasons))
            if unit:
                units.append(unit)
                noted += 1
        return units, placed, len(plan.unplaced), len(evicted)

    def _place(self, st: ClusterState, p: Placement) -> Unit:
        inst, kv = st.instances[p.instance_id]
        w = st.workloads[inst.workload_id][0]
        spec = None if inst.variant else w.spec  # a canary's spec comes from its rollout
        return place_instance(inst, kv, p.node, p.devices, self.by, w.generation, spec=spec)

    # ------------------------------------------------------------------ commit
    async def tick(self, fence: Fence, cache: GraphCache) -> int:
        t0 = time.perf_counter()
        now = time.time()
        st = cache_state(cache)  # decoded incrementally, one changed record at a time
        self.observe(st, time.monotonic())  # every tick, so a grace never starts late
        if st.config_error:
            log.warning("stored scheduler config unreadable; using defaults", error=st.config_error)
        units, _ = disjoint(self.lifecycle_units(st))
        if units:  # structure first; placement on the next tick sees the new instances
            return await self.commit(fence, units, "lifecycle", t0)
        units = self.reschedule_units(st, time.monotonic()) + self.drain_units(st, now)
        placement, placed, unplaced, evicted = self.placement_units(st, now)
        units, deferred = disjoint(units + placement)
        if deferred:
            log.info(
                "decisions on a key already decided this tick deferred", deferred=[u.what for u in deferred]
            )
        if self.metrics is not None:
            self.metrics.temperature_limit_c = st.config.temperature_limit_c
            self.metrics.scheduler_tick(
                self._queue, placed, evicted, time.perf_counter() - t0, self._unplaced_reasons
            )
        if not units:
            return 0
        rev = await self.commit(fence, units, "schedule", t0)
        log.info(
            "scheduler tick",
            placed=placed,
            unplaced=unplaced,
            evicted=evicted,
            units=len(units),
            ms=round((time.perf_counter() - t0) * 1000, 1),
            revision=rev,
        )
        return rev

    async def _explain(self, compares: list[Compare]) -> list[str]:
        """Which compares of a rejected commit no longer hold (read back from etcd), for the log."""
        out: list[str] = []
        for c in compares[:16]:
            kv = await self.store.get(c.key)
            have = {"create": kv.create_revision if kv else 0, "mod": kv.mod_revision if kv else 0}.get(
                c.target
            )
            if have is not None and have != c.value:
                out.append(f"{c.key}: {c.target} expected {c.value!r}, is {have}")
        return out

    async def commit(self, fence: Fence, units: list[Unit], kind: str, t0: float) -> int:
        """Commit the units in packed, fenced transactions, up to `COMMITS_IN_FLIGHT` at once.

        The units of one plan never touch the same key (distinct instances and devices), so their
        transactions are independent; a rejected or failed one is simply recomputed next tick.
        Returns the highest committed revision (0 if none), which the caller waits for in its cache.
        """
        gate = asyncio.Semaphore(COMMITS_IN_FLIGHT)
        revisions: list[int] = []
        rejected: list[tuple[list[Unit], list[Compare]]] = []

        async def one(batch: list[Unit]) -> None:
            compares = [c for u in batch for c in u.compares]
            ops = [o for u in batch for o in u.ops]
            async with gate:
                if fence.lost.is_set():
                    return
                try:
                    res = await fence.txn(compares, ops)
                except TemporaryError as e:
                    log.warning("commit failed; will recompute", kind=kind, error=str(e))
                    return
            if res.succeeded:
                revisions.append(res.revision)
            else:
                revisions.append(res.revision)
                rejected.append((batch, compares))

        await asyncio.gather(*(one(b) for b in pack(units)))
        if rejected:
            batch, compares = rejected[0]
            log.info(
                "commit rejected (state changed under the plan); recomputing",
                kind=kind,
                rejected=len(rejected),
                first=batch[0].what,
                failed=await self._explain(compares),
            )
        last = max(revisions, default=0)
        if kind == "lifecycle":
            log.info("instances reconciled", changes=len(units), first=units[0].what, revision=last)
        return last


__all__ = ["DEVICE_TYPES", "SchedulerLoop"]
