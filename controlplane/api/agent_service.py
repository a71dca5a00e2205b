"""AgentService: the one long-lived stream per node agent (register, then heartbeats and acks)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import structlog

from controlplane.api.auth import Ctx, abort, authorize
from controlplane.nodes import NodeSessions, validate_registration
from kunlun_common.api import agent_pb2, agent_pb2_grpc
from kunlun_common.errors import KunlunError

log = structlog.get_logger("agent-api")


class AgentService(agent_pb2_grpc.AgentServiceServicer):
    def __init__(self, sessions: NodeSessions, replica_name: str, lease_ttl_s: int) -> None:
        self.sessions = sessions
        self.replica_name = replica_name
        self.lease_ttl_s = lease_ttl_s

    async def Connect(
        self, request_iterator: AsyncIterator[agent_pb2.AgentMessage], context: Ctx
    ) -> AsyncIterator[agent_pb2.ReplicaMessage]:
        ident = await authorize(context, "/kunlun.v1.AgentService/Connect")
        first = await anext(request_iterator, None)
        if first is None or first.WhichOneof("kind") != "register":
            await abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                "the first message on the stream must be a RegisterNode",
            )
        problems = validate_registration(first.register, ident.name)
        if problems:
            log.warning("registration refused", identity=str(ident), problems=problems)
            code = (
                grpc.StatusCode.PERMISSION_DENIED
                if first.register.node != ident.name
                else grpc.StatusCode.INVALID_ARGUMENT
            )
            await abort(context, code, "; ".join(problems))
        try:
            session = await self.sessions.register(first.register, str(ident))
        except KunlunError as e:
            await abort(context, grpc.StatusCode.UNAVAILABLE, f"registration could not be stored: {e}")
        yield agent_pb2.ReplicaMessage(
            register_ack=agent_pb2.RegisterAck(replica=self.replica_name, lease_ttl_seconds=self.lease_ttl_s)
        )
        try:
            async for msg in request_iterator:
                if msg.WhichOneof("kind") != "heartbeat":
                    continue
                if await self.sessions.heartbeat(session, msg.heartbeat):
                    yield agent_pb2.ReplicaMessage(
                        heartbeat_ack=agent_pb2.HeartbeatAck(seq=msg.heartbeat.seq, replica=self.replica_name)
                    )
        finally:
            await self.sessions.disconnect(session)
