"""The timing rule that keeps an instance from running on two nodes at once.

An agent's engines fence themselves: each stops by itself `disconnect_deadline_s` after the agent's
last acknowledged heartbeat and is gone `stop_grace_s` later. The leader moves an instance off a node
only after the node's lease (`node_lease_ttl_s`) expired and then `node_not_ready_grace_seconds`
passed. So the old engine is gone before a new one can start elsewhere when

    disconnect_deadline_s + stop_grace_s < node lease TTL + node_not_ready_grace_seconds

This is checked where any of the four numbers enters: an agent's registration, `scheduler config
set`, and a replica's start-up (against the nodes already registered).
"""

from __future__ import annotations

from collections.abc import Iterable

from controlplane import keys
from controlplane.scheduler.config import SchedulerConfig, parse_scheduler_config
from controlplane.store import EtcdStore
from kunlun_common.api import types_pb2
from kunlun_common.errors import ConfigError
from kunlun_common.messages import Message, msg


def fencing_problem(
    node: str, deadline_s: float, stop_grace_s: float, lease_ttl_s: float, grace_s: float
) -> Message | None:
    """The broken inequality in words with every number, or None when it holds (or the agent did
    not say: an agent that does not fence itself is not checked)."""
    if deadline_s <= 0:
        return None
    fenced_by = deadline_s + stop_grace_s
    moved_after = lease_ttl_s + grace_s
    if fenced_by < moved_after:
        return None
    return msg(
        "fencing.too_slow",
        "node {node}: disconnect deadline {deadline_s:g}s + stop grace {stop_grace_s:g}s = {fenced_by:g}s "
        "is not below node lease {lease_ttl_s:g}s + node_not_ready_grace_seconds {grace_s:g}s = "
        "{moved_after:g}s, so a cut-off node's engine could still run when its instance starts elsewhere; "
        "lower the agent's --disconnect-stop/--stop-grace or raise node_not_ready_grace_seconds",
        node=node,
        deadline_s=deadline_s,
        stop_grace_s=stop_grace_s,
        fenced_by=fenced_by,
        lease_ttl_s=lease_ttl_s,
        grace_s=grace_s,
        moved_after=moved_after,
    )


async def stored_config(store: EtcdStore) -> SchedulerConfig:
    """The scheduler config in etcd (defaults when none is stored or it is unreadable)."""
    kv = await store.get(keys.SCHEDULER_CONFIG)
    if kv is None:
        return SchedulerConfig()
    try:
        return parse_scheduler_config(str(keys.decode(kv.value)["yaml"]))
    except (ConfigError, KeyError, ValueError):
        return SchedulerConfig()


def node_problems(nodes: Iterable[types_pb2.Node], grace_s: float, lease_ttl_s: float = 0) -> list[Message]:
    """Registered nodes whose fencing breaks the rule with `grace_s` (and each node's recorded lease
    TTL, or `lease_ttl_s` when given)."""
    out = []
    for n in nodes:
        ttl = lease_ttl_s or float(n.lease_ttl_s)
        problem = fencing_problem(n.name, n.disconnect_deadline_s, n.stop_grace_s, ttl, grace_s)
        if problem:
            out.append(problem)
    return out


async def registered_nodes(store: EtcdStore) -> list[types_pb2.Node]:
    kvs, _ = await store.get_prefix(keys.NODES)
    out = []
    for kv in kvs:
        n = types_pb2.Node()
        keys.decode_message(kv.value, n)
        out.append(n)
    return out
