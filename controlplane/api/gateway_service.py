"""GatewayService: API keys, routing policies, gateway registration and the gateways' config feed.

Gateways hold no etcd credentials; everything they need comes through here (and endpoints through
`WorkloadService.WatchEndpoints`). Keys written (all under `/kunlun/v1/`):

| key                          | written by               | value (JSON)                                          | lease          |
|------------------------------|--------------------------|-------------------------------------------------------|----------------|
| gateway-keys/<id>            | API (CreateApiKey,       | {"schema", "id", "name", "hash" (hex SHA-256 of the   | -              |
|                              |  RevokeApiKey)           |  secret; the secret itself is never stored), "prefix",|                |
|                              |                          |  "created_by", "created_at_ms", "revoked_by",         |                |
|                              |                          |  "revoked_at_ms" (0 while valid)}                     |                |
| gateway-policies/<workload>  | API (SetRoutingPolicy)   | {"schema", "workload", "policy", "balance_factor",    | -              |
|                              |                          |  "prefix_chars", "by", "at_ms"}                       |                |
| gateways/<gateway name>      | replica for its gateway  | GatewayInfo (proto JSON): name, address, pid, version,| gateway lease  |
|                              |  (Heartbeat)             |  started_at, replica                                  | (ttl 3..60 s)  |
| gateway-stats/<gateway name> | replica for its gateway  | GatewayStats (proto JSON): cumulative requests, errors| gateway lease  |
|                              |  (Heartbeat)             |  and latency buckets per workload and version         |                |

A gateway calls Heartbeat every few seconds: the first call (or the first after it moved to
another replica) grants a lease and writes its record; later calls only refresh that lease (any
replica can), so a live idle gateway costs no etcd writes and a dead one disappears after the TTL.
Heartbeats carry the gateway's cumulative traffic counters; the replica stores them (bound to the
gateway's lease) when they changed, at most every STATS_MIN_INTERVAL_S per gateway, so the leader's
rollout analysis sees the traffic of every gateway.
WatchGatewayConfig pushes the valid key hashes, the policies and each workload's route state
(phase, ready count and why not ready, from this replica's watch-fed cache) whenever they change.
"""

from __future__ import annotations

import collections
import re
import secrets
import time
from collections.abc import AsyncIterator

import grpc

from controlplane import keys
from controlplane.api.auth import Ctx, abort, authorize
from controlplane.feeds import Feeds
from controlplane.rollout import live_rollout
from controlplane.store import EtcdStore
from controlplane.workloads import records
from controlplane.workloads.spec import NAME_RE
from kunlun_common.api import gateway_pb2, gateway_pb2_grpc, workload_pb2
from kunlun_common.clock import now_ms
from kunlun_common.errors import PermanentError, TemporaryError
from kunlun_common.states import InstancePhase
from kunlun_common.traffic import ROUTING_POLICIES as POLICIES
from kunlun_common.traffic import key_hash

SVC = "/kunlun.v1.GatewayService/"
GATEWAY_KEYS = keys.ROOT + "gateway-keys/"
GATEWAY_POLICIES = keys.ROOT + "gateway-policies/"
GATEWAYS = keys.ROOT + "gateways/"
_KEY_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
STATS_MIN_INTERVAL_S = 3.0
_GATEWAY_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9.-]{0,61}[a-z0-9])?$")

# The roles allowed per RPC (the same lines belong in controlplane/api/auth.py PERMISSIONS).
GATEWAY_PERMISSIONS: dict[str, tuple[str, ...]] = {
    SVC + "CreateApiKey": ("operator",),
    SVC + "ListApiKeys": ("operator", "viewer", "replica"),
    SVC + "RevokeApiKey": ("operator",),
    SVC + "SetRoutingPolicy": ("operator",),
    SVC + "ListRoutingPolicies": ("operator", "viewer", "replica", "gateway"),
    SVC + "Heartbeat": ("gateway",),
    SVC + "ListGateways": ("operator", "viewer", "replica"),
    SVC + "WatchGatewayConfig": ("gateway", "operator"),
}


def api_key_message(rec: dict[str, object]) -> gateway_pb2.ApiKey:
    return gateway_pb2.ApiKey(
        id=str(rec.get("id", "")),
        name=str(rec.get("name", "")),
        prefix=str(rec.get("prefix", "")),
        created_at_unix_ms=int(str(rec.get("created_at_ms", 0))),
        created_by=str(rec.get("created_by", "")),
        revoked_at_unix_ms=int(str(rec.get("revoked_at_ms", 0))),
        revoked_by=str(rec.get("revoked_by", "")),
    )


def policy_message(rec: dict[str, object]) -> gateway_pb2.RoutingPolicy:
    return gateway_pb2.RoutingPolicy(
        workload=str(rec.get("workload", "")),
        policy=str(rec.get("policy", "")),
        balance_factor=float(str(rec.get("balance_factor", 0.0))),
        prefix_chars=int(str(rec.get("prefix_chars", 0))),
        updated_by=str(rec.get("by", "")),
        updated_at_unix_ms=int(str(rec.get("at_ms", 0))),
    )


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


class GatewayService(gateway_pb2_grpc.GatewayServiceServicer):
    def __init__(self, store: EtcdStore, feeds: Feeds, replica_name: str) -> None:
        self.store = store
        self.feeds = feeds
        self.replica_name = replica_name
        # gateway -> (counters last written, when (monotonic), lease they were bound to)
        self._stats_written: dict[str, tuple[bytes, float, int]] = {}

    async def _fail(self, context: Ctx, e: Exception) -> None:
        if isinstance(e, TemporaryError):
            await abort(context, grpc.StatusCode.UNAVAILABLE, str(e))
        if isinstance(e, PermanentError):
            await abort(context, grpc.StatusCode.FAILED_PRECONDITION, str(e))
        raise e

    # ------------------------------------------------------------------ API keys
    async def CreateApiKey(
        self, request: gateway_pb2.CreateApiKeyRequest, context: Ctx
    ) -> gateway_pb2.CreateApiKeyResponse:
        who = await authorize(context, SVC + "CreateApiKey")
        if not _KEY_NAME_RE.match(request.name):
            await abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"name: {request.name!r} is not valid; use letters, digits, '.', '_' and '-', at most 63",
            )
        try:
            for _ in range(5):
                kid = secrets.token_hex(4)
                secret = f"kl-{kid}-{secrets.token_urlsafe(32)}"
                rec: dict[str, object] = {
                    "id": kid,
                    "name": request.name,
                    "hash": key_hash(secret),
                    "prefix": secret[:12],
                    "created_by": str(who),
                    "created_at_ms": now_ms(),
                    "revoked_by": "",
                    "revoked_at_ms": 0,
                }
                res = await self.store.create(GATEWAY_KEYS + kid, keys.encode(rec))
                if res.succeeded:
                    return gateway_pb2.CreateApiKeyResponse(key=api_key_message(rec), secret=secret)
        except Exception as e:
            await self._fail(context, e)
            raise
        await abort(context, grpc.StatusCode.ABORTED, "could not pick a free key id; try again")

    async def _key_records(self) -> list[tuple[str, dict[str, object]]]:
        kvs, _ = await self.store.get_prefix(GATEWAY_KEYS)
        return [(kv.key, keys.decode(kv.value)) for kv in kvs]

    async def ListApiKeys(
        self, request: gateway_pb2.ListApiKeysRequest, context: Ctx
    ) -> gateway_pb2.ListApiKeysResponse:
        await authorize(context, SVC + "ListApiKeys")
        try:
            recs = await self._key_records()
        except Exception as e:
            await self._fail(context, e)
            raise
        out = [api_key_message(r) for _, r in recs if request.include_revoked or not r.get("revoked_at_ms")]
        out.sort(key=lambda k: (k.created_at_unix_ms, k.id))
        return gateway_pb2.ListApiKeysResponse(keys=out)

    async def RevokeApiKey(
        self, request: gateway_pb2.RevokeApiKeyRequest, context: Ctx
    ) -> gateway_pb2.RevokeApiKeyResponse:
        who = await authorize(context, SVC + "RevokeApiKey")
        try:
            recs = await self._key_records()
        except Exception as e:
            await self._fail(context, e)
            raise
        found = [(k, r) for k, r in recs if r.get("id") == request.id]
        if not found:
            found = [(k, r) for k, r in recs if r.get("name") == request.id and not r.get("revoked_at_ms")]
        if not found:
            await abort(
                context,
                grpc.StatusCode.NOT_FOUND,
                f"no API key {request.id!r}; see `kunlun-cli gateway keys list`",
            )
        if len(found) > 1:
            ids = ", ".join(str(r.get("id")) for _, r in found)
            await abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{len(found)} valid keys are named {request.id!r} ({ids}); revoke by id",
            )
        key, rec = found[0]
        if not rec.get("revoked_at_ms"):
            rec = {**rec, "revoked_by": str(who), "revoked_at_ms": now_ms()}
            rec.pop("schema", None)
            try:
                await self.store.put(key, keys.encode(rec))
            except Exception as e:
                await self._fail(context, e)
                raise
        return gateway_pb2.RevokeApiKeyResponse(key=api_key_message(rec))

    # ------------------------------------------------------------------ routing policies
    async def SetRoutingPolicy(
        self, request: gateway_pb2.SetRoutingPolicyRequest, context: Ctx
    ) -> gateway_pb2.RoutingPolicy:
        who = await authorize(context, SVC + "SetRoutingPolicy")
        p = request.policy
        if not NAME_RE.match(p.workload):
            await abort(
                context, grpc.StatusCode.INVALID_ARGUMENT, f"workload: {p.workload!r} is not a valid name"
            )
        if p.policy not in (*POLICIES, "", "default"):
            await abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"policy: expected one of {', '.join(POLICIES)} or default, found {p.policy!r}",
            )
        if p.balance_factor and not 1.0 <= p.balance_factor <= 10.0:
            await abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"balance_factor: expected 1..10, found {p.balance_factor}",
            )
        if not 0 <= p.prefix_chars <= 65536:
            await abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"prefix_chars: expected 0..65536, found {p.prefix_chars}",
            )
        try:
            if p.policy in ("", "default"):
                await self.store.delete(GATEWAY_POLICIES + p.workload)
                return gateway_pb2.RoutingPolicy(workload=p.workload, policy="default", updated_by=str(who))
            rec: dict[str, object] = {
                "workload": p.workload,
                "policy": p.policy,
                "balance_factor": p.balance_factor,
                "prefix_chars": p.prefix_chars,
                "by": str(who),
                "at_ms": now_ms(),
            }
            await self.store.put(GATEWAY_POLICIES + p.workload, keys.encode(rec))
        except Exception as e:
            await self._fail(context, e)
            raise
        return policy_message(rec)

    async def ListRoutingPolicies(
        self, request: gateway_pb2.ListRoutingPoliciesRequest, context: Ctx
    ) -> gateway_pb2.ListRoutingPoliciesResponse:
        await authorize(context, SVC + "ListRoutingPolicies")
        try:
            kvs, _ = await self.store.get_prefix(GATEWAY_POLICIES)
        except Exception as e:
            await self._fail(context, e)
            raise
        out = sorted((policy_message(keys.decode(kv.value)) for kv in kvs), key=lambda p: p.workload)
        return gateway_pb2.ListRoutingPoliciesResponse(policies=out)

    # ------------------------------------------------------------------ registration
    async def Heartbeat(
        self, request: gateway_pb2.GatewayHeartbeatRequest, context: Ctx
    ) -> gateway_pb2.GatewayHeartbeatResponse:
        who = await authorize(context, SVC + "Heartbeat")
        info = request.info
        if info.name != who.name:
            await abort(
                context,
                grpc.StatusCode.PERMISSION_DENIED,
                f"{who} may register only as {who.name!r}, not {info.name!r}",
            )
        if not _GATEWAY_NAME_RE.match(info.name):
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"name: {info.name!r} is not a valid name")
        ttl = min(60, max(3, request.ttl_s or 10))
        try:
            if request.lease:
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
            rec = gateway_pb2.GatewayInfo()
            rec.CopyFrom(info)
            rec.replica = self.replica_name
            await self.store.put(GATEWAYS + info.name, keys.encode_message(rec), lease)
            await self._store_stats(request, lease)
        except Exception as e:
            await self._fail(context, e)
            raise
        return gateway_pb2.GatewayHeartbeatResponse(lease=lease, ttl_s=ttl, replica=self.replica_name)

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

    async def ListGateways(
        self, request: gateway_pb2.ListGatewaysRequest, context: Ctx
    ) -> gateway_pb2.ListGatewaysResponse:
        await authorize(context, SVC + "ListGateways")
        try:
            kvs, _ = await self.store.get_prefix(GATEWAYS)
        except Exception as e:
            await self._fail(context, e)
            raise
        out = []
        for kv in kvs:
            g = gateway_pb2.GatewayInfo()
            keys.decode_message(kv.value, g)
            out.append(g)
        out.sort(key=lambda g: g.name)
        return gateway_pb2.ListGatewaysResponse(gateways=out)

    # ------------------------------------------------------------------ config feed
    def config(self) -> gateway_pb2.GatewayConfig:
        """The gateways' configuration from this replica's watch-fed cache."""
        cache = self.feeds.cache
        hashes = []
        for kv in cache.prefix(GATEWAY_KEYS):
            rec = keys.decode(kv.value)
            if not rec.get("revoked_at_ms") and rec.get("hash"):
                hashes.append(str(rec["hash"]))
        policies = [policy_message(keys.decode(kv.value)) for kv in cache.prefix(GATEWAY_POLICIES)]
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
        return gateway_pb2.GatewayConfig(
            canaries=sorted(canaries, key=lambda c: c.workload),
            key_hashes=sorted(hashes),
            policies=sorted(policies, key=lambda p: p.workload),
            workloads=route_states(workloads, self.feeds.instances()),
            revision=cache.revision,
        )

    async def WatchGatewayConfig(
        self, request: gateway_pb2.WatchGatewayConfigRequest, context: Ctx
    ) -> AsyncIterator[gateway_pb2.GatewayConfig]:
        """Push the whole config on every change (no polling)."""
        await authorize(context, SVC + "WatchGatewayConfig")
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
