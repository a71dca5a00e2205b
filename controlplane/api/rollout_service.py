"""RolloutService: a rollout's goal state (`controlplane/workloads/rollouts.py` holds the logic)."""

from __future__ import annotations

from controlplane import keys, paging
from controlplane.api.auth import Ctx
from controlplane.api.rpc import Servicer, rpc
from controlplane.rollout import gateway_stats, live_rollout, step_analysis
from controlplane.store import EtcdStore
from controlplane.workloads import rollouts
from kunlun_common.api import rollout_pb2, rollout_pb2_grpc
from kunlun_common.clock import now_ms
from kunlun_common.tls import Identity


class RolloutService(Servicer, rollout_pb2_grpc.RolloutServiceServicer):
    SERVICE = "kunlun.v1.RolloutService"

    def __init__(self, store: EtcdStore) -> None:
        self.store = store

    @rpc
    async def CreateRollout(
        self, request: rollout_pb2.CreateRolloutRequest, context: Ctx, who: Identity
    ) -> rollout_pb2.Rollout:
        return await rollouts.create(self.store, request.spec, str(who))

    @rpc
    async def PromoteRollout(
        self, request: rollout_pb2.RolloutRequest, context: Ctx, who: Identity
    ) -> rollout_pb2.Rollout:
        return await rollouts.request(self.store, request.workload, promote=True)

    @rpc
    async def AbortRollout(
        self, request: rollout_pb2.RolloutRequest, context: Ctx, who: Identity
    ) -> rollout_pb2.Rollout:
        return await rollouts.request(self.store, request.workload, promote=False)

    @rpc
    async def GetRollout(
        self, request: rollout_pb2.RolloutRequest, context: Ctx, who: Identity
    ) -> rollout_pb2.Rollout:
        r = (await rollouts.get(self.store, request.workload))[1]
        if request.live_analysis and live_rollout(r):
            # the leader's step analysis, made now with the counters as stored (nothing written)
            kvs, _ = await self.store.get_prefix(keys.GATEWAY_STATS)
            r.live_analysis.CopyFrom(step_analysis(r, gateway_stats(kvs), now_ms()))
        return r

    @rpc
    async def ListRollouts(
        self, request: rollout_pb2.ListRolloutsRequest, context: Ctx, who: Identity
    ) -> rollout_pb2.ListRolloutsResponse:
        paging.check_page_size(request.page_size)
        if request.page_size:
            found, nxt, revision = await paging.list_page(
                self.store, keys.ROLLOUTS, request, rollouts.decode_rollout, paging.message_size
            )
            return rollout_pb2.ListRolloutsResponse(rollouts=found, next_page_token=nxt, revision=revision)
        return rollout_pb2.ListRolloutsResponse(rollouts=await rollouts.list_all(self.store))
