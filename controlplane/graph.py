"""Reading the Device Resource Graph: node records + liveness + telemetry, merged for the API.

Device status as shown: a node without a live `alive/<node>` key is NotReady and its devices are
`Unavailable` (except those in `Error`, whose declaration problem stays visible). Telemetry comes
from this replica's in-memory samples when it holds the node's stream, else from the coarse
snapshot in etcd.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

from google.protobuf import json_format

from controlplane import keys, paging
from controlplane.nodes import NodeSessions
from controlplane.store import KV, EtcdStore
from kunlun_common.api import types_pb2
from kunlun_common.messages import Message, msg, to_stored


async def load_nodes(store: EtcdStore, sessions: NodeSessions | None = None) -> list[types_pb2.Node]:
    """Every node with its devices, status merged with liveness and telemetry, sorted by name."""
    (node_kvs, _), (alive_kvs, _), (tele_kvs, _) = await asyncio.gather(
        store.get_prefix(keys.NODES), store.get_prefix(keys.ALIVE), store.get_prefix(keys.TELEMETRY)
    )
    nodes = list(merged(node_kvs, alive_kvs, tele_kvs, sessions))
    nodes.sort(key=lambda n: n.name)
    return nodes


async def load_node_records(
    store: EtcdStore, sessions: NodeSessions | None, node_kvs: list[KV], revision: int
) -> Iterator[types_pb2.Node]:
    """These node records (one page of a listing, in key order) merged with their nodes' liveness
    and telemetry as read at `revision`: one key range each, from the first node to the last.
    Each record is decoded when the iterator reaches it (a page may stop early)."""
    if not node_kvs:
        return iter(())
    first, last = keys.last_segment(node_kvs[0].key), keys.last_segment(node_kvs[-1].key)
    (alive_kvs, _, _), (tele_kvs, _, _) = await asyncio.gather(
        paging.read_range(store, *paging.companion_range(keys.ALIVE, first, last), 0, revision),
        paging.read_range(store, *paging.companion_range(keys.TELEMETRY, first, last), 0, revision),
    )
    return merged(node_kvs, alive_kvs, tele_kvs, sessions)


def node_not_ready(node: str) -> Message:
    """Why the devices of a NotReady node are Unavailable (their `status_reason`, English, and
    `status_reason_message`)."""
    return msg(
        "device.node_not_ready",
        "node {node} is NotReady (its agent stopped sending heartbeats)",
        node=node,
    )


def merged(
    node_kvs: list[KV], alive_kvs: list[KV], tele_kvs: list[KV], sessions: NodeSessions | None
) -> Iterator[types_pb2.Node]:
    """Node records with liveness and telemetry merged in, in the records' order, decoded one by
    one as the caller iterates."""
    alive = {keys.last_segment(kv.key): keys.decode(kv.value) for kv in alive_kvs}
    tele = {keys.last_segment(kv.key): keys.decode(kv.value) for kv in tele_kvs}
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
        not_ready: tuple[str, str] | None = None
        for d in node.devices:
            if session is not None and d.name in session.samples:
                d.telemetry.CopyFrom(session.samples[d.name])
            elif d.name in snapshot:
                json_format.ParseDict(snapshot[d.name], d.telemetry, ignore_unknown_fields=True)
            if not node.ready and d.status != types_pb2.DEVICE_STATUS_ERROR:
                if not_ready is None:  # one message per node
                    m = node_not_ready(node.name)
                    not_ready = (str(m), to_stored(m))
                d.status = types_pb2.DEVICE_STATUS_UNAVAILABLE
                # English as stored, and the message clients show in their reader's language
                d.status_reason, d.status_reason_message = not_ready
        yield node
