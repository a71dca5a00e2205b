"""Canary rollouts, driven by the leader.

The API writes a rollout's goal state (`rollouts/<workload id>`: the canary model and steps, and
promote/abort requests); this loop, on the leader, moves it on with fenced writes, so a new leader
continues where the old one stopped:

    Progressing (step i, weight steps[i]) --interval elapsed or promote--> step i+1 ... --> Completed
    Progressing --abort--> Aborted (weight 0; the scheduler removes the canary instances)

Without explicit steps the steps are [canary_pct, 100] and only `rollout promote` moves them on.
On completion the workload's spec takes the canary's model (and engine args), a new generation: the
scheduler restarts the baseline instances on it and removes the canary instances, so nothing serves
the old model afterwards. The scheduler sizes the canary (`canary_count`), the replicas' feeds give
canary instances the canary spec, and gateways split requests by `weight_pct`.
"""

from __future__ import annotations

import asyncio
import math
import time

import structlog

from controlplane import keys
from controlplane.cache import GraphCache
from controlplane.election import Fence
from controlplane.store import KV, Compare, EtcdStore, PutOp
from kunlun_common.api import rollout_pb2, workload_pb2
from kunlun_common.errors import TemporaryError

log = structlog.get_logger("rollout")
PROGRESSING = "Progressing"
COMPLETED = "Completed"
ABORTED = "Aborted"
DEFAULT_INTERVAL_S = 120
CANARY = "canary"


def now_ms() -> int:
    return int(time.time() * 1000)


def steps_of(spec: rollout_pb2.RolloutSpec) -> list[int]:
    return list(spec.steps) if spec.steps else [spec.canary_pct, 100]


def canary_spec(w: workload_pb2.Workload, r: rollout_pb2.Rollout) -> workload_pb2.WorkloadSpec:
    """The workload's spec with the rollout's model (and engine args, when given)."""
    spec = workload_pb2.WorkloadSpec()
    spec.CopyFrom(w.spec)
    spec.model = r.spec.model
    if r.spec.engine_args:
        del spec.engine_args[:]
        spec.engine_args.extend(r.spec.engine_args)
    return spec


def canary_count(w: workload_pb2.Workload, r: rollout_pb2.Rollout | None) -> int:
    """Canary instances for the weight: at least 1, at most the baseline's replicas; 0 when none."""
    if r is None or r.phase != PROGRESSING or r.weight_pct <= 0 or w.spec.replicas <= 0 or w.deleting:
        return 0
    return min(w.spec.replicas, max(1, math.ceil(w.spec.replicas * r.weight_pct / 100)))


def live_rollout(r: rollout_pb2.Rollout | None) -> bool:
    return r is not None and r.phase == PROGRESSING and r.weight_pct > 0


def _event(r: rollout_pb2.Rollout, phase: str, by: str, reason: str) -> None:
    r.phase = phase
    r.reason = reason
    r.history.append(workload_pb2.PhaseEvent(phase=phase, at_unix_ms=now_ms(), by=by, reason=reason))
    del r.history[:-50]


def advance(r: rollout_pb2.Rollout, now: int, by: str) -> rollout_pb2.Rollout | None:
    """The rollout's next state (pure), or None when nothing changes now."""
    if r.phase != PROGRESSING:
        return None
    new = rollout_pb2.Rollout()
    new.CopyFrom(r)
    if r.abort_requested:
        new.weight_pct = 0
        _event(new, ABORTED, by, "aborted on request; canary removed, baseline untouched")
        return new
    steps = steps_of(r.spec)
    interval_ms = (r.spec.interval_s or DEFAULT_INTERVAL_S) * 1000
    reason = ""
    if r.promotions_requested > r.promotions_applied:
        new.promotions_applied = r.promotions_applied + 1
        reason = "promoted"
    elif r.spec.steps and now - r.step_started_at_unix_ms >= interval_ms:
        reason = f"interval of {interval_ms // 1000}s elapsed"
    if not reason:
        return None
    if r.step + 1 >= len(steps) or r.weight_pct >= 100:
        new.weight_pct = 0
        _event(new, COMPLETED, by, f"{reason}; {r.spec.model} is the workload's model now")
        return new
    new.step = r.step + 1
    new.weight_pct = steps[new.step]
    new.step_started_at_unix_ms = now
    _event(
        new, PROGRESSING, by, f"{reason}: step {new.step + 1}/{len(steps)}, canary weight {new.weight_pct}%"
    )
    return new


def completed_workload(w: workload_pb2.Workload, r: rollout_pb2.Rollout, by: str) -> workload_pb2.Workload:
    """The workload after a completed rollout: the canary spec as a new generation, with why."""
    new = workload_pb2.Workload()
    new.CopyFrom(w)
    new.spec.CopyFrom(canary_spec(w, r))
    new.generation = w.generation + 1
    new.updated_by = by
    new.history.append(
        workload_pb2.PhaseEvent(
            phase="Updated",
            at_unix_ms=now_ms(),
            by=by,
            reason=f"rollout completed: model {r.baseline_model} -> {r.spec.model}; generation {new.generation}",
        )
    )
    return new


def decode_rollouts(kvs: list[KV]) -> dict[str, tuple[rollout_pb2.Rollout, KV]]:
    out: dict[str, tuple[rollout_pb2.Rollout, KV]] = {}
    for kv in kvs:
        r = rollout_pb2.Rollout()
        keys.decode_message(kv.value, r)
        out[r.workload_id] = (r, kv)
    return out


class RolloutLoop:
    def __init__(self, store: EtcdStore, replica: str) -> None:
        self.store = store
        self.by = f"rollout@{replica}"

    async def run(self, fence: Fence) -> None:
        cache = GraphCache(self.store)
        await cache.start()
        try:
            while not fence.lost.is_set():
                try:
                    async with asyncio.timeout(1.0):
                        await cache.changed.wait()
                except TimeoutError:
                    pass
                cache.changed.clear()
                await self.tick(fence, cache)
        finally:
            await cache.stop()

    async def tick(self, fence: Fence, cache: GraphCache) -> None:
        now = now_ms()
        for r, kv in decode_rollouts(cache.prefix(keys.ROLLOUTS)).values():
            new = advance(r, now, self.by)
            if new is None:
                continue
            compares = [Compare.unchanged(kv.key, kv.mod_revision)]
            ops = [PutOp(kv.key, keys.encode_message(new))]
            if new.phase == COMPLETED:
                wkv = cache.get(keys.workload(r.workload_id))
                if wkv is None:
                    continue
                w = workload_pb2.Workload()
                keys.decode_message(wkv.value, w)
                compares.append(Compare.unchanged(wkv.key, wkv.mod_revision))
                ops.append(PutOp(wkv.key, keys.encode_message(completed_workload(w, r, self.by))))
            try:
                res = await fence.txn(compares, ops)
            except TemporaryError as e:
                log.warning("rollout commit failed; will retry", workload=r.workload, error=str(e))
                continue
            if res.succeeded:
                log.info(
                    "rollout", workload=r.workload, phase=new.phase, weight=new.weight_pct, why=new.reason
                )
