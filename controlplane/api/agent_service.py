"""AgentService: the one long-lived stream per node agent.

Agent -> replica: a RegisterNode, then heartbeats (with device samples) and instance reports.
Replica -> agent: the registration ack, heartbeat acks, the node's full assignment set whenever it
changes, and the run-time profiling switch (scheduler settings) whenever it changes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import structlog

from controlplane.api.auth import Ctx, abort
from controlplane.api.rpc import Servicer, rpc_stream
from controlplane.feeds import Feeds
from controlplane.node_session import NodeSession
from controlplane.nodes import NodeSessions, validate_registration
from controlplane.report_owner import owned_report
from kunlun_common.api import agent_pb2, agent_pb2_grpc, types_pb2
from kunlun_common.errors import KunlunError
from kunlun_common.messages import msg, msg_list, of_error
from kunlun_common.tls import Identity
from kunlun_common.wire_limits import TO_AGENT_MAX_BYTES

log = structlog.get_logger("agent-api")


class AgentService(Servicer, agent_pb2_grpc.AgentServiceServicer):
    SERVICE = "kunlun.v1.AgentService"

    def __init__(self, sessions: NodeSessions, feeds: Feeds, replica_name: str, lease_ttl_s: int) -> None:
        self.sessions = sessions
        self.feeds = feeds
        self.replica_name = replica_name
        self.lease_ttl_s = lease_ttl_s

    @rpc_stream
    async def Connect(
        self, request_iterator: AsyncIterator[agent_pb2.AgentMessage], context: Ctx, ident: Identity
    ) -> AsyncIterator[agent_pb2.ReplicaMessage]:
        first = await anext(request_iterator, None)
        if first is None or first.WhichOneof("kind") != "register":
            await abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                msg("registration.first_message", "the first message on the stream must be a RegisterNode"),
            )
        problems = validate_registration(first.register, ident.name)
        if problems:
            log.warning("registration refused", identity=str(ident), problems=[str(p) for p in problems])
            code = (
                grpc.StatusCode.PERMISSION_DENIED
                if first.register.node != ident.name
                else grpc.StatusCode.INVALID_ARGUMENT
            )
            await abort(
                context, code, msg_list("registration.refused", "{parts}", problems, bullet="", sep="; ")
            )
        try:
            async with self.sessions.admission:
                fencing = await self.sessions.fencing_problem(first.register)
                if not fencing:
                    session = await self.sessions.register(first.register, str(ident))
            if fencing:
                log.warning("registration refused", identity=str(ident), problem=str(fencing))
                await abort(context, grpc.StatusCode.FAILED_PRECONDITION, fencing)
        except KunlunError as e:
            await abort(
                context,
                grpc.StatusCode.UNAVAILABLE,
                msg_list(
                    "registration.not_stored",
                    "registration could not be stored: {parts}",
                    [of_error(e)],
                    bullet="",
                ),
            )
        yield agent_pb2.ReplicaMessage(
            register_ack=agent_pb2.RegisterAck(replica=self.replica_name, lease_ttl_seconds=self.lease_ttl_s)
        )
        out: asyncio.Queue[agent_pb2.ReplicaMessage | None] = asyncio.Queue()
        reader = asyncio.create_task(
            self._read(request_iterator, session, out), name=f"agent-reader-{session.node}"
        )
        pusher = asyncio.create_task(
            self._push_assignments(session, out, first.register.shared_specs),
            name=f"assignments-{session.node}",
        )
        profiling = asyncio.create_task(self._push_profiling(out), name=f"profiling-{session.node}")
        try:
            while True:
                reply = await out.get()
                if reply is None:
                    break
                yield reply
        finally:
            for t in (reader, pusher, profiling):
                t.cancel()
            for t in (reader, pusher, profiling):
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
            await self.sessions.disconnect(session)

    async def _read(
        self,
        request_iterator: AsyncIterator[agent_pb2.AgentMessage],
        session: NodeSession,
        out: asyncio.Queue[agent_pb2.ReplicaMessage | None],
    ) -> None:
        try:
            async for incoming in request_iterator:
                kind = incoming.WhichOneof("kind")
                if kind == "heartbeat":
                    if await self.sessions.heartbeat(session, incoming.heartbeat):
                        out.put_nowait(
                            agent_pb2.ReplicaMessage(
                                heartbeat_ack=agent_pb2.HeartbeatAck(
                                    seq=incoming.heartbeat.seq, replica=self.replica_name
                                )
                            )
                        )
                elif kind == "report":
                    await self.sessions.report(
                        session, owned_report(self.feeds, session.node, incoming.report)
                    )
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            pass
        finally:
            out.put_nowait(None)

    async def _push_assignments(
        self,
        session: NodeSession,
        out: asyncio.Queue[agent_pb2.ReplicaMessage | None],
        shared_specs: bool = False,
    ) -> None:
        """Send the node's assignment set at start and whenever it changed.

        Woken only by changes that can affect this node (its topic in the feeds' index): a
        telemetry write or another node's placement costs this stream nothing. `shared_specs`: the
        agent registered saying it understands sets that carry each distinct spec once. A set over
        the agent channel's limit is not sent (a partial set would stop the instances left out):
        the agent keeps the last one it applied, and the replica says why."""
        index = self.feeds.index
        topic = index.subscribe(session.node)
        work = self.feeds.cache.work
        last: list[agent_pb2.Assignment] | None = None
        try:
            await self.feeds.cache.ready.wait()
            while True:
                seen = topic.version
                current = self.feeds.assignments_for(session.node, shared_specs)
                if last is None or list(current.items) != last:
                    last = list(current.items)
                    reply = agent_pb2.ReplicaMessage(assignments=current)
                    size = reply.ByteSize()
                    if size > TO_AGENT_MAX_BYTES:
                        log.error(
                            "assignment set too large for the agent channel; not sent",
                            node=session.node,
                            bytes=size,
                            limit=TO_AGENT_MAX_BYTES,
                            instances=len(current.items),
                            shared_specs=shared_specs,
                        )
                    else:
                        work.sends += 1
                        out.put_nowait(reply)
                await topic.wait(seen)
        finally:
            index.unsubscribe(session.node)

    async def _push_profiling(self, out: asyncio.Queue[agent_pb2.ReplicaMessage | None]) -> None:
        """Send the profiling switch after registration and whenever the scheduler settings change it."""
        feed = self.feeds.profiling
        last: types_pb2.ProfilingSettings | None = None
        await self.feeds.cache.ready.wait()
        while True:
            seen = feed.topic.version
            current = feed.current()
            if current != last:
                last = current
                out.put_nowait(agent_pb2.ReplicaMessage(profiling=current))
            await feed.topic.wait(seen)
