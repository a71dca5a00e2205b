"""What every replica serves from its own watch-fed copy of the graph: the assignments of each
connected node, the routable endpoints for gateways, and observed instance status.

Agents get the full set of instances their node must run whenever it changes (idempotent: the
agent reconciles against the whole set); gateways get the full endpoint set likewise.

The cost of a change is proportional to what changed: `AssignmentIndex` decodes only the changed
record and wakes only the streams of the nodes it affects; an assignment set is computed from the
node's own index entry, never by scanning the graph. Telemetry, liveness and node records reach
none of it (see `controlplane.cache`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from google.protobuf import json_format

from controlplane import keys
from controlplane.cache import GraphCache, Topic
from controlplane.profiling_feed import ProfilingFeed
from controlplane.rollout import CANARY, canary_spec
from controlplane.store import KV, EtcdStore
from kunlun_common.api import agent_pb2, rollout_pb2, workload_pb2
from kunlun_common.states import PLACED, InstancePhase

NODE_PENDING_REASONS = ("waiting for device", "pulling package", "verifying package")
"""What a node says while it prepares an instance that the instance shows (else: Scheduled's reason)."""


def decode_status(raw: bytes) -> tuple[str, agent_pb2.InstanceStatus]:
    """(node, status) from an instance-status record."""
    data = keys.decode(raw)
    st = agent_pb2.InstanceStatus()
    json_format.ParseDict(data.get("status", {}), st, ignore_unknown_fields=True)
    return str(data.get("node", "")), st


def encode_status(node: str, st: agent_pb2.InstanceStatus) -> bytes:
    return keys.encode(
        {"node": node, "status": json_format.MessageToDict(st, preserving_proto_field_name=True)}
    )


def _node_reason(inst: workload_pb2.Instance, st: agent_pb2.InstanceStatus) -> None:
    """A reason the node reports replaces the scheduler's, and its message with it (the node's own
    message when it sent one, which clients translate; else its text, shown as is)."""
    if st.reason and (st.reason != inst.reason or st.reason_message != inst.reason_message):
        inst.reason, inst.reason_message = st.reason, st.reason_message


def overlay(inst: workload_pb2.Instance, node: str, st: agent_pb2.InstanceStatus) -> None:
    """Put what the node observed onto the instance record (only for its current placement)."""
    if node != inst.node or inst.phase not in PLACED:
        return
    # the agent's Pending (preparing) reads better as Scheduled
    if st.phase and st.phase != InstancePhase.PENDING:
        inst.phase = st.phase
        if not inst.reason.startswith("DrainBlocked"):  # the scheduler's word on a blocked move stays visible
            _node_reason(inst, st)
    elif st.phase == InstancePhase.PENDING and st.reason.startswith(NODE_PENDING_REASONS):
        _node_reason(inst, st)  # the node waits for a device, or pulls/verifies the model package
    inst.endpoint = st.endpoint
    inst.pid = st.pid
    inst.restarts = st.restarts
    inst.exit_code = st.exit_code
    inst.ready_at_unix_ms = st.ready_at_unix_ms
    del inst.launch_command[:]
    inst.launch_command.extend(st.command)
    del inst.launch_env_names[:]
    inst.launch_env_names.extend(st.env_names)
    del inst.launch_device_nodes[:]
    inst.launch_device_nodes.extend(st.device_nodes)
    inst.prepare_seconds = st.prepare_seconds
    inst.first_token_ms = st.first_token_ms


class AssignmentIndex:
    """Per-node and per-workload indexes of the decoded workloads, rollouts, instances and statuses.

    A cache `Listener`: each change decodes only the changed record and updates the indexes, then
    wakes only the nodes whose assignments it can affect (an instance's old and new node; a
    workload's or rollout's instances' nodes). Telemetry, liveness and node records are not routed
    here at all.
    """

    KINDS = (keys.WORKLOADS, keys.ROLLOUTS, keys.INSTANCES, keys.INSTANCE_STATUS)

    def __init__(self, cache: GraphCache) -> None:
        self.work = cache.work
        self.workloads: dict[str, workload_pb2.Workload] = {}
        self.rollouts: dict[str, rollout_pb2.Rollout] = {}
        self.instances: dict[str, workload_pb2.Instance] = {}
        self.statuses: dict[str, tuple[str, agent_pb2.InstanceStatus]] = {}
        self.by_node: dict[str, set[str]] = {}
        self.by_workload: dict[str, set[str]] = {}
        self.node_topics: dict[str, Topic] = {}
        self._subscribers: dict[str, int] = {}
        cache.listen(self.KINDS, self)

    # ------------------------------------------------------------------ subscriptions
    def subscribe(self, node: str) -> Topic:
        """The topic notified when `node`'s assignments may have changed."""
        self._subscribers[node] = self._subscribers.get(node, 0) + 1
        return self.node_topics.setdefault(node, Topic())

    def unsubscribe(self, node: str) -> None:
        left = self._subscribers.get(node, 0) - 1
        if left > 0:
            self._subscribers[node] = left
        else:
            self._subscribers.pop(node, None)
            self.node_topics.pop(node, None)

    def _wake(self, node: str) -> None:
        if not node:
            return
        self.work.lookups += 1
        topic = self.node_topics.get(node)
        if topic is not None:
            self.work.wakeups += 1
            topic.notify()

    def _wake_workload(self, wid: str) -> None:
        self.work.lookups += 1
        for iid in self.by_workload.get(wid, ()):
            self.work.lookups += 1
            inst = self.instances.get(iid)
            if inst is not None:
                self._wake(inst.node)

    # ------------------------------------------------------------------ Listener
    def reset(self, kvs: Mapping[str, KV]) -> None:
        self.workloads.clear()
        self.rollouts.clear()
        self.instances.clear()
        self.statuses.clear()
        self.by_node.clear()
        self.by_workload.clear()
        for key, kv in kvs.items():
            if key.startswith(self.KINDS):
                self._update(key, kv)
        for topic in self.node_topics.values():
            topic.notify()

    def apply(self, key: str, kv: KV | None) -> None:
        self._update(key, kv)

    def _update(self, key: str, kv: KV | None) -> None:
        ident = keys.last_segment(key)
        if key.startswith(keys.INSTANCES):
            self._instance(ident, kv)
        elif key.startswith(keys.INSTANCE_STATUS):
            if kv is None:
                self.statuses.pop(ident, None)
            else:
                self.work.decodes += 1
                self.statuses[ident] = decode_status(kv.value)
        elif key.startswith(keys.WORKLOADS):
            if kv is None:
                self.workloads.pop(ident, None)
            else:
                self.work.decodes += 1
                self.workloads[ident] = keys.decode_message(kv.value, workload_pb2.Workload())  # type: ignore[assignment]
            self._wake_workload(ident)
        elif key.startswith(keys.ROLLOUTS):
            if kv is None:
                self.rollouts.pop(ident, None)
            else:
                self.work.decodes += 1
                self.rollouts[ident] = keys.decode_message(kv.value, rollout_pb2.Rollout())  # type: ignore[assignment]
            self._wake_workload(ident)

    def _instance(self, iid: str, kv: KV | None) -> None:
        old = self.instances.pop(iid, None)
        if old is not None:
            self.work.lookups += 2
            _discard(self.by_node, old.node, iid)
            _discard(self.by_workload, old.workload_id, iid)
            self._wake(old.node)
        if kv is None:
            return
        self.work.decodes += 1
        inst = workload_pb2.Instance()
        keys.decode_message(kv.value, inst)
        self.instances[iid] = inst
        self.work.lookups += 2
        if inst.node:
            self.by_node.setdefault(inst.node, set()).add(iid)
        self.by_workload.setdefault(inst.workload_id, set()).add(iid)
        if old is None or old.node != inst.node:
            self._wake(inst.node)


def _discard(index: dict[str, set[str]], name: str, iid: str) -> None:
    ids = index.get(name)
    if ids is not None:
        ids.discard(iid)
        if not ids:
            del index[name]


ROUTING = (
    keys.WORKLOADS,
    keys.ROLLOUTS,
    keys.INSTANCES,
    keys.INSTANCE_STATUS,
    keys.GATEWAY_KEYS,
    keys.GATEWAY_POLICIES,
    keys.REQUEST_ENDPOINTS,
    keys.SCHEDULER_CONFIG,
)
"""What the endpoint and gateway-config feeds are computed from (they wake on nothing else; the
scheduler settings carry the gateways' profiling switch)."""


def spec_ref(spec: workload_pb2.WorkloadSpec) -> str:
    """The key of a spec in an assignment set's `specs`: a digest of its deterministic encoding."""
    return hashlib.sha256(spec.SerializeToString(deterministic=True)).hexdigest()[:24]


def share_specs(full: agent_pb2.Assignments) -> agent_pb2.Assignments:
    """The same set with each distinct spec once in `specs`, named by the items' `spec_ref`
    (what an agent that registered with `shared_specs` receives; node_agent/assignment_check.py
    expands it back)."""
    out = agent_pb2.Assignments(revision=full.revision, cluster_id=full.cluster_id)
    for a in full.items:
        ref = spec_ref(a.spec)
        if ref not in out.specs:
            out.specs[ref].CopyFrom(a.spec)
        item = out.items.add()
        item.CopyFrom(a)
        item.ClearField("spec")
        item.spec_ref = ref
    return out


class Feeds:
    """A replica's live view for assignments, endpoints and status overlays."""

    def __init__(self, store: EtcdStore | None) -> None:
        self.cache = GraphCache(store)
        self.index = AssignmentIndex(self.cache)
        self.routing = self.cache.topic(ROUTING)
        """Notified when endpoints or the gateway configuration may have changed."""
        self.profiling = ProfilingFeed(self.cache)
        """The run-time profiling switch (scheduler settings), pushed to agents and gateways."""
        self.store = store
        self.cluster_id = 0
        """The etcd cluster id, sent with every assignment set (agents order sets by it and revision)."""

    async def start(self) -> None:
        if self.store is not None:
            self.cluster_id = await self.store.cluster_id()
        await self.cache.start()

    async def stop(self) -> None:
        await self.cache.stop()

    def rollouts(self) -> dict[str, rollout_pb2.Rollout]:
        """Rollouts by workload id (shared decoded records: read, never modify)."""
        return dict(self.index.rollouts)

    def spec_of(
        self,
        inst: workload_pb2.Instance,
        w: workload_pb2.Workload,
        rollouts: Mapping[str, rollout_pb2.Rollout],
    ) -> workload_pb2.WorkloadSpec:
        """The spec an instance runs: the rollout's canary spec for a canary; else the spec it was
        placed with (kept through a rolling update until it is replaced), or its workload's."""
        r = rollouts.get(w.id)
        if inst.variant == CANARY and r is not None:
            return canary_spec(w, r)
        return inst.spec if inst.HasField("spec") else w.spec

    def instances(self) -> list[workload_pb2.Instance]:
        """Every instance with what its node observed put on it (copies: the caller may modify)."""
        out = []
        for iid, rec in self.index.instances.items():
            inst = workload_pb2.Instance()
            inst.CopyFrom(rec)
            seen = self.index.statuses.get(iid)
            if seen is not None:
                overlay(inst, *seen)
            out.append(inst)
        return out

    def assignments_for(self, node: str, shared_specs: bool = False) -> agent_pb2.Assignments:
        """The node's full assignment set, from the per-node index: O(instances on the node).

        `shared_specs` (the agent registered saying it understands them): each distinct spec is sent
        once in `specs` and the items name it by `spec_ref`, instead of a copy in every item."""
        idx = self.index
        self.cache.work.computes += 1
        self.cache.work.lookups += 1
        items = []
        for iid in idx.by_node.get(node, ()):
            self.cache.work.lookups += 2
            inst = idx.instances[iid]
            w = idx.workloads.get(inst.workload_id)
            if inst.node != node or inst.phase not in PLACED or w is None or w.deleting:
                continue
            items.append(
                agent_pb2.Assignment(
                    instance_id=inst.id,
                    workload_id=inst.workload_id,
                    spec=self.spec_of(inst, w, idx.rollouts),
                    devices=list(inst.target_devices),
                    generation=inst.generation,
                )
            )
        items.sort(key=lambda a: a.instance_id)
        out = agent_pb2.Assignments(items=items, revision=self.cache.revision, cluster_id=self.cluster_id)
        return share_specs(out) if shared_specs else out

    def endpoints(self) -> workload_pb2.EndpointsSnapshot:
        idx = self.index
        eps = []
        for inst in self.instances():
            w = idx.workloads.get(inst.workload_id)
            if (
                inst.phase == InstancePhase.RUNNING
                and inst.endpoint
                and not inst.retiring  # a rolling update drains it before its engine stops
                and w is not None
                and not w.deleting
            ):
                eps.append(
                    workload_pb2.Endpoint(
                        instance_id=inst.id,
                        address=inst.endpoint,
                        workload=w.spec.name,
                        model=self.spec_of(inst, w, idx.rollouts).model,
                        node=inst.node,
                        variant=inst.variant,
                    )
                )
        eps.sort(key=lambda e: e.instance_id)
        return workload_pb2.EndpointsSnapshot(endpoints=eps, revision=self.cache.revision)

    def node_service(self, node: str) -> str:
        kv = self.cache.get(keys.node(node))
        if kv is None:
            return ""
        from kunlun_common.api import types_pb2

        n = types_pb2.Node()
        keys.decode_message(kv.value, n)
        return n.node_service


def same_items(a: Any, b: Any) -> bool:
    return bool(a is not None and b is not None and list(a.items) == list(b.items))
