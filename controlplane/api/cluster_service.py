"""ClusterService: read API for operators and viewers (devices, nodes, cluster status), and the
operator's drain of one replica."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from controlplane import graph_pages, keys, paging
from controlplane.api.auth import Ctx
from controlplane.api.rpc import Servicer, rpc
from controlplane.election import Elector
from controlplane.graph import load_nodes
from controlplane.nodes import NodeSessions
from controlplane.store import EtcdStore
from kunlun_common.api import cluster_pb2, cluster_pb2_grpc, types_pb2
from kunlun_common.errors import InvalidInput, NotFoundError, PermanentError
from kunlun_common.messages import msg
from kunlun_common.names import parse_device_name
from kunlun_common.tls import Identity


class ClusterService(Servicer, cluster_pb2_grpc.ClusterServiceServicer):
    SERVICE = "kunlun.v1.ClusterService"

    def __init__(
        self,
        store: EtcdStore,
        sessions: NodeSessions,
        elector: Elector,
        replica_name: str,
        drain_replica: Callable[[], Awaitable[cluster_pb2.DrainReplicaResponse]] | None = None,
    ) -> None:
        self.store = store
        self.sessions = sessions
        self.elector = elector
        self.replica_name = replica_name
        self.drain_replica = drain_replica
        """Drains this replica and schedules its exit (Replica.drain); None: draining not offered."""

    @rpc
    async def ListDevices(
        self, request: cluster_pb2.ListDevicesRequest, context: Ctx, who: Identity
    ) -> cluster_pb2.ListDevicesResponse:
        paging.check_page_size(request.page_size)
        if request.page_size:
            page = await graph_pages.device_page(self.store, self.sessions, request, request.node)
            if request.node and not page.nodes_seen and not request.page_token:
                raise NotFoundError(
                    msg("node.not_registered_short", "node {node!r} is not registered", node=request.node)
                )
            return cluster_pb2.ListDevicesResponse(
                devices=page.devices, next_page_token=page.next_page_token, revision=page.revision
            )
        nodes = await load_nodes(self.store, self.sessions)
        devices: list[types_pb2.Device] = []
        for n in nodes:
            if request.node and n.name != request.node:
                continue
            devices.extend(n.devices)
        if request.node and not any(n.name == request.node for n in nodes):
            raise NotFoundError(
                msg("node.not_registered_short", "node {node!r} is not registered", node=request.node)
            )
        return cluster_pb2.ListDevicesResponse(devices=devices)

    @rpc
    async def DescribeDevice(
        self, request: cluster_pb2.DescribeDeviceRequest, context: Ctx, who: Identity
    ) -> cluster_pb2.DescribeDeviceResponse:
        try:
            parse_device_name(request.name)
        except ValueError as e:
            raise InvalidInput(
                msg(
                    "cluster.bad_device_name",
                    "name: invalid device name {name!r}: expected <node>/<type>:<index>, e.g. node-a/ascend:0",
                    name=request.name,
                )
            ) from e
        for n in await load_nodes(self.store, self.sessions):
            for d in n.devices:
                if d.name == request.name:
                    node = types_pb2.Node()
                    node.CopyFrom(n)
                    del node.devices[:]
                    return cluster_pb2.DescribeDeviceResponse(device=d, node=node)
        raise NotFoundError(
            msg(
                "device.not_found",
                "device {name!r} not found; see `kunlun-cli device list`",
                name=request.name,
            )
        )

    @rpc
    async def ListNodes(
        self, request: cluster_pb2.ListNodesRequest, context: Ctx, who: Identity
    ) -> cluster_pb2.ListNodesResponse:
        paging.check_page_size(request.page_size)
        if not request.page_size:
            return cluster_pb2.ListNodesResponse(nodes=await load_nodes(self.store, self.sessions))
        nodes, nxt, revision = await graph_pages.node_page(self.store, self.sessions, request)
        return cluster_pb2.ListNodesResponse(nodes=nodes, next_page_token=nxt, revision=revision)

    @rpc
    async def ClusterStatus(
        self, request: cluster_pb2.ClusterStatusRequest, context: Ctx, who: Identity
    ) -> cluster_pb2.ClusterStatusResponse:
        replicas_kvs, _ = await self.store.get_prefix(keys.REPLICAS)
        leader_kv = await self.store.get(keys.LEADER)
        holder = keys.decode(leader_kv.value) if leader_kv else {}
        replicas = []
        for kv in replicas_kvs:
            info = cluster_pb2.ReplicaInfo()
            keys.decode_message(kv.value, info)
            # the leader key of a process that died keeps its name until its lease expires: match the pid too
            info.leader = info.name == holder.get("name") and info.pid == holder.get("pid", info.pid)
            replicas.append(info)
        leader = next((r.name for r in replicas if r.leader), "")
        members = [
            cluster_pb2.EtcdMemberInfo(
                name=m.name,
                endpoint=m.endpoint,
                healthy=m.healthy,
                leader=m.leader,
                db_size_bytes=m.db_size_bytes,
                error=m.error,
                member_id=m.member_id,
            )
            for m in await self.store.member_statuses()
        ]
        return cluster_pb2.ClusterStatusResponse(
            replicas=replicas,
            etcd_members=members,
            leader=leader,
            leader_epoch=leader_kv.create_revision if leader_kv and leader else 0,
            answered_by=self.replica_name,
        )

    @rpc
    async def WhoAmI(
        self, request: cluster_pb2.WhoAmIRequest, context: Ctx, who: Identity
    ) -> cluster_pb2.WhoAmIResponse:
        return cluster_pb2.WhoAmIResponse(identity=who.name, role=who.role)

    @rpc
    async def DrainReplica(
        self, request: cluster_pb2.DrainReplicaRequest, context: Ctx, who: Identity
    ) -> cluster_pb2.DrainReplicaResponse:
        if not request.name:
            raise InvalidInput(
                msg("replica.drain_no_name", "name: give the replica to drain (`kunlun-cli cluster status`)")
            )
        if request.name != self.replica_name:
            # a replica drains only itself: its process is the one that exits
            raise PermanentError(
                msg(
                    "replica.drain_wrong_replica",
                    "this is replica {me}, not {name}: send the drain to {name}'s own address "
                    "(`kunlun-cli cluster replica drain {name}` looks it up)",
                    me=self.replica_name,
                    name=request.name,
                )
            )
        if self.drain_replica is None:
            raise PermanentError(msg("replica.drain_unavailable", "this replica cannot be drained"))
        return await self.drain_replica()
