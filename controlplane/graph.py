"""Reading the Device Resource Graph: node records + liveness + telemetry, merged for the API.

Device status as shown: a node without a live `alive/<node>` key is NotReady and its devices are
`Unavailable` (except those in `Error`, whose declaration problem stays visible). Telemetry comes
from this replica's in-memory samples when it holds the node's stream, else from the coarse
snapshot in etcd.
"""

from __future__ import annotations

import asyncio

from google.protobuf import json_format

from controlplane import keys
from controlplane.nodes import NodeSessions
from controlplane.store import EtcdStore
from kunlun_common.api import types_pb2


async def load_nodes(store: EtcdStore, sessions: NodeSessions | None = None) -> list[types_pb2.Node]:
    """Every node with its devices, status merged with liveness and telemetry, sorted by name."""
    (node_kvs, _), (alive_kvs, _), (tele_kvs, _) = await asyncio.gather(
        store.get_prefix(keys.NODES), store.get_prefix(keys.ALIVE), store.get_prefix(keys.TELEMETRY)
    )
    alive = {keys.last_segment(kv.key): keys.decode(kv.value) for kv in alive_kvs}
    tele = {keys.last_segment(kv.key): keys.decode(kv.value) for kv in tele_kvs}
    nodes: list[types_pb2.Node] = []
    for kv in node_kvs:
        node = types_pb2.Node()
        keys.decode_message(kv.value, node)
        info = alive.get(node.name)
        node.ready = info is not None
        node.connected_replica = str(info.get("replica", "")) if info else ""
        session = sessions.sessions.get(node.name) if sessions else None
        if session is not None:
            node.last_heartbeat_unix_ms = int(session.record.last_heartbeat_unix_ms)
        snapshot = tele.get(node.name, {}).get("devices", {})
        for d in node.devices:
            if session is not None and d.name in session.samples:
                d.telemetry.CopyFrom(session.samples[d.name])
            elif d.name in snapshot:
                json_format.ParseDict(snapshot[d.name], d.telemetry, ignore_unknown_fields=True)
            if not node.ready and d.status != types_pb2.DEVICE_STATUS_ERROR:
                d.status = types_pb2.DEVICE_STATUS_UNAVAILABLE
                d.status_reason = f"node {node.name} is NotReady (its agent stopped sending heartbeats)"
        nodes.append(node)
    nodes.sort(key=lambda n: n.name)
    return nodes
