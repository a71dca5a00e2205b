"""Node sessions on one replica: registration, heartbeats and telemetry of connected agents.

Agents never talk to etcd. The replica holding an agent's stream writes on its behalf (observed
state): the node record on registration, device status changes, a coarse telemetry snapshot every
`telemetry_snapshot_s` (or on a large change), and the `alive/<node>` key (its lease, sweeps and
ownership: `controlplane/liveness.py`).
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import TYPE_CHECKING

import structlog

from controlplane import keys
from controlplane.liveness import Liveness
from controlplane.node_session import NodeSession
from controlplane.put_batch import PutBatcher
from controlplane.settings import ReplicaSettings
from controlplane.store import EtcdStore, PutOp
from kunlun_common.api import agent_pb2, types_pb2
from kunlun_common.clock import now_ms
from kunlun_common.errors import KunlunError, TemporaryError
from kunlun_common.messages import Message, msg
from kunlun_common.names import DEVICE_TYPES, device_name, valid_node_name

if TYPE_CHECKING:
    pass

log = structlog.get_logger("nodes")

# a change this large is written to etcd at once instead of waiting for the next snapshot
_BIG_UTIL_CHANGE = 25.0
_BIG_TEMP_CHANGE = 10.0


def validate_registration(reg: agent_pb2.RegisterNode, cert_node: str) -> list[Message]:
    """Every problem with a registration; empty when it may be accepted."""
    problems: list[Message] = []
    if reg.node != cert_node:
        problems.append(
            msg(
                "registration.node_mismatch",
                "node: the agent certificate is for node {cert_node!r} but the registration names {node!r}; "
                "the certificate decides which node an agent may speak for",
                cert_node=cert_node,
                node=reg.node,
            )
        )
    if not valid_node_name(reg.node):
        problems.append(
            msg(
                "registration.node_name",
                "node: {node!r} is not a valid node name (lowercase letters, digits, '-')",
                node=reg.node,
            )
        )
    seen: set[str] = set()
    for i, d in enumerate(reg.devices):
        where = f"devices[{i}]"
        if d.device_type not in DEVICE_TYPES and d.status != types_pb2.DEVICE_STATUS_ERROR:
            problems.append(
                msg(
                    "registration.device_type",
                    "{where}.device_type: expected one of {types}, found {found!r}",
                    where=where,
                    types=", ".join(DEVICE_TYPES),
                    found=d.device_type,
                )
            )
        expect = device_name(reg.node, d.device_type, d.index)
        if d.name != expect:
            problems.append(
                msg(
                    "registration.device_name",
                    "{where}.name: expected {expect!r}, found {found!r}",
                    where=where,
                    expect=expect,
                    found=d.name,
                )
            )
        if d.name in seen:
            problems.append(
                msg(
                    "registration.device_twice",
                    "{where}.name: duplicate device {name!r}",
                    where=where,
                    name=d.name,
                )
            )
        seen.add(d.name)
        if d.node != reg.node:
            problems.append(
                msg(
                    "registration.device_node",
                    "{where}.node: expected {node!r}, found {found!r}",
                    where=where,
                    node=reg.node,
                    found=d.node,
                )
            )
    if len(reg.devices) > 1024:
        problems.append(
            msg(
                "registration.too_many_devices",
                "devices: at most 1024 devices per node, found {count}",
                count=len(reg.devices),
            )
        )
    return problems


class NodeSessions(Liveness):
    """Registrations, heartbeats and lease refreshes for the agents connected to this replica."""

    def __init__(self, store: EtcdStore, settings: ReplicaSettings) -> None:
        super().__init__(store, settings)
        self._lock = asyncio.Lock()
        self.snapshots = PutBatcher(store)
        """Telemetry snapshots of all nodes, written a batch per transaction."""
        self.admission = asyncio.Semaphore(32)
        """Registrations in progress at once (a storm of thousands queues here instead of timing out
        in etcd; the agent waits for its ack, `--connect-timeout`, and retries with backoff)."""

    async def fencing_problem(self, reg: agent_pb2.RegisterNode) -> Message | None:
        """Why the agent's self-fencing is too slow for this cluster's node lease and grace, or None."""
        from controlplane.fencing import fencing_problem, stored_config

        grace = (await stored_config(self.store)).node_not_ready_grace_seconds
        return fencing_problem(
            reg.node, reg.disconnect_deadline_s, reg.stop_grace_s, self.settings.node_lease_ttl_s, grace
        )

    async def register(self, reg: agent_pb2.RegisterNode, identity: str) -> NodeSession:
        """Accept a node: write its record and its alive key (bound to this replica's liveness lease)."""
        node = reg.node
        self._registering.add(node)  # the orphan scan leaves its key alone meanwhile
        try:
            return await self._register(reg, identity, node)
        finally:
            self._registering.discard(node)

    async def _register(self, reg: agent_pb2.RegisterNode, identity: str, node: str) -> NodeSession:
        lease = await self.current_lease()
        record = types_pb2.Node(
            name=node,
            address=reg.address,
            simulated=reg.simulated,
            devices=list(reg.devices),
            ready=True,
            agent_version=reg.agent_version,
            agent_pid=reg.agent_pid,
            registered_at_unix_ms=now_ms(),
            last_heartbeat_unix_ms=now_ms(),
            connected_replica=self.settings.name,
            config_path=reg.config_path,
            updated_by=identity,
            node_service=reg.node_service,
            disconnect_deadline_s=reg.disconnect_deadline_s,
            stop_grace_s=reg.stop_grace_s,
            lease_ttl_s=self.settings.node_lease_ttl_s,
            metrics_address=reg.metrics_address,
        )
        for d in record.devices:
            d.ClearField("telemetry")
        old = await self.store.get(keys.node(node))
        if old is not None:
            prev = types_pb2.Node()
            keys.decode_message(old.value, prev)
            record.cordoned = prev.cordoned
            record.protections.extend(prev.protections)
        alive_value = self._alive_value(lease)
        res = await self.store.txn(
            [],
            [
                PutOp(keys.node(node), keys.encode_message(record)),
                PutOp(keys.alive(node), alive_value, lease),
            ],
        )
        if not res.succeeded:
            raise TemporaryError(
                msg("registration.not_applied", "registration of {node} was not applied", node=node)
            )
        session = NodeSession(
            node=node,
            record=record,
            lease=lease if self._claimable(node, alive_value, res.revision) else 0,
            connected_at=time.monotonic(),
            alive_value=alive_value,
            alive_rev=res.revision,
        )
        session.last_heartbeat = time.monotonic()
        # the first snapshot 0-2 s after registration, at a random point: a registration storm does
        # not turn into a snapshot storm at the same instant
        session.snapshot_at = (
            session.last_heartbeat
            - self.settings.telemetry_snapshot_s
            + random.uniform(0, min(2.0, self.settings.telemetry_snapshot_s))
        )
        async with self._lock:
            self.sessions[node] = session
            self.departed.pop(node, None)  # its key is ours again, under this session
        log.info("node registered", node=node, devices=len(reg.devices), lease=f"{lease:x}", by=identity)
        return session

    async def heartbeat(self, session: NodeSession, hb: agent_pb2.Heartbeat) -> bool:
        """Record a heartbeat; write status changes and coarse snapshots. True if it may be acked."""
        t = time.monotonic()
        session.last_heartbeat = t
        session.heartbeats += 1
        changed = False
        big = False
        by_name = session.by_name
        if not by_name and session.record.devices:
            by_name = session.by_name = {d.name: d for d in session.record.devices}
        for s in hb.samples:
            dev = by_name.get(s.name)
            if dev is None:
                continue
            session.samples[s.name] = s.telemetry
            if s.status and (
                dev.status != s.status
                or dev.status_reason != s.status_reason
                or dev.status_reason_message != s.status_reason_message
            ):
                log.info(
                    "device status changed",
                    device=s.name,
                    old=types_pb2.DeviceStatus.Name(dev.status),
                    new=types_pb2.DeviceStatus.Name(s.status),
                    reason=s.status_reason,
                )
                dev.status = s.status
                dev.status_reason = s.status_reason
                dev.status_reason_message = s.status_reason_message  # the agent's message, kept as sent
                changed = True
            prev = session.snapshot_written.get(s.name)
            if prev is not None and (
                abs(prev.utilization_pct - s.telemetry.utilization_pct) >= _BIG_UTIL_CHANGE
                or abs(prev.temperature_c - s.telemetry.temperature_c) >= _BIG_TEMP_CHANGE
            ):
                big = True
        if changed:
            session.record_dirty = True
        if big or t - session.snapshot_at >= self.settings.telemetry_snapshot_s:
            session.snapshot_due = True
            session.snapshot_at = t
        if (session.record_dirty or session.snapshot_due) and (
            session.writer is None or session.writer.done()
        ):
            # the ack never waits for etcd: the write runs beside the stream (one at a time per node)
            session.writer = asyncio.create_task(
                self._write_state(session), name=f"node-state-{session.node}"
            )
        if session.lease != self.lease:
            # its alive key went with a lost lease, or was deleted as stale: mark it alive again
            if self.lease and (session.marking is None or session.marking.done()):
                session.marking = asyncio.create_task(self._mark_alive(session), name=f"alive-{session.node}")
            return False
        return t - self.lease_ok_at <= self.settings.heartbeat_ack_requires_etcd_s

    async def _write_state(self, session: NodeSession) -> None:
        """Write what heartbeats changed (the node record, a telemetry snapshot) until nothing is left."""
        while session.record_dirty or session.snapshot_due:
            what = ""
            try:
                if session.record_dirty:
                    what, session.record_dirty = "record", False
                    session.record.last_heartbeat_unix_ms = now_ms()
                    await self.store.put(keys.node(session.node), keys.encode_message(session.record))
                if session.snapshot_due:
                    what, session.snapshot_due = "snapshot", False
                    await self._write_snapshot(session)
            except KunlunError as e:
                log.warning("could not write node state", node=session.node, error=str(e))
                if what == "record":
                    session.record_dirty = True  # the next heartbeat tries again
                return

    async def flush(self, session: NodeSession) -> None:
        """Wait for the node's state writes in flight (tests, and a clean disconnect)."""
        while session.writer is not None and not session.writer.done():
            await asyncio.wait({session.writer})

    async def report(self, session: NodeSession, report: agent_pb2.InstanceReport) -> None:
        """Observed instance state from the agent: write what changed (status changes, not samples)."""
        from controlplane.feeds import encode_status

        for st in report.instances:
            prev = session.statuses.get(st.instance_id)
            if prev is not None and prev == st:
                continue
            try:
                await self.store.put(keys.instance_status(st.instance_id), encode_status(session.node, st))
                session.statuses[st.instance_id] = st
            except KunlunError as e:
                log.warning("could not record instance status", instance=st.instance_id, error=str(e))
        gone = set(session.statuses) - {st.instance_id for st in report.instances}
        for iid in gone:
            session.statuses.pop(iid, None)
        protections = list(report.protections)
        if protections != list(session.record.protections) or report.note != session.record.note:
            del session.record.protections[:]
            session.record.protections.extend(protections)
            session.record.note = report.note
            try:
                await self.store.put(keys.node(session.node), keys.encode_message(session.record))
            except KunlunError as e:
                log.warning("could not record node protections", node=session.node, error=str(e))

    async def _write_snapshot(self, session: NodeSession) -> None:
        # the set fields as they are (readers parse with ParseDict, which takes numbers for int64):
        # json_format.MessageToDict took twice as long, on every snapshot of every node
        devices = {name: {f.name: v for f, v in tele.ListFields()} for name, tele in session.samples.items()}
        await self.snapshots.put(
            keys.telemetry(session.node), keys.encode({"at_ms": now_ms(), "devices": devices})
        )
        session.snapshot_written = {k: v for k, v in session.samples.items()}
        session.snapshot_at = time.monotonic()

    async def disconnect(self, session: NodeSession) -> None:
        """The agent's stream ended: stop refreshing its lease (it expires unless the agent moves)."""
        async with self._lock:
            if self.sessions.get(session.node) is session:
                del self.sessions[session.node]
                if session.lease:
                    self.departed[session.node] = session  # its alive key is deleted once stale
        if session.marking is not None and not session.marking.done():
            session.marking.cancel()
        if session.writer is not None and not session.writer.done():
            session.writer.cancel()
            await asyncio.wait({session.writer})
        log.info("node disconnected", node=session.node, heartbeats=session.heartbeats)
