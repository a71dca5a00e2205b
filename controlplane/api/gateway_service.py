"""GatewayService: API keys, routing policies, gateway registration and the gateways' config feed.

Gateways hold no etcd credentials; everything they need comes through here (and endpoints through
`WorkloadService.WatchEndpoints`). API keys and policies are goal state kept by
`controlplane/gateways/`; the keys written are listed in `controlplane/keys.py`.

A gateway calls Heartbeat every few seconds: the first call (or the first after it moved to
another replica) grants a lease and writes its record; later calls only refresh that lease — the
one granted to that gateway, checked server-side, never another id the caller names — (any
replica can), so a live idle gateway costs no etcd writes and a dead one disappears after the TTL.
Heartbeats carry the gateway's cumulative traffic counters; the replica stores them (bound to the
gateway's lease) when they changed, at most every STATS_MIN_INTERVAL_S per gateway, so the leader's
rollout analysis sees the traffic of every gateway.
WatchGatewayConfig pushes the valid key hashes, the policies, the Request-as-a-Service endpoint
definitions and each workload's route state
(phase, ready count and why not ready, from this replica's watch-fed cache) whenever they change.
"""

from __future__ import annotations

import collections
import re
import time
from collections.abc import AsyncIterator

from controlplane import keys, paging
from controlplane.api.auth import Ctx
from controlplane.api.rpc import Servicer, rpc, rpc_stream
from controlplane.feeds import Feeds
from controlplane.gateways import api_keys, policies, request_endpoints
from controlplane.rollout import live_rollout
from controlplane.store import KV, EtcdStore
from controlplane.workloads import records
from kunlun_common.api import gateway_pb2, gateway_pb2_grpc, workload_pb2
from kunlun_common.clock import now_ms
from kunlun_common.errors import InvalidInput, PermanentError, PermissionRefused
from kunlun_common.messages import msg
from kunlun_common.states import InstancePhase
from kunlun_common.tls import Identity

STATS_MIN_INTERVAL_S = 3.0
_GATEWAY_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9.-]{0,61}[a-z0-9])?$")


def route_states(
    workloads: list[workload_pb2.Workload], instances: list[workload_pb2.Instance]
) -> list[gateway_pb2.WorkloadRouteState]:
    """Per workload: phase, ready instances and, in one line, what the others are doing."""
    by_wl: dict[str, list[workload_pb2.Instance]] = collections.defaultdict(list)
    for inst in instances:
        by_wl[inst.workload_id].append(inst)
    out = []
    for w in workloads:
        insts = by_wl.get(w.id, [])
        ready = sum(1 for i in insts if i.phase == InstancePhase.RUNNING and i.endpoint)
        counts = collections.Counter(
            (i.phase, i.reason) for i in insts if not (i.phase == InstancePhase.RUNNING and i.endpoint)
        )
        parts = [f"{n} {phase}" + (f" ({reason})" if reason else "") for (phase, reason), n in counts.items()]
        if w.deleting:
            parts.insert(0, "being deleted")
        elif len(insts) < w.spec.replicas:
            parts.append(f"{w.spec.replicas - len(insts)} not created yet")
        out.append(
            gateway_pb2.WorkloadRouteState(
                name=w.spec.name,
                phase=records.workload_phase(w, insts),
                replicas=w.spec.replicas,
                ready=ready,
                reason="; ".join(parts)[:400],
            )
        )
    out.sort(key=lambda s: s.name)
    return out


class GatewayService(Servicer, gateway_pb2_grpc.GatewayServiceServicer):
    SERVICE = "kunlun.v1.GatewayService"

    def __init__(self, store: EtcdStore, feeds: Feeds, replica_name: str) -> None:
        self.store = store
        self.feeds = feeds
        self.replica_name = replica_name
        # gateway -> (counters last written, when (monotonic), lease they were bound to)
        self._stats_written: dict[str, tuple[bytes, float, int]] = {}
        # gateway -> the lease granted to it (kept server-side: a heartbeat refreshes only this one)
        self._leases: dict[str, int] = {}

    # ------------------------------------------------------------------ API keys
    @rpc
    async def CreateApiKey(
        self, request: gateway_pb2.CreateApiKeyRequest, context: Ctx, who: Identity
    ) -> gateway_pb2.CreateApiKeyResponse:
        key, secret = await api_keys.create(self.store, request.name, str(who))
        return gateway_pb2.CreateApiKeyResponse(key=key, secret=secret)

    @rpc
    async def ListApiKeys(
        self, request: gateway_pb2.ListApiKeysRequest, context: Ctx, who: Identity
    ) -> gateway_pb2.ListApiKeysResponse:
        paging.check_page_size(request.page_size)
        if request.page_size:
            found, nxt, revision = await paging.list_page(
                self.store,
                keys.GATEWAY_KEYS,
                request,
                lambda kv: api_keys.listed(keys.decode(kv.value), request.include_revoked),
                paging.message_size,
            )
            return gateway_pb2.ListApiKeysResponse(keys=found, next_page_token=nxt, revision=revision)
        return gateway_pb2.ListApiKeysResponse(
            keys=await api_keys.list_keys(self.store, request.include_revoked)
        )

    @rpc
    async def RevokeApiKey(
        self, request: gateway_pb2.RevokeApiKeyRequest, context: Ctx, who: Identity
    ) -> gateway_pb2.RevokeApiKeyResponse:
        return gateway_pb2.RevokeApiKeyResponse(key=await api_keys.revoke(self.store, request.id, str(who)))

    # ------------------------------------------------------------------ routing policies
    @rpc
    async def SetRoutingPolicy(
        self, request: gateway_pb2.SetRoutingPolicyRequest, context: Ctx, who: Identity
    ) -> gateway_pb2.RoutingPolicy:
        return await policies.set_policy(self.store, request.policy, str(who))

    @rpc
    async def ListRoutingPolicies(
        self, request: gateway_pb2.ListRoutingPoliciesRequest, context: Ctx, who: Identity
    ) -> gateway_pb2.ListRoutingPoliciesResponse:
        paging.check_page_size(request.page_size)
        if request.page_size:
            found, nxt, revision = await paging.list_page(
                self.store,
                keys.GATEWAY_POLICIES,
                request,
                lambda kv: policies.policy_message(keys.decode(kv.value)),
                paging.message_size,
            )
            return gateway_pb2.ListRoutingPoliciesResponse(
                policies=found, next_page_token=nxt, revision=revision
            )
        return gateway_pb2.ListRoutingPoliciesResponse(policies=await policies.list_policies(self.store))

    # ------------------------------------------------------------------ registration
    @rpc
    async def Heartbeat(
        self, request: gateway_pb2.GatewayHeartbeatRequest, context: Ctx, who: Identity
    ) -> gateway_pb2.GatewayHeartbeatResponse:
        info = request.info
        if info.name != who.name:
            raise PermissionRefused(
                msg(
                    "gateway.name_refused",
                    "{who} may register only as {own!r}, not {name!r}",
                    who=str(who),
                    own=who.name,
                    name=info.name,
                )
            )
        if not _GATEWAY_NAME_RE.match(info.name):
            raise InvalidInput(
                msg("gateway.name_invalid", "name: {name!r} is not a valid name", name=info.name)
            )
        ttl = min(60, max(3, request.ttl_s or 10))
        if request.lease and await self._granted_to(info.name, request.lease):
            try:
                left = await self.store.lease_keepalive(request.lease)
            except PermanentError:
                left = 0  # expired or revoked: register anew
            if left > 0:
                await self._store_stats(request, request.lease)
                return gateway_pb2.GatewayHeartbeatResponse(
                    lease=request.lease, ttl_s=left, replica=self.replica_name
                )
        lease = await self.store.lease_grant(ttl)
        self._leases[info.name] = lease
        rec = gateway_pb2.GatewayInfo()
        rec.CopyFrom(info)
        rec.replica = self.replica_name
        await self.store.put(keys.gateway(info.name), keys.encode_message(rec), lease)
        await self._store_stats(request, lease)
        return gateway_pb2.GatewayHeartbeatResponse(lease=lease, ttl_s=ttl, replica=self.replica_name)

    async def _granted_to(self, gateway: str, lease: int) -> bool:
        """Whether `lease` is the one a replica granted `gateway`: this replica's own grant, or (after
        the gateway moved here) the lease its registration record is bound to in etcd. Any other id
        (another gateway's, the leader's, a node's: lease ids are guessable) is never refreshed."""
        if self._leases.get(gateway) == lease:
            return True
        kv = await self.store.get(keys.gateway(gateway))
        if kv is not None and kv.lease == lease:
            self._leases[gateway] = lease
            return True
        return False

    async def _store_stats(self, request: gateway_pb2.GatewayHeartbeatRequest, lease: int) -> None:
        """Write the gateway's counters (bound to its lease) when they changed, at most every
        STATS_MIN_INTERVAL_S; a new lease (registration) writes at once."""
        if not request.stats:
            return
        name = request.info.name
        stats = gateway_pb2.GatewayStats(
            gateway=name, started_at_unix_ms=request.info.started_at_unix_ms, stats=request.stats
        )
        body = stats.SerializeToString(deterministic=True)
        now = time.monotonic()
        last = self._stats_written.get(name)
        if (
            last is not None
            and last[2] == lease
            and (last[0] == body or now - last[1] < STATS_MIN_INTERVAL_S)
        ):
            return
        stats.at_unix_ms = now_ms()
        await self.store.put(keys.gateway_stats(name), keys.encode_message(stats), lease)
        self._stats_written[name] = (body, now, lease)

    @rpc
    async def ListGateways(
        self, request: gateway_pb2.ListGatewaysRequest, context: Ctx, who: Identity
    ) -> gateway_pb2.ListGatewaysResponse:
        paging.check_page_size(request.page_size)
        if request.page_size:
            found, nxt, revision = await paging.list_page(
                self.store, keys.GATEWAYS, request, _gateway_info, paging.message_size
            )
            return gateway_pb2.ListGatewaysResponse(gateways=found, next_page_token=nxt, revision=revision)
        kvs, _ = await self.store.get_prefix(keys.GATEWAYS)
        out = [_gateway_info(kv) for kv in kvs]
        out.sort(key=lambda g: g.name)
        return gateway_pb2.ListGatewaysResponse(gateways=out)

    # ------------------------------------------------------------------ config feed
    def config(self) -> gateway_pb2.GatewayConfig:
        """The gateways' configuration from this replica's watch-fed cache."""
        cache = self.feeds.cache
        hashes = [
            h for kv in cache.prefix(keys.GATEWAY_KEYS) if (h := api_keys.valid_hash(keys.decode(kv.value)))
        ]
        routing = [
            policies.policy_message(keys.decode(kv.value)) for kv in cache.prefix(keys.GATEWAY_POLICIES)
        ]
        workloads = []
        for kv in cache.prefix(keys.WORKLOADS):
            w = workload_pb2.Workload()
            keys.decode_message(kv.value, w)
            workloads.append(w)
        canaries = [
            gateway_pb2.CanaryWeight(workload=r.workload, weight_pct=r.weight_pct)
            for r in self.feeds.rollouts().values()
            if live_rollout(r)
        ]
        endpoints = [request_endpoints.decode(kv.value) for kv in cache.prefix(keys.REQUEST_ENDPOINTS)]
        return gateway_pb2.GatewayConfig(
            endpoints=sorted(endpoints, key=lambda e: e.name),
            canaries=sorted(canaries, key=lambda c: c.workload),
            key_hashes=sorted(hashes),
            policies=sorted(routing, key=lambda p: p.workload),
            workloads=route_states(workloads, self.feeds.instances()),
            revision=cache.revision,
            profiling=self.feeds.profiling.current(),
        )

    @rpc_stream
    async def WatchGatewayConfig(
        self, request: gateway_pb2.WatchGatewayConfigRequest, context: Ctx, who: Identity
    ) -> AsyncIterator[gateway_pb2.GatewayConfig]:
        """Push the whole config on every change (no polling)."""
        last: bytes | None = None
        seen = self.feeds.routing.version
        while True:
            cfg = self.config()
            rev = cfg.revision
            cfg.revision = 0
            body = cfg.SerializeToString(deterministic=True)
            if body != last:
                last = body
                cfg.revision = rev
                yield cfg
            seen = await self.feeds.routing.wait(seen)


def _gateway_info(kv: KV) -> gateway_pb2.GatewayInfo:
    g = gateway_pb2.GatewayInfo()
    keys.decode_message(kv.value, g)
    return g
