"""What every replica serves from its own watch-fed copy of the graph: the assignments of each
connected node, the routable endpoints for gateways, and observed instance status.

Agents get the full set of instances their node must run whenever it changes (idempotent: the
agent reconciles against the whole set); gateways get the full endpoint set likewise.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format

from controlplane import keys
from controlplane.cache import GraphCache
from controlplane.rollout import CANARY, canary_spec, decode_rollouts
from controlplane.store import EtcdStore
from kunlun_common.api import agent_pb2, rollout_pb2, workload_pb2

PLACED = ("Scheduled", "Starting", "Running")


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


def overlay(inst: workload_pb2.Instance, node: str, st: agent_pb2.InstanceStatus) -> None:
    """Put what the node observed onto the instance record (only for its current placement)."""
    if node != inst.node or inst.phase not in PLACED:
        return
    if st.phase and st.phase != "Pending":  # the agent's "Pending" (preparing) reads better as Scheduled
        inst.phase = st.phase
        if not inst.reason.startswith("DrainBlocked"):  # the scheduler's word on a blocked move stays visible
            inst.reason = st.reason or inst.reason
    elif st.phase == "Pending" and st.reason.startswith("waiting for device"):
        inst.reason = st.reason  # the node waits for an earlier engine to release a device
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


class Feeds:
    """A replica's live view for assignments, endpoints and status overlays."""

    def __init__(self, store: EtcdStore) -> None:
        self.cache = GraphCache(store)
        self.store = store
        self.cluster_id = 0

    async def start(self) -> None:
        self.cluster_id = await self.store.cluster_id()
        await self.cache.start()

    async def stop(self) -> None:
        await self.cache.stop()

    def _workloads(self) -> dict[str, workload_pb2.Workload]:
        out: dict[str, workload_pb2.Workload] = {}
        for kv in self.cache.prefix(keys.WORKLOADS):
            w = workload_pb2.Workload()
            keys.decode_message(kv.value, w)
            out[w.id] = w
        return out

    def rollouts(self) -> dict[str, rollout_pb2.Rollout]:
        """Rollouts by workload id."""
        return {wid: r for wid, (r, _) in decode_rollouts(self.cache.prefix(keys.ROLLOUTS)).items()}

    def spec_of(
        self, inst: workload_pb2.Instance, w: workload_pb2.Workload, rollouts: dict[str, rollout_pb2.Rollout]
    ) -> workload_pb2.WorkloadSpec:
        """The spec an instance runs: its workload's, or the rollout's canary spec for a canary."""
        r = rollouts.get(w.id)
        return canary_spec(w, r) if inst.variant == CANARY and r is not None else w.spec

    def instances(self) -> list[workload_pb2.Instance]:
        statuses = {
            keys.last_segment(kv.key): decode_status(kv.value)
            for kv in self.cache.prefix(keys.INSTANCE_STATUS)
        }
        out = []
        for kv in self.cache.prefix(keys.INSTANCES):
            inst = workload_pb2.Instance()
            keys.decode_message(kv.value, inst)
            if inst.id in statuses:
                overlay(inst, *statuses[inst.id])
            out.append(inst)
        return out

    def assignments_for(self, node: str) -> agent_pb2.Assignments:
        workloads = self._workloads()
        rollouts = self.rollouts()
        items = []
        for kv in self.cache.prefix(keys.INSTANCES):
            inst = workload_pb2.Instance()
            keys.decode_message(kv.value, inst)
            w = workloads.get(inst.workload_id)
            if inst.node != node or inst.phase not in PLACED or w is None or w.deleting:
                continue
            items.append(
                agent_pb2.Assignment(
                    instance_id=inst.id,
                    workload_id=inst.workload_id,
                    spec=self.spec_of(inst, w, rollouts),
                    devices=list(inst.target_devices),
                    generation=inst.generation,
                )
            )
        items.sort(key=lambda a: a.instance_id)
        return agent_pb2.Assignments(items=items, revision=self.cache.revision, cluster_id=self.cluster_id)

    def endpoints(self) -> workload_pb2.EndpointsSnapshot:
        workloads = self._workloads()
        rollouts = self.rollouts()
        eps = []
        for inst in self.instances():
            w = workloads.get(inst.workload_id)
            if inst.phase == "Running" and inst.endpoint and w is not None and not w.deleting:
                eps.append(
                    workload_pb2.Endpoint(
                        instance_id=inst.id,
                        address=inst.endpoint,
                        workload=w.spec.name,
                        model=self.spec_of(inst, w, rollouts).model,
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
