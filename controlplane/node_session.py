"""What one replica knows about one connected agent (its node session)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from kunlun_common.api import agent_pb2, types_pb2


@dataclass
class NodeSession:
    """What this replica knows about one connected agent."""

    node: str
    record: types_pb2.Node
    lease: int
    """The liveness lease this replica last wrote the node's alive key with (0: no key of ours, or
    one being deleted as stale: no ack until the next heartbeat writes a new one)."""
    connected_at: float
    alive_value: bytes = b""
    """The exact value of that write: a stale key is deleted only if it still holds it."""
    alive_rev: int = 0
    """The etcd revision of that write: a watch event no newer than it says nothing about it."""
    foreign_logged: bool = False
    """Said once that another writer holds the node's alive key (a stale stream)."""
    last_heartbeat: float = 0.0
    marking: asyncio.Task[None] | None = None
    """The write that marks the node alive again under the current lease, while in flight."""
    samples: dict[str, types_pb2.DeviceTelemetry] = field(default_factory=dict)
    snapshot_written: dict[str, types_pb2.DeviceTelemetry] = field(default_factory=dict)
    snapshot_at: float = 0.0
    heartbeats: int = 0
    statuses: dict[str, agent_pb2.InstanceStatus] = field(default_factory=dict)
    record_dirty: bool = False
    snapshot_due: bool = False
    writer: asyncio.Task[None] | None = None
    by_name: dict[str, types_pb2.Device] = field(default_factory=dict)
    """The record's devices by name (built on the first heartbeat; the record's device list is fixed
    for the session, only their status fields change)."""
