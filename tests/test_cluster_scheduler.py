"""The scheduler scenarios, end to end on the local multi-node cluster with simulated devices."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from chaos.invariants import double_allocations
from controlplane.local.cluster import LocalCluster
from controlplane.local.procs import wait_for
from kunlun_common.api import workload_pb2
from tests.sched_helpers import (
    alloc_history,
    allocations,
    call,
    delete_all,
    get,
    placed,
    set_config,
    submit,
    targets,
    workloads,
)

ALL7 = [
    "node-a/ascend:0",
    "node-a/ascend:1",
    "node-a/ascend:2",
    "node-a/ascend:3",
    "node-b/cambricon:0",
    "node-b/cambricon:1",
    "node-b/nvidia:0",
]


@pytest.fixture(autouse=True)
def clean(cluster: LocalCluster) -> Iterator[None]:
    yield
    delete_all(cluster)
    set_config(cluster, "policy: spread\n")
    for node in ("node-a", "node-b"):
        call(cluster, lambda s: s.CordonNode, workload_pb2.CordonNodeRequest(node=node, cordon=False))


def test_pinned_workload_lands_on_its_device(cluster: LocalCluster) -> None:
    submit(cluster, model="qwen2-0.5b", pin="ascend:0", batch_size=1)
    wait_for(lambda: placed(cluster, "qwen2-0.5b"), 30, "placement")
    assert targets(cluster, "qwen2-0.5b") == ["node-a/ascend:0"]
    # submitting the same spec again is idempotent
    w = get(cluster, "qwen2-0.5b").workload
    again = call(
        cluster,
        lambda s: s.SubmitWorkload,
        workload_pb2.SubmitWorkloadRequest(
            spec=workload_pb2.WorkloadSpec(model="qwen2-0.5b", pin="ascend:0", batch_size=1)
        ),
    )
    assert isinstance(again, workload_pb2.SubmitWorkloadResponse)
    assert again.result == "unchanged" and again.workload.id == w.id


def test_seven_on_seven_then_eighth_waits_with_reasons(cluster: LocalCluster) -> None:
    for i in range(7):
        submit(cluster, name=f"m{i}", model=f"model-{i}")
    wait_for(lambda: all(placed(cluster, f"m{i}") for i in range(7)), 60, "7 placements")
    assert sorted(d for i in range(7) for d in targets(cluster, f"m{i}")) == ALL7
    submit(cluster, name="m7", model="model-7")
    wait_for(
        lambda: get(cluster, "m7").instances and get(cluster, "m7").instances[0].unplaced_reasons,
        30,
        "reasons for m7",
    )
    inst = get(cluster, "m7").instances[0]
    assert inst.phase == "Pending"
    assert dict(inst.unplaced_reasons) == {"node-a": "NoFreeDevice", "node-b": "NoFreeDevice"}
    call(cluster, lambda s: s.DeleteWorkload, workload_pb2.DeleteWorkloadRequest(name="m3"))
    wait_for(lambda: placed(cluster, "m7"), 60, "m7 placed once a device is free")
    assert len(set(allocations(cluster))) == 7


def test_quantization_and_preferred_types(cluster: LocalCluster) -> None:
    submit(
        cluster,
        name="llama3-8b",
        model="llama3-8b",
        quantization="int8",
        preferred_device_types=["cambricon", "ascend"],
    )
    wait_for(lambda: placed(cluster, "llama3-8b"), 30, "placement")
    assert targets(cluster, "llama3-8b")[0].startswith("node-b/cambricon:")
    submit(
        cluster,
        name="llama3-8b",
        model="llama3-8b",
        quantization="int8",
        preferred_device_types=["cambricon", "ascend"],
        replicas=3,
    )
    wait_for(lambda: placed(cluster, "llama3-8b", 3), 30, "3 placements")
    t = targets(cluster, "llama3-8b")
    assert sorted(x.split(":")[0] for x in t) == ["node-a/ascend", "node-b/cambricon", "node-b/cambricon"]
    # nvidia:0 is declared with fp8 but the ascend cards cannot do fp8: an fp8 workload pinned to ascend is refused with the reason
    submit(cluster, name="fp8-job", model="x", quantization="fp8", preferred_device_types=["ascend"])
    wait_for(
        lambda: get(cluster, "fp8-job").instances and get(cluster, "fp8-job").instances[0].unplaced_reasons,
        30,
        "reasons",
    )
    reasons = dict(get(cluster, "fp8-job").instances[0].unplaced_reasons)
    assert reasons["node-a"].startswith("UnsupportedDtype (fp8 not in [fp16, bf16, int8])"), reasons


def test_multi_device_instance_gets_closest_pair_and_too_big_waits(cluster: LocalCluster) -> None:
    submit(
        cluster,
        name="tp2",
        model="m",
        devices_per_instance=2,
        preferred_device_types=["ascend"],
        require_p2p=True,
    )
    wait_for(lambda: placed(cluster, "tp2"), 30, "placement")
    assert targets(cluster, "tp2") in (
        ["node-a/ascend:0", "node-a/ascend:1"],
        ["node-a/ascend:2", "node-a/ascend:3"],
    )
    submit(cluster, name="tp5", model="m", devices_per_instance=5)
    wait_for(
        lambda: get(cluster, "tp5").instances and get(cluster, "tp5").instances[0].unplaced_reasons,
        30,
        "reasons",
    )
    reasons = dict(get(cluster, "tp5").instances[0].unplaced_reasons)
    assert reasons["node-a"] == "InsufficientDevices (needs 5, 4 on node)"
    assert reasons["node-b"].startswith("InsufficientDevices (needs 5")


def test_high_priority_preempts_low(cluster: LocalCluster) -> None:
    for i in range(7):
        submit(cluster, name=f"low{i}", model="m", priority="low")
    wait_for(lambda: all(placed(cluster, f"low{i}") for i in range(7)), 60, "low placements")
    submit(cluster, name="urgent", model="m", priority="high")
    wait_for(lambda: placed(cluster, "urgent"), 60, "high placed by preemption")
    evicted = [
        w
        for w in workloads(cluster)
        if w.workload.spec.priority == "low" and any(i.phase == "Pending" for i in w.instances)
    ]
    assert len(evicted) == 1
    hist = evicted[0].instances[0].history
    assert any(h.reason.startswith("Preempted by") for h in hist)
    assert "NoFreeDevice" in evicted[0].instances[0].reason or evicted[0].instances[0].unplaced_reasons


def test_drain_moves_instances_and_reports_the_rest(cluster: LocalCluster) -> None:
    submit(cluster, name="a-one", model="m", pin="node-a/ascend:0")
    submit(cluster, name="movable", model="m", preferred_device_types=["ascend"])
    wait_for(lambda: placed(cluster, "a-one") and placed(cluster, "movable"), 30, "placements")
    submit(
        cluster, name="movable", model="m", preferred_device_types=["ascend", "cambricon"]
    )  # now allowed elsewhere
    call(
        cluster,
        lambda s: s.CordonNode,
        workload_pb2.CordonNodeRequest(node="node-a", cordon=True, drain=True),
    )
    wait_for(
        lambda: targets(cluster, "movable") and targets(cluster, "movable")[0].startswith("node-b/"),
        30,
        "movable moved to node-b",
    )
    wait_for(
        lambda: get(cluster, "a-one").instances[0].reason.startswith("DrainBlocked"),
        30,
        "pinned instance reported",
    )
    assert targets(cluster, "a-one") == ["node-a/ascend:0"]


def test_no_device_is_ever_held_twice(cluster: LocalCluster) -> None:
    for i in range(10):
        submit(cluster, name=f"churn{i}", model="m")
    wait_for(lambda: len(allocations(cluster)) == 7, 60, "all devices allocated")
    for i in range(0, 10, 2):
        call(
            cluster,
            lambda s: s.DeleteWorkload,
            workload_pb2.DeleteWorkloadRequest(name=f"churn{i}"),
        )
    wait_for(lambda: sum(1 for w in workloads(cluster) if w.phase == "Scheduled") == 5, 60, "the rest placed")
    history = alloc_history(cluster)
    assert history and double_allocations(history) == []
