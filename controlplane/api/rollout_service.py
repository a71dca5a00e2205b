"""RolloutService: validate and write a rollout's goal state (`rollouts/<workload id>`).

Create writes the whole record (phase Progressing at the first step, with the gateways' counters
at that moment, the start of the first step's analysis); promote and abort only record
the request (a counter, a flag) with a compare-and-set. The leader's rollout loop
(`controlplane/rollout.py`) does the rest with fenced writes.
"""

from __future__ import annotations

import grpc

from controlplane import keys
from controlplane.api.auth import Ctx, abort, authorize
from controlplane.rollout import gateway_stats, steps_of
from controlplane.store import KV, Compare, EtcdStore, PutOp
from controlplane.workloads import records
from kunlun_common.api import rollout_pb2, rollout_pb2_grpc, workload_pb2
from kunlun_common.clock import now_ms
from kunlun_common.errors import PermanentError, TemporaryError
from kunlun_common.states import RolloutPhase

SVC = "/kunlun.v1.RolloutService/"


def spec_problems(spec: rollout_pb2.RolloutSpec) -> list[str]:
    p = []
    if not spec.model:
        p.append("model: required")
    if not 1 <= spec.canary_pct <= 100:
        p.append(f"canary: expected 1..100 percent, found {spec.canary_pct}")
    steps = list(spec.steps)
    if steps and (any(not 1 <= s <= 100 for s in steps) or steps != sorted(set(steps)) or steps[-1] != 100):
        p.append(f"steps: expected ascending percents in 1..100 ending with 100, found {steps}")
    if spec.interval_s < 0:
        p.append(f"interval: expected >= 0 seconds, found {spec.interval_s}")
    if spec.HasField("max_error_rate") and not 0 <= spec.max_error_rate <= 1:
        p.append(f"max_error_rate: expected a fraction in 0..1, found {spec.max_error_rate:g}")
    if spec.HasField("max_p95_increase") and spec.max_p95_increase < 0:
        p.append(f"max_p95_increase: expected a fraction >= 0, found {spec.max_p95_increase:g}")
    if spec.HasField("min_p95_delta_ms") and spec.min_p95_delta_ms < 0:
        p.append(f"min_p95_delta_ms: expected >= 0, found {spec.min_p95_delta_ms:g}")
    if spec.HasField("min_requests") and spec.min_requests < 0:
        p.append(f"min_requests: expected >= 0, found {spec.min_requests}")
    return p


class RolloutService(rollout_pb2_grpc.RolloutServiceServicer):
    def __init__(self, store: EtcdStore) -> None:
        self.store = store

    async def _fail(self, context: Ctx, e: Exception) -> None:
        if isinstance(e, records.NotFound):
            await abort(context, grpc.StatusCode.NOT_FOUND, str(e))
        if isinstance(e, TemporaryError):
            await abort(context, grpc.StatusCode.UNAVAILABLE, str(e))
        if isinstance(e, PermanentError):
            await abort(context, grpc.StatusCode.FAILED_PRECONDITION, str(e))
        raise e

    async def _get(self, context: Ctx, name: str) -> tuple[workload_pb2.Workload, rollout_pb2.Rollout, KV]:
        try:
            w, _ = await records.resolve(self.store, name)
            kv = await self.store.get(keys.rollout(w.id))
        except Exception as e:
            await self._fail(context, e)
            raise
        if kv is None:
            await abort(context, grpc.StatusCode.NOT_FOUND, f"workload {name!r} has no rollout")
        r = rollout_pb2.Rollout()
        keys.decode_message(kv.value, r)
        return w, r, kv

    async def CreateRollout(
        self, request: rollout_pb2.CreateRolloutRequest, context: Ctx
    ) -> rollout_pb2.Rollout:
        who = await authorize(context, SVC + "CreateRollout")
        spec = request.spec
        problems = spec_problems(spec)
        if problems:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, "; ".join(problems))
        try:
            w, _ = await records.resolve(self.store, spec.workload)
            old = await self.store.get(keys.rollout(w.id))
            stats_kvs, _ = await self.store.get_prefix(keys.GATEWAY_STATS)
        except Exception as e:
            await self._fail(context, e)
            raise
        if old is not None:
            prev = rollout_pb2.Rollout()
            keys.decode_message(old.value, prev)
            if prev.phase == RolloutPhase.PROGRESSING:
                await abort(
                    context,
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"workload {w.spec.name!r} already has a rollout in progress; promote or abort it",
                )
        if spec.model == w.spec.model:
            await abort(
                context, grpc.StatusCode.INVALID_ARGUMENT, f"model: the workload already serves {spec.model}"
            )
        at = now_ms()
        r = rollout_pb2.Rollout(
            workload_id=w.id,
            workload=w.spec.name,
            spec=spec,
            baseline_model=w.spec.model,
            phase=RolloutPhase.PROGRESSING,
            step=0,
            weight_pct=steps_of(spec)[0],
            step_started_at_unix_ms=at,
            created_by=str(who),
            created_at_unix_ms=at,
            history=[
                workload_pb2.PhaseEvent(
                    phase=RolloutPhase.PROGRESSING, at_unix_ms=at, by=str(who), reason="created"
                )
            ],
            step_start_stats=gateway_stats(stats_kvs),
        )
        r.spec.workload = w.spec.name
        cmp = Compare.unchanged(old.key, old.mod_revision) if old else Compare.absent(keys.rollout(w.id))
        try:
            res = await self.store.txn([cmp], [PutOp(keys.rollout(w.id), keys.encode_message(r))])
        except Exception as e:
            await self._fail(context, e)
            raise
        if not res.succeeded:
            await abort(context, grpc.StatusCode.ABORTED, "the rollout changed concurrently; retry")
        return r

    async def _request(self, context: Ctx, method: str, name: str, promote: bool) -> rollout_pb2.Rollout:
        await authorize(context, SVC + method)
        for _ in range(5):
            _, r, kv = await self._get(context, name)
            if r.phase != RolloutPhase.PROGRESSING:
                await abort(context, grpc.StatusCode.FAILED_PRECONDITION, f"the rollout is {r.phase}")
            if promote:
                r.promotions_requested += 1
            else:
                r.abort_requested = True
            try:
                res = await self.store.txn(
                    [Compare.unchanged(kv.key, kv.mod_revision)], [PutOp(kv.key, keys.encode_message(r))]
                )
            except Exception as e:
                await self._fail(context, e)
                raise
            if res.succeeded:
                return r
        await abort(context, grpc.StatusCode.ABORTED, "the rollout changed concurrently; retry")

    async def PromoteRollout(self, request: rollout_pb2.RolloutRequest, context: Ctx) -> rollout_pb2.Rollout:
        return await self._request(context, "PromoteRollout", request.workload, True)

    async def AbortRollout(self, request: rollout_pb2.RolloutRequest, context: Ctx) -> rollout_pb2.Rollout:
        return await self._request(context, "AbortRollout", request.workload, False)

    async def GetRollout(self, request: rollout_pb2.RolloutRequest, context: Ctx) -> rollout_pb2.Rollout:
        await authorize(context, SVC + "GetRollout")
        return (await self._get(context, request.workload))[1]

    async def ListRollouts(
        self, request: rollout_pb2.ListRolloutsRequest, context: Ctx
    ) -> rollout_pb2.ListRolloutsResponse:
        await authorize(context, SVC + "ListRollouts")
        try:
            kvs, _ = await self.store.get_prefix(keys.ROLLOUTS)
        except Exception as e:
            await self._fail(context, e)
            raise
        out = []
        for kv in kvs:
            r = rollout_pb2.Rollout()
            keys.decode_message(kv.value, r)
            out.append(r)
        return rollout_pb2.ListRolloutsResponse(rollouts=sorted(out, key=lambda r: r.workload))
