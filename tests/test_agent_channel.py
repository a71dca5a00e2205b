"""The agent channel's assignment sets, without a cluster: each distinct spec travels once (for
agents that registered with `shared_specs`) and the agent expands it back to exactly the set an
older replica sends; the message limits of the two ends mirror each other. End to end (a node full
of large specs): tests/test_node_faults.py."""

from __future__ import annotations

from controlplane.feeds import share_specs, spec_ref
from kunlun_common.api import agent_pb2, workload_pb2
from kunlun_common.wire_limits import (
    FROM_AGENT_MAX_BYTES,
    TO_AGENT_MAX_BYTES,
    agent_channel_options,
    replica_server_options,
)
from node_agent.assignment_check import safe_assignments

BIG = workload_pb2.WorkloadSpec(name="wide", model="m", env={f"PAD_{i}": "p" * (110 << 10) for i in range(8)})
SMALL = workload_pb2.WorkloadSpec(name="chat", model="m")


def full_set() -> agent_pb2.Assignments:
    items = [
        agent_pb2.Assignment(
            instance_id=f"w-1-{o}-7", workload_id="w-1", spec=BIG, devices=[f"n/hygon:{o}"], generation=2
        )
        for o in range(6)
    ]
    items.append(
        agent_pb2.Assignment(instance_id="w-2-0-9", workload_id="w-2", spec=SMALL, devices=["n/hygon:7"])
    )
    return agent_pb2.Assignments(items=items, revision=41, cluster_id=7)


def test_each_spec_travels_once_and_expands_to_the_full_set() -> None:
    full = full_set()
    shared = share_specs(full)
    assert sorted(shared.specs) == sorted({spec_ref(BIG), spec_ref(SMALL)})
    assert all(not a.HasField("spec") and a.spec_ref for a in shared.items)
    assert full.ByteSize() > 6 * BIG.ByteSize() and shared.ByteSize() < BIG.ByteSize() + 4096
    assert (shared.revision, shared.cluster_id) == (41, 7)
    # the agent sees exactly what an older replica sends (the fingerprints of running engines hold)
    assert safe_assignments(shared) == full


def test_an_older_replicas_set_is_taken_as_it_is() -> None:
    full = full_set()
    assert safe_assignments(full) is full


def test_an_item_naming_a_missing_spec_is_dropped_alone() -> None:
    shared = share_specs(full_set())
    shared.items[0].spec_ref = "0" * 24
    out = safe_assignments(shared)
    assert [a.instance_id for a in out.items] == [a.instance_id for a in full_set().items[1:]]
    assert all(a.spec.name for a in out.items)


def test_the_two_ends_of_the_agent_channel_mirror_their_limits() -> None:
    server, client = dict(replica_server_options()), dict(agent_channel_options())
    assert server["grpc.max_send_message_length"] == client["grpc.max_receive_message_length"]
    assert client["grpc.max_send_message_length"] == server["grpc.max_receive_message_length"]
    assert TO_AGENT_MAX_BYTES >= 64 * (1 << 20) > FROM_AGENT_MAX_BYTES
