"""WorkloadService: goal-state writes only (validate, write, answer after etcd committed)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from controlplane import keys, paging
from controlplane.api.auth import Ctx, abort
from controlplane.api.rpc import Servicer, rpc, rpc_stream
from controlplane.feeds import Feeds, decode_status, overlay
from controlplane.fencing import node_problems, registered_nodes
from controlplane.graph import load_nodes
from controlplane.redact import instances_for, workload_for
from controlplane.scheduler.config import SchedulerConfig, parse_scheduler_config, to_yaml
from controlplane.scheduler.rolling import rolling_progress
from controlplane.store import EtcdStore
from controlplane.telemetry import PLACED_PHASES, spreads
from controlplane.workloads import records
from controlplane.workloads.dry_run import dry_run_plan
from controlplane.workloads.package_checks import package_problems
from controlplane.workloads.spec import MAX_REPLICAS, SpecError, checked
from kunlun_common.api import agent_pb2, agent_pb2_grpc, workload_pb2, workload_pb2_grpc
from kunlun_common.clock import now_ms
from kunlun_common.errors import InvalidInput, NotFoundError, PermanentError, TemporaryError
from kunlun_common.messages import msg, msg_list, to_stored
from kunlun_common.states import WorkloadChange, scaled_to
from kunlun_common.tls import Identity, TlsMaterial, channel_credentials


def summary_of(
    who: Identity, w: workload_pb2.Workload, ii: list[workload_pb2.Instance]
) -> workload_pb2.WorkloadSummary:
    """A workload with its instances as `who` may see them (phase and progress from them first:
    `instances_for` changes the instances in place)."""
    phase, rolling = records.workload_phase(w, ii), rolling_progress(w, ii)
    return workload_pb2.WorkloadSummary(
        workload=workload_for(who, w), instances=instances_for(who, w, ii), phase=phase, rolling=rolling
    )


class WorkloadService(Servicer, workload_pb2_grpc.WorkloadServiceServicer):
    SERVICE = "kunlun.v1.WorkloadService"

    def __init__(self, store: EtcdStore, feeds: Feeds, tls: TlsMaterial) -> None:
        self.store = store
        self.feeds = feeds
        self.tls = tls

    async def _instances(self) -> dict[str, list[workload_pb2.Instance]]:
        (kvs, _), (status_kvs, _) = await asyncio.gather(
            self.store.get_prefix(keys.INSTANCES), self.store.get_prefix(keys.INSTANCE_STATUS)
        )
        statuses = {keys.last_segment(kv.key): decode_status(kv.value) for kv in status_kvs}
        out: dict[str, list[workload_pb2.Instance]] = {}
        for kv in kvs:
            inst = records.decode_instance(kv)
            if inst.id in statuses:
                overlay(inst, *statuses[inst.id])
            out.setdefault(inst.workload_id, []).append(inst)
        for v in out.values():
            v.sort(key=lambda i: i.ordinal)
        return out

    @rpc
    async def SubmitWorkload(
        self, request: workload_pb2.SubmitWorkloadRequest, context: Ctx, who: Identity
    ) -> workload_pb2.SubmitWorkloadResponse:
        spec = checked(request.spec)
        if problems := await package_problems(self.store, spec):
            raise SpecError(problems)
        if request.dry_run:
            plan = await dry_run_plan(self.store, spec)
            return workload_pb2.SubmitWorkloadResponse(
                workload=workload_pb2.Workload(spec=spec),
                result="dry-run",
                plan=[str(m) for m in plan],
                plan_messages=[to_stored(m) for m in plan],
            )
        w, result = await records.submit(self.store, spec, str(who))
        return workload_pb2.SubmitWorkloadResponse(workload=w, result=result)

    @rpc
    async def ListWorkloads(
        self, request: workload_pb2.ListWorkloadsRequest, context: Ctx, who: Identity
    ) -> workload_pb2.ListWorkloadsResponse:
        paging.check_page_size(request.page_size)
        if request.page_size:
            return await self._list_page(request.page_size, request.page_token, who)
        kvs, revision = await self.store.get_prefix(keys.WORKLOADS)
        insts = await self._instances()
        out = []
        for kv in kvs:
            w = records.decode_workload(kv)
            ii = insts.get(w.id, [])
            out.append(summary_of(who, w, ii))
        out.sort(key=lambda s: s.workload.created_at_unix_ms)
        return workload_pb2.ListWorkloadsResponse(workloads=out, revision=revision)

    async def _list_page(
        self, size: int, token_text: str, who: Identity
    ) -> workload_pb2.ListWorkloadsResponse:
        token = paging.PageToken.decode(token_text) if token_text else None
        kvs, revision, more = await paging.read_records(self.store, keys.WORKLOADS, size, token)
        ws = [records.decode_workload(kv) for kv in kvs]
        by_workload: dict[str, list[workload_pb2.Instance]] = {w.id: [] for w in ws}
        if ws:
            (ikvs, _, _), (skvs, _, _) = await asyncio.gather(
                # instance ids start with their workload's id: those of the page's workloads lie
                # between its first and its last id
                paging.read_range(
                    self.store, *paging.companion_range(keys.INSTANCES, ws[0].id, ws[-1].id), 0, revision
                ),
                paging.read_range(
                    self.store,
                    *paging.companion_range(keys.INSTANCE_STATUS, ws[0].id, ws[-1].id),
                    0,
                    revision,
                ),
            )
            statuses = {keys.last_segment(kv.key): decode_status(kv.value) for kv in skvs}
            for kv in ikvs:
                inst = records.decode_instance(kv)
                if inst.workload_id not in by_workload:
                    continue
                if inst.id in statuses:
                    overlay(inst, *statuses[inst.id])
                by_workload[inst.workload_id].append(inst)
        out = []
        for w in ws:
            ii = sorted(by_workload[w.id], key=lambda i: i.ordinal)
            out.append(summary_of(who, w, ii))
        nxt = paging.PageToken(revision, ws[-1].id).encode() if more and ws else ""
        return workload_pb2.ListWorkloadsResponse(workloads=out, next_page_token=nxt, revision=revision)

    @rpc
    async def GetWorkload(
        self, request: workload_pb2.GetWorkloadRequest, context: Ctx, who: Identity
    ) -> workload_pb2.WorkloadSummary:
        w, _ = await records.resolve(self.store, request.name)
        ii = (await self._instances()).get(w.id, [])
        placed = [i for i in ii if i.phase in PLACED_PHASES and i.target_devices]
        summary = summary_of(who, w, ii)
        if placed:
            # the devices' samples as the replicas last wrote them (coarse snapshots, every few seconds)
            spread = spreads(await load_nodes(self.store), placed)[0]
            summary.load_balance.CopyFrom(
                workload_pb2.LoadBalance(
                    devices=spread.devices, mean=spread.mean, stddev=spread.stddev, max_min=spread.max_min
                )
            )
        return summary

    @rpc
    async def ScaleWorkload(
        self, request: workload_pb2.ScaleWorkloadRequest, context: Ctx, who: Identity
    ) -> workload_pb2.SubmitWorkloadResponse:
        if not 0 <= request.replicas <= MAX_REPLICAS:
            raise InvalidInput(
                msg(
                    "workload.replicas_range",
                    "replicas: expected 0..{max}, found {found}",
                    max=MAX_REPLICAS,
                    found=request.replicas,
                )
            )
        w = await records.update(
            self.store, request.name, scaled_to(request.replicas), str(who), replicas=request.replicas
        )
        return workload_pb2.SubmitWorkloadResponse(workload=w, result="updated")

    @rpc
    async def DeleteWorkload(
        self, request: workload_pb2.DeleteWorkloadRequest, context: Ctx, who: Identity
    ) -> workload_pb2.DeleteWorkloadResponse:
        w = await records.update(self.store, request.name, WorkloadChange.DELETING, str(who), delete=True)
        return workload_pb2.DeleteWorkloadResponse(id=w.id)

    @rpc
    async def CordonNode(
        self, request: workload_pb2.CordonNodeRequest, context: Ctx, who: Identity
    ) -> workload_pb2.CordonNodeResponse:
        cordoned = await records.cordon(self.store, request.node, request.cordon, request.drain, str(who))
        return workload_pb2.CordonNodeResponse(node=request.node, cordoned=cordoned, draining=request.drain)

    @rpc
    async def GetSchedulerConfig(
        self, request: workload_pb2.SchedulerConfigRequest, context: Ctx, who: Identity
    ) -> workload_pb2.SchedulerConfigText:
        kv = await self.store.get(keys.SCHEDULER_CONFIG)
        text = str(keys.decode(kv.value)["yaml"]) if kv else to_yaml(SchedulerConfig())
        return workload_pb2.SchedulerConfigText(yaml=text)

    @rpc
    async def SetSchedulerConfig(
        self, request: workload_pb2.SchedulerConfigText, context: Ctx, who: Identity
    ) -> workload_pb2.SchedulerConfigText:
        cfg = parse_scheduler_config(request.yaml, "scheduler_config.yaml")
        if problems := node_problems(await registered_nodes(self.store), cfg.node_not_ready_grace_seconds):
            # FAILED_PRECONDITION: the grace or the agents must change
            raise PermanentError(
                msg_list("scheduler.config.fencing", "{parts}", problems, bullet="", sep="; ")
            )
        text = to_yaml(cfg)
        await self.store.put(
            keys.SCHEDULER_CONFIG,
            keys.encode({"yaml": text, "by": str(who), "at_ms": now_ms()}),
        )
        return workload_pb2.SchedulerConfigText(yaml=text)

    @rpc_stream
    async def WatchEndpoints(
        self, request: workload_pb2.WatchEndpointsRequest, context: Ctx, who: Identity
    ) -> AsyncIterator[workload_pb2.EndpointsSnapshot]:
        """Push the routable endpoints on every change (full snapshot; no polling)."""
        last: list[workload_pb2.Endpoint] | None = None
        seen = self.feeds.routing.version
        while True:
            snap = self.feeds.endpoints()
            if last is None or list(snap.endpoints) != last:
                last = list(snap.endpoints)
                yield snap
            seen = await self.feeds.routing.wait(seen)

    @rpc_stream
    async def Logs(
        self, request: workload_pb2.WorkloadLogsRequest, context: Ctx, who: Identity
    ) -> AsyncIterator[workload_pb2.WorkloadLogChunk]:
        """Stream an instance's logs from its node (the agent's NodeService), through this replica."""
        w, _ = await records.resolve(self.store, request.name)
        insts = (await self._instances()).get(w.id, [])
        # the baseline instance of that ordinal; during a rolling update the newest generation's
        insts = sorted(insts, key=lambda i: (i.variant != "", i.retiring, -i.generation))
        inst = next((i for i in insts if i.ordinal == request.instance), None)
        if inst is None:
            raise NotFoundError(
                msg(
                    "workload.no_instance",
                    "workload {name} has no instance {instance}",
                    name=request.name,
                    instance=request.instance,
                )
            )
        if not inst.node:
            raise PermanentError(
                msg(
                    "instance.not_placed",
                    "instance {instance} is not placed on a node yet ({reason})",
                    instance=inst.id,
                    reason=inst.reason,
                )
            )
        address = self.feeds.node_service(inst.node)
        if not address:
            raise TemporaryError(
                msg(
                    "node.no_logs",
                    "node {node} does not serve logs (agent too old or not connected)",
                    node=inst.node,
                )
            )
        # the agent's NodeService must present the certificate of this node (cluster CA, the node's
        # name in its SANs): the name checked is the node's, not the address's
        creds = channel_credentials(self.tls, server_role="agent")
        async with grpc.aio.secure_channel(
            address, creds, options=[("grpc.ssl_target_name_override", inst.node)]
        ) as ch:
            stub = agent_pb2_grpc.NodeServiceStub(ch)
            call = stub.Logs(
                agent_pb2.LogsRequest(instance_id=inst.id, tail=request.tail, follow=request.follow)
            )
            try:
                async for chunk in call:
                    yield workload_pb2.WorkloadLogChunk(lines=list(chunk.lines))
            except grpc.aio.AioRpcError as e:
                await abort(
                    context,
                    e.code(),
                    msg("node.error", "node {node}: {details}", node=inst.node, details=e.details()),
                )
