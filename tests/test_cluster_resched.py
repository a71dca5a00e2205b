"""Rescheduling when a node dies, and a leader killed in the middle of placing a queue."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from chaos.invariants import double_allocations
from devcluster.cluster import LocalCluster
from devcluster.procs import wait_for
from kunlun_common.api import cluster_pb2
from tests.sched_helpers import (
    alloc_history,
    allocations,
    delete_all,
    get,
    placed,
    set_config,
    submit,
    targets,
    workloads,
)


@pytest.fixture(autouse=True)
def clean(cluster: LocalCluster) -> Iterator[None]:
    yield
    delete_all(cluster)


def node_ready(cluster: LocalCluster, node: str) -> bool:
    resp = cluster.call_any("ListNodes", cluster_pb2.ListNodesRequest())
    assert isinstance(resp, cluster_pb2.ListNodesResponse)
    return any(n.name == node and n.ready for n in resp.nodes)


def test_dead_node_instances_move_after_grace_and_nothing_runs_twice(cluster: LocalCluster) -> None:
    # the default grace: the agents' self-fencing (5 s deadline + 1 s slack + 3 s stop grace) stays
    # below the 5 s node lease + 8 s
    set_config(cluster, "node_not_ready_grace_seconds: 8\n")
    submit(cluster, name="svc", model="m", preferred_device_types=["cambricon", "ascend"], replicas=2)
    wait_for(lambda: placed(cluster, "svc", 2), 30, "placement")
    assert all(t.startswith("node-b/cambricon") for t in targets(cluster, "svc"))
    cluster.agents["node-b"].kill()
    wait_for(lambda: not node_ready(cluster, "node-b"), 40, "node-b NotReady")
    wait_for(
        lambda: placed(cluster, "svc", 2) and all(t.startswith("node-a/") for t in targets(cluster, "svc")),
        60,
        "instances rescheduled onto node-a",
    )
    hist = [h.reason for i in get(cluster, "svc").instances for h in i.history]
    assert any(r.startswith("Rescheduled: node node-b NotReady") for r in hist)
    cluster.start_agent(cluster.spec.node_configs[1], "node-b")
    wait_for(lambda: node_ready(cluster, "node-b"), 40, "node-b back")
    # the node came back: its old instances are not placed there again, nothing is held twice
    assert all(t.startswith("node-a/") for t in targets(cluster, "svc"))
    allocs = allocations(cluster)
    assert sorted(allocs) == targets(cluster, "svc")
    assert double_allocations(alloc_history(cluster)) == []


def test_new_leader_finishes_a_queue_of_50(cluster: LocalCluster) -> None:
    leader = cluster.leader()
    for i in range(50):
        submit(cluster, name=f"q{i:02d}", model="m", priority=("high", "normal", "low")[i % 3])
        if i == 24:  # half the queue is in while the leader is placing it: kill it mid-way
            cluster.replicas[leader].kill()
    wait_for(lambda: cluster.leader() not in ("", leader), 30, "a new leader")

    def done() -> bool:
        ws = workloads(cluster)
        if len(ws) != 50:
            return False
        n_placed = sum(1 for w in ws for i in w.instances if i.target_devices)
        waiting = [i for w in ws for i in w.instances if not i.target_devices]
        # CI once saw 7 instances with devices but 6 allocations right after the count matched
        # (a decision between two ticks, e.g. a preemption): wait for the settled state
        return (
            n_placed == 7
            and len(waiting) == 43
            and all(i.unplaced_reasons for i in waiting)
            and len(allocations(cluster)) == 7
        )

    wait_for(done, 90, "the new leader to place 7 (7 allocations) and explain the other 43")
    assert cluster.leader() not in ("", leader)
    assert len(allocations(cluster)) == 7
    assert double_allocations(alloc_history(cluster)) == []
    cluster.restart_replica(leader)
