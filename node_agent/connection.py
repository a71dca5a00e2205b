"""The agent's link to the control plane: one stream to one replica at a time, with failover.

The agent registers, then sends a heartbeat (with device samples) every interval, and its whole
instance report at once after registering and again whenever it changed. The replica pushes the
node's full assignment set (on registration and on every change), handed to `on_assignments`.
A replica that
does not answer the registration within `connect_timeout_s`, or stops acknowledging heartbeats for
`ack_timeout_s` (dead, SIGSTOPped, cut off, or itself cut off from etcd), is left for the next one
in the list. The agent never talks to etcd.

Before each stream the agent checks the certificate the replica presents against the revocation
list it holds (`server_check.py`: grpc-python does not show a client the server's certificate),
and leaves a replica whose certificate is revoked while the stream is open.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import structlog

from kunlun_common import tls
from kunlun_common.api import agent_pb2, agent_pb2_grpc, types_pb2
from kunlun_common.clock import now_ms
from kunlun_common.retry import backoff_delay
from kunlun_common.revocation import RevokedSerials
from kunlun_common.server_check import checked_server
from kunlun_common.wire_limits import agent_channel_options
from node_agent.assignment_check import safe_assignments

log = structlog.get_logger("link")
_EOF = grpc.aio.EOF  # type: ignore[attr-defined]


class LinkError(Exception):
    """This replica cannot serve us now; try the next one."""


class ReplicaLink:
    def __init__(
        self,
        endpoints: Sequence[str],
        material: tls.TlsMaterial,
        register: Callable[[], agent_pb2.RegisterNode],
        samples: Callable[[], list[agent_pb2.DeviceSample]],
        heartbeat_interval_s: float = 1.0,
        ack_timeout_s: float = 3.0,
        connect_timeout_s: float = 5.0,
        on_assignments: Callable[[agent_pb2.Assignments], object] | None = None,
        reports: Callable[[], agent_pb2.InstanceReport] | None = None,
        report_changed: asyncio.Event | None = None,
        on_profiling: Callable[[types_pb2.ProfilingSettings], object] | None = None,
        revoked: RevokedSerials | None = None,
    ) -> None:
        self.endpoints = list(endpoints)
        self.material = material
        self.creds = tls.channel_credentials(material)
        self.revoked = revoked
        self.server_serial = ""
        """The serial of the certificate the current replica presented (when checked)."""
        self.register = register
        self.samples = samples
        self.heartbeat_interval_s = heartbeat_interval_s
        self.ack_timeout_s = ack_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.on_assignments = on_assignments
        self.reports = reports
        self.report_changed = report_changed
        self.on_profiling = on_profiling
        self.connected_to = ""
        self.registered = asyncio.Event()
        self.last_ack = 0.0
        self.last_contact = time.monotonic()
        self._seq = 0

    async def run(self) -> None:
        """Stay connected to some replica, forever."""
        i = 0
        failures = 0
        while True:
            ep = self.endpoints[i % len(self.endpoints)]
            try:
                await self._session(ep)
            except asyncio.CancelledError:
                raise
            except (LinkError, grpc.aio.AioRpcError, TimeoutError, OSError) as e:
                reason = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)
                log.warning(
                    "replica link lost; trying the next replica",
                    replica=ep,
                    reason=reason or type(e).__name__,
                )
            except Exception as e:  # a bug must not end the link: the node would stay NotReady
                log.exception(
                    "replica link failed unexpectedly; trying the next replica", replica=ep, error=repr(e)
                )
            self.connected_to = ""
            self.registered.clear()
            i += 1
            failures += 1
            if failures % len(self.endpoints) == 0:
                await asyncio.sleep(backoff_delay(failures // len(self.endpoints), 0.2, 3.0))

    def reload(self, material: tls.TlsMaterial) -> None:
        """New client certificate (SIGHUP): used from the next connection on."""
        self.material = material
        self.creds = tls.channel_credentials(material)

    async def _session(self, ep: str) -> None:
        self.server_serial = ""
        if self.revoked is not None:
            self.server_serial = await checked_server(
                ep, self.material, self.revoked.serials, connect_timeout_s=self.connect_timeout_s
            )
        channel = grpc.aio.secure_channel(
            ep,
            self.creds,
            options=[
                # no name override: the replica's certificate must carry the endpoint's host, and
                # only the replica CA is trusted (tls.channel_credentials)
                ("grpc.keepalive_time_ms", 10000),
                ("grpc.keepalive_timeout_ms", 3000),
                *agent_channel_options(),  # the mirror of the replica server's limits
            ],
        )
        call = agent_pb2_grpc.AgentServiceStub(channel).Connect()  # type: ignore[call-arg]
        reader: asyncio.Task[None] | None = None
        try:
            reg = self.register()
            await asyncio.wait_for(call.write(agent_pb2.AgentMessage(register=reg)), self.connect_timeout_s)
            first = await asyncio.wait_for(call.read(), self.connect_timeout_s)
            if (
                first is _EOF
                or not isinstance(first, agent_pb2.ReplicaMessage)
                or first.WhichOneof("kind") != "register_ack"
            ):
                raise LinkError(f"{ep} closed the stream before acknowledging the registration")
            self.connected_to = ep
            self.last_ack = self.last_contact = time.monotonic()
            self.registered.set()
            log.info(
                "registered with replica",
                replica=ep,
                replica_name=first.register_ack.replica,
                devices=len(reg.devices),
            )
            reader = asyncio.create_task(self._read(call, ep))
            await self._send_report(call)  # the first after every (re)connect: the whole picture
            next_hb = time.monotonic()
            while True:
                if time.monotonic() >= next_hb:
                    self._seq += 1
                    hb = agent_pb2.Heartbeat(seq=self._seq, sent_at_unix_ms=now_ms(), samples=self.samples())
                    await asyncio.wait_for(
                        call.write(agent_pb2.AgentMessage(heartbeat=hb)), self.ack_timeout_s
                    )
                    next_hb = time.monotonic() + self.heartbeat_interval_s
                if self.report_changed is not None and self.report_changed.is_set():
                    await self._send_report(call)
                await self._wait(reader, max(0.0, next_hb - time.monotonic()))
                if reader.done():
                    reader.result()
                    raise LinkError(f"{ep} closed the stream")
                if self.revoked is not None and self.server_serial in self.revoked.serials:
                    raise LinkError(f"{ep}'s certificate {self.server_serial} was revoked")
                silent = time.monotonic() - self.last_ack
                if silent > self.ack_timeout_s:
                    raise LinkError(
                        f"{ep} acknowledged no heartbeat for {silent:.1f}s (limit {self.ack_timeout_s}s)"
                    )
        finally:
            if reader is not None:
                reader.cancel()
            call.cancel()
            await channel.close(None)

    async def _wait(self, reader: asyncio.Task[None], seconds: float) -> None:
        """Until the reader ends, the report changes, or `seconds` pass."""
        waits: set[asyncio.Future[Any]] = {reader}
        changed: asyncio.Task[bool] | None = None
        if self.report_changed is not None:
            changed = asyncio.create_task(self.report_changed.wait())
            waits.add(changed)
        try:
            await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if changed is not None:
                changed.cancel()

    async def _send_report(
        self, call: grpc.aio.StreamStreamCall[agent_pb2.AgentMessage, agent_pb2.ReplicaMessage]
    ) -> None:
        if self.reports is None:
            return
        if self.report_changed is not None:
            self.report_changed.clear()
        report = self.reports()
        await asyncio.wait_for(call.write(agent_pb2.AgentMessage(report=report)), self.ack_timeout_s)

    async def _read(
        self, call: grpc.aio.StreamStreamCall[agent_pb2.AgentMessage, agent_pb2.ReplicaMessage], ep: str
    ) -> None:
        while True:
            msg = await call.read()
            if msg is _EOF or not isinstance(msg, agent_pb2.ReplicaMessage):
                return
            kind = msg.WhichOneof("kind")
            if kind == "heartbeat_ack":
                self.last_ack = self.last_contact = time.monotonic()
            elif kind == "assignments":
                self.last_contact = time.monotonic()
                log.info(
                    "assignments received",
                    replica=ep,
                    instances=len(msg.assignments.items),
                    revision=msg.assignments.revision,
                )
                if self.on_assignments is not None:
                    try:
                        self.on_assignments(safe_assignments(msg.assignments))
                    except Exception:  # the stream must survive a bad handler
                        log.exception("handling assignments failed")
            elif kind == "profiling":
                if self.on_profiling is not None:
                    try:
                        self.on_profiling(msg.profiling)
                    except Exception:
                        log.exception("switching profiling failed")


def registration(
    node: str,
    address: str,
    simulated: bool,
    devices: list[types_pb2.Device],
    version: str,
    config_path: str,
    node_service: str = "",
    metrics_address: str = "",
) -> agent_pb2.RegisterNode:
    return agent_pb2.RegisterNode(
        node=node,
        address=address,
        simulated=simulated,
        devices=devices,
        agent_version=version,
        agent_pid=os.getpid(),
        config_path=config_path,
        node_service=node_service,
        metrics_address=metrics_address,
        shared_specs=True,
    )
