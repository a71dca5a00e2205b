"""The leader's scheduling loop: the I/O around the reconcile decisions (`reconcile.py`).

Driven by the graph cache (watch events) plus a 1 s tick. Each tick takes the decoded state from
the cache, asks the pure decisions what to do (`reconcile`: lifecycle, moves, drains, placement),
and commits the units as fenced transactions; a rejected commit (something changed under the plan)
is simply recomputed on the next tick from the newer state. Idempotent: a new leader continues
where the old one stopped. One log line per tick that decided something.
"""

from __future__ import annotations

import asyncio
import time

import structlog

from controlplane.cache import GraphCache
from controlplane.election import Fence
from controlplane.leader_loop import run_leader_loop
from controlplane.metrics import ReplicaMetrics, reason_class
from controlplane.scheduler import reconcile
from controlplane.scheduler.actions import Unit, disjoint, pack
from controlplane.scheduler.reconcile import (
    DRAIN_S,
    MAX_NOTES_PER_TICK,
    MAX_REASON_NODES,
    Observations,
    bounded_reasons,
    mass_not_ready,
)
from controlplane.scheduler.snapshot import SCHEDULING, ClusterState, cache_state
from controlplane.store import Compare, EtcdStore
from kunlun_common.errors import TemporaryError
from kunlun_common.names import DEVICE_TYPES

log = structlog.get_logger("scheduler")
COMMITS_IN_FLIGHT = 16
DEBOUNCE_S = 0.1  # coalesce a burst of watch events (a registration storm) into one tick


class SchedulerLoop:
    def __init__(self, store: EtcdStore, replica: str) -> None:
        self.store = store
        self.by = f"scheduler@{replica}"
        self.obs = Observations()
        """What this leader term observed (the decisions' only memory between ticks)."""
        self.drain_s = DRAIN_S
        self.ticks = 0
        # the replica's metrics (controlplane/metrics.py), told about every tick's decisions
        self.metrics: ReplicaMetrics | None = None

    def new_term(self) -> None:
        """Forget what an earlier term observed: graces are measured from what THIS term saw, on this
        process's monotonic clock, so a failover can only lengthen a grace, never shorten it."""
        self.obs = Observations(paused_moves=self.obs.paused_moves)

    async def run(self, fence: Fence) -> None:
        self.new_term()
        # scheduling-relevant changes only, not telemetry; a burst of them lands before one tick
        await run_leader_loop("scheduler", self.store, fence, SCHEDULING, self.tick, debounce_s=DEBOUNCE_S)

    # ------------------------------------------------------------------ decisions (reconcile.py)
    def observe(self, st: ClusterState, mono: float) -> None:
        """Record, on this leader's monotonic clock, when it first saw each node without its liveness
        lease and each device Unhealthy (forgotten as soon as they are fine again)."""
        self.obs = reconcile.observe(self.obs, st, mono)

    def lifecycle_units(self, st: ClusterState, mono: float | None = None) -> list[Unit]:
        """`reconcile.lifecycle` with this term's observations (`mono`: now if not given)."""
        mono = time.monotonic() if mono is None else mono
        units, self.obs = reconcile.lifecycle(st, self.obs, mono, self.by, self.drain_s)
        return units

    def reschedule_units(self, st: ClusterState, mono: float) -> list[Unit]:
        """`reconcile.reschedule` with this term's observations; logs when moves pause or resume."""
        was = self.obs.paused_moves
        units, self.obs = reconcile.reschedule(st, self.obs, mono, self.by)
        if self.obs.paused_moves != was:
            if self.obs.paused_moves:
                log.warning("moves of fencing: available instances paused", why=self.obs.paused_moves)
            else:
                log.info("moves of fencing: available instances resumed")
        return units

    def drain_units(self, st: ClusterState, now: float) -> list[Unit]:
        return reconcile.drain(st, now, self.by)

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
        decision = reconcile.placement(st, now, self.by)
        units, deferred = disjoint(units + decision.units)
        if deferred:
            log.info(
                "decisions on a key already decided this tick deferred", deferred=[u.what for u in deferred]
            )
        if self.metrics is not None:
            self.metrics.temperature_limit_c = st.config.temperature_limit_c
            self.metrics.scheduler_tick(
                decision.queue,
                decision.placed,
                decision.evicted,
                time.perf_counter() - t0,
                unplaced_reason_counts(decision),
            )
        if not units:
            return 0
        rev = await self.commit(fence, units, "schedule", t0)
        log.info(
            "scheduler tick",
            placed=decision.placed,
            unplaced=len(decision.unplaced),
            evicted=decision.evicted,
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


def unplaced_reason_counts(decision: reconcile.PlacementDecision) -> dict[str, int]:
    """Unplaced instances per reason class (each counted once, by its most common reason): the
    metric's bounded label."""
    out: dict[str, int] = {}
    for u in decision.unplaced:
        if u.reasons:
            counts: dict[str, int] = {}
            for why in u.reasons.values():
                counts[reason_class(why)] = counts.get(reason_class(why), 0) + 1
            top = max(sorted(counts), key=lambda k: counts[k])
        else:
            top = "NoNode"
        out[top] = out.get(top, 0) + 1
    return out


__all__ = [
    "DEVICE_TYPES",
    "MAX_NOTES_PER_TICK",
    "MAX_REASON_NODES",
    "SchedulerLoop",
    "bounded_reasons",
    "mass_not_ready",
]
