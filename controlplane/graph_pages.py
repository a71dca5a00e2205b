"""Pages of the Device Resource Graph for ListNodes and ListDevices (see controlplane/paging.py).

Nodes page by node record. Devices page by device: a page may stop inside a node's devices, and
the token then names the node and how many of its devices were returned (every page reads the
same revision, so a node's device list is the same on every page)."""

from __future__ import annotations

from dataclasses import dataclass, field

from controlplane import keys, paging
from controlplane.graph import load_node_records
from controlplane.nodes import NodeSessions
from controlplane.store import EtcdStore
from controlplane.store.contract import prefix_end
from kunlun_common.api import types_pb2

MAX_ROUNDS = 64
"""Node reads one ListDevices page may make (nodes without devices make a page read further);
past it the page ends early, with a token."""


@dataclass
class DevicePage:
    devices: list[types_pb2.Device] = field(default_factory=list)
    next_page_token: str = ""
    revision: int = 0
    nodes_seen: int = 0
    """Node records read (to tell "no such node" from "no devices")."""


async def node_page(
    store: EtcdStore, sessions: NodeSessions | None, request: paging.PageRequest
) -> tuple[list[types_pb2.Node], str, int]:
    """One page of nodes by name: (nodes, next_page_token, revision)."""
    token = paging.token_of(request)
    kvs, revision, more = await paging.read_records(store, keys.NODES, request.page_size, token)
    nodes = await load_node_records(store, sessions, kvs, revision)
    page, cut = paging.fill(nodes, request.page_size, paging.message_size)
    nxt = paging.PageToken(revision, page[-1].name).encode() if (cut or more) and page else ""
    return page, nxt, revision


async def device_page(
    store: EtcdStore, sessions: NodeSessions | None, request: paging.PageRequest, node: str = ""
) -> DevicePage:
    """One page of devices, node by node in name order and in each node's declaration order
    (only `node`'s when given)."""
    token = paging.token_of(request)
    size = request.page_size
    out = DevicePage(revision=token.revision if token else 0)
    if node:
        start, end = keys.node(node), (keys.node(node) + "\0").encode()
        if token is not None:
            start = paging.page_start(keys.NODES, token)
    else:
        start, end = paging.page_start(keys.NODES, token), prefix_end(keys.NODES)
    skip = token.offset if token else 0
    used = 0
    done = token.after if token else ""  # the last node whose devices are all returned
    batch = min(size, 16)  # nodes read per round: few at first (a node may hold many devices)
    for _round in range(MAX_ROUNDS):
        kvs, out.revision, more = await paging.read_range(store, start, end, batch, out.revision)
        batch = min(size, batch * 2)
        out.nodes_seen += len(kvs)
        for n in await load_node_records(store, sessions, kvs, out.revision):
            for i in range(skip, len(n.devices)):
                d = n.devices[i]
                cost = paging.message_size(d)
                if out.devices and (len(out.devices) >= size or used + cost > paging.MAX_PAGE_BYTES):
                    at = (
                        paging.PageToken(out.revision, n.name, i)
                        if i
                        else paging.PageToken(out.revision, done)
                    )
                    out.next_page_token = at.encode()
                    return out
                out.devices.append(d)
                used += cost
            skip = 0
            done = n.name
        if not more or not kvs:
            return out
        start = kvs[-1].key + "\0"
    # read MAX_ROUNDS rounds of nodes without filling the page: stop here, the caller goes on
    out.next_page_token = paging.PageToken(out.revision, done).encode()
    return out
