"""WorkloadService: goal-state writes only (validate, write, answer after etcd committed)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from controlplane import keys
from controlplane.api.auth import Ctx, abort, authorize
from controlplane.feeds import Feeds, decode_status, overlay
from controlplane.fencing import node_problems, registered_nodes
from controlplane.scheduler.config import SchedulerConfig, parse_scheduler_config, to_yaml
from controlplane.store import EtcdStore
from controlplane.workloads import records
from controlplane.workloads.spec import MAX_REPLICAS, SpecError, checked
from kunlun_common.api import agent_pb2, agent_pb2_grpc, workload_pb2, workload_pb2_grpc
from kunlun_common.clock import now_ms
from kunlun_common.errors import ConfigError, PermanentError, TemporaryError
from kunlun_common.states import WorkloadChange, scaled_to
from kunlun_common.tls import TlsMaterial, channel_credentials

SVC = "/kunlun.v1.WorkloadService/"


class WorkloadService(workload_pb2_grpc.WorkloadServiceServicer):
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

    async def _fail(self, context: Ctx, e: Exception) -> None:
        if isinstance(e, SpecError):
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if isinstance(e, records.NotFound):
            await abort(context, grpc.StatusCode.NOT_FOUND, str(e))
        if isinstance(e, ConfigError):
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if isinstance(e, TemporaryError):
            await abort(context, grpc.StatusCode.UNAVAILABLE, str(e))
        if isinstance(e, PermanentError):
            await abort(context, grpc.StatusCode.FAILED_PRECONDITION, str(e))
        raise e

    async def SubmitWorkload(
        self, request: workload_pb2.SubmitWorkloadRequest, context: Ctx
    ) -> workload_pb2.SubmitWorkloadResponse:
        who = await authorize(context, SVC + "SubmitWorkload")
        try:
            spec = checked(request.spec)
            w, result = await records.submit(self.store, spec, str(who))
        except Exception as e:
            await self._fail(context, e)
            raise
        return workload_pb2.SubmitWorkloadResponse(workload=w, result=result)

    async def ListWorkloads(
        self, request: workload_pb2.ListWorkloadsRequest, context: Ctx
    ) -> workload_pb2.ListWorkloadsResponse:
        await authorize(context, SVC + "ListWorkloads")
        kvs, _ = await self.store.get_prefix(keys.WORKLOADS)
        insts = await self._instances()
        out = []
        for kv in kvs:
            w = records.decode_workload(kv)
            ii = insts.get(w.id, [])
            out.append(
                workload_pb2.WorkloadSummary(workload=w, instances=ii, phase=records.workload_phase(w, ii))
            )
        out.sort(key=lambda s: s.workload.created_at_unix_ms)
        return workload_pb2.ListWorkloadsResponse(workloads=out)

    async def GetWorkload(
        self, request: workload_pb2.GetWorkloadRequest, context: Ctx
    ) -> workload_pb2.WorkloadSummary:
        await authorize(context, SVC + "GetWorkload")
        try:
            w, _ = await records.resolve(self.store, request.name)
        except Exception as e:
            await self._fail(context, e)
            raise
        ii = (await self._instances()).get(w.id, [])
        return workload_pb2.WorkloadSummary(workload=w, instances=ii, phase=records.workload_phase(w, ii))

    async def ScaleWorkload(
        self, request: workload_pb2.ScaleWorkloadRequest, context: Ctx
    ) -> workload_pb2.SubmitWorkloadResponse:
        who = await authorize(context, SVC + "ScaleWorkload")
        if not 0 <= request.replicas <= MAX_REPLICAS:
            await abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"replicas: expected 0..{MAX_REPLICAS}, found {request.replicas}",
            )
        try:
            w = await records.update(
                self.store, request.name, scaled_to(request.replicas), str(who), replicas=request.replicas
            )
        except Exception as e:
            await self._fail(context, e)
            raise
        return workload_pb2.SubmitWorkloadResponse(workload=w, result="updated")

    async def DeleteWorkload(
        self, request: workload_pb2.DeleteWorkloadRequest, context: Ctx
    ) -> workload_pb2.DeleteWorkloadResponse:
        who = await authorize(context, SVC + "DeleteWorkload")
        try:
            w = await records.update(self.store, request.name, WorkloadChange.DELETING, str(who), delete=True)
        except Exception as e:
            await self._fail(context, e)
            raise
        return workload_pb2.DeleteWorkloadResponse(id=w.id)

    async def CordonNode(
        self, request: workload_pb2.CordonNodeRequest, context: Ctx
    ) -> workload_pb2.CordonNodeResponse:
        who = await authorize(context, SVC + "CordonNode")
        if await self.store.get(keys.node(request.node)) is None:
            await abort(
                context,
                grpc.StatusCode.NOT_FOUND,
                f"node {request.node!r} is not registered; see `kunlun-cli node list`",
            )
        cordoned = request.cordon or request.drain
        await self.store.put(
            keys.cordon(request.node),
            keys.encode(
                {
                    "cordoned": cordoned,
                    "drain": request.drain,
                    "by": str(who),
                    "at_ms": now_ms(),
                }
            ),
        )
        return workload_pb2.CordonNodeResponse(node=request.node, cordoned=cordoned, draining=request.drain)

    async def GetSchedulerConfig(
        self, request: workload_pb2.SchedulerConfigRequest, context: Ctx
    ) -> workload_pb2.SchedulerConfigText:
        await authorize(context, SVC + "GetSchedulerConfig")
        kv = await self.store.get(keys.SCHEDULER_CONFIG)
        text = str(keys.decode(kv.value)["yaml"]) if kv else to_yaml(SchedulerConfig())
        return workload_pb2.SchedulerConfigText(yaml=text)

    async def SetSchedulerConfig(
        self, request: workload_pb2.SchedulerConfigText, context: Ctx
    ) -> workload_pb2.SchedulerConfigText:
        who = await authorize(context, SVC + "SetSchedulerConfig")
        try:
            cfg = parse_scheduler_config(request.yaml, "scheduler_config.yaml")
        except ConfigError as e:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if problems := node_problems(await registered_nodes(self.store), cfg.node_not_ready_grace_seconds):
            await abort(context, grpc.StatusCode.FAILED_PRECONDITION, "; ".join(problems))
        text = to_yaml(cfg)
        await self.store.put(
            keys.SCHEDULER_CONFIG,
            keys.encode({"yaml": text, "by": str(who), "at_ms": now_ms()}),
        )
        return workload_pb2.SchedulerConfigText(yaml=text)

    async def WatchEndpoints(
        self, request: workload_pb2.WatchEndpointsRequest, context: Ctx
    ) -> AsyncIterator[workload_pb2.EndpointsSnapshot]:
        """Push the routable endpoints on every change (full snapshot; no polling)."""
        await authorize(context, SVC + "WatchEndpoints")
        last: list[workload_pb2.Endpoint] | None = None
        seen = self.feeds.routing.version
        while True:
            snap = self.feeds.endpoints()
            if last is None or list(snap.endpoints) != last:
                last = list(snap.endpoints)
                yield snap
            seen = await self.feeds.routing.wait(seen)

    async def Logs(
        self, request: workload_pb2.WorkloadLogsRequest, context: Ctx
    ) -> AsyncIterator[workload_pb2.WorkloadLogChunk]:
        """Stream an instance's logs from its node (the agent's NodeService), through this replica."""
        await authorize(context, SVC + "Logs")
        try:
            w, _ = await records.resolve(self.store, request.name)
        except Exception as e:
            await self._fail(context, e)
            raise
        insts = (await self._instances()).get(w.id, [])
        inst = next((i for i in insts if i.ordinal == request.instance), None)
        if inst is None:
            await abort(
                context,
                grpc.StatusCode.NOT_FOUND,
                f"workload {request.name} has no instance {request.instance}",
            )
        if not inst.node:
            await abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"instance {inst.id} is not placed on a node yet ({inst.reason})",
            )
        address = self.feeds.node_service(inst.node)
        if not address:
            await abort(
                context,
                grpc.StatusCode.UNAVAILABLE,
                f"node {inst.node} does not serve logs (agent too old or not connected)",
            )
        creds = channel_credentials(self.tls)
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
                await abort(context, e.code(), f"node {inst.node}: {e.details()}")
