"""The scheduler scenarios, end to end on the local multi-node cluster with simulated devices."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from chaos.invariants import double_allocations
from controlplane.cli.config import ClientConfig, write_client_config
from devcluster.cluster import LocalCluster
from devcluster.procs import wait_for
from kunlun_common.api import workload_pb2
from kunlun_common.pki import paths_for
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
    wait_for(
        lambda: sum(1 for w in workloads(cluster) if w.phase in ("Scheduled", "Running")) == 5,
        60,
        "the rest placed",
    )
    history = alloc_history(cluster)
    assert history and double_allocations(history) == []


def _cli(cluster: LocalCluster, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    p = paths_for(cluster.cert_dir, "operator", "admin")
    cfg = tmp_path / "client.yaml"
    if not cfg.exists():
        write_client_config(cfg, ClientConfig(tuple(cluster.endpoints), str(p.ca), str(p.cert), str(p.key)))
    return subprocess.run(
        [sys.executable, "-m", "controlplane.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={"KUNLUN_CONFIG": str(cfg), "PATH": "/usr/bin:/bin"},
    )


def test_cli_workload_lifecycle(cluster: LocalCluster, tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        "name: chat\nmodel: qwen2-0.5b\nreplicas: 2\npreferred_device_types: [ascend]\npriority: high\n"
    )
    r = _cli(cluster, tmp_path, "workload", "submit", "-f", str(spec), "-o", "json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["result"] == "created"
    r = _cli(cluster, tmp_path, "workload", "submit", "-f", str(spec))
    assert "unchanged" in r.stdout
    wait_for(lambda: placed(cluster, "chat", 2), 30, "placement")
    r = _cli(cluster, tmp_path, "workload", "list", "-o", "json")
    item = json.loads(r.stdout)["items"][0]
    assert item["name"] == "chat" and item["phase"] in ("Scheduled", "Running") and item["replicas"] == 2
    assert len(item["target"]) == 2 and all(t.startswith("node-a/ascend:") for t in item["target"])
    r = _cli(cluster, tmp_path, "workload", "list")
    assert r.stdout.split("\n")[0].split() == ["ID", "NAME", "PHASE", "INSTANCES", "TARGET", "AGE"]
    r = _cli(cluster, tmp_path, "workload", "describe", "chat")
    assert (
        "target_devices: [node-a/ascend:" in r.stdout
        and "Scheduled" in r.stdout
        and "by scheduler@" in r.stdout
    )
    assert "Submitted  by operator:admin" in r.stdout
    r = _cli(cluster, tmp_path, "workload", "scale", "chat", "1")
    assert r.returncode == 0
    wait_for(lambda: len(get(cluster, "chat").instances) == 1, 30, "scaled down")
    r = _cli(cluster, tmp_path, "workload", "delete", "chat", "--wait")
    assert r.returncode == 0 and "deleted" in r.stdout
    r = _cli(cluster, tmp_path, "workload", "describe", "chat")
    assert r.returncode == 1 and "not found" in r.stderr


def test_cli_refuses_invalid_specs_and_configs_whole(cluster: LocalCluster, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "name: Bad_Name\nmodel: m\nquantization: int3\npriority: urgent\ndevices_per_instance: 0\nreplica: 2\n"
    )
    r = _cli(cluster, tmp_path, "workload", "submit", "-f", str(bad))
    assert r.returncode == 1 and "replica: unknown field; did you mean 'replicas'?" in r.stderr
    bad.write_text("name: Bad_Name\nmodel: m\nquantization: int3\npriority: urgent\n")
    r = _cli(cluster, tmp_path, "workload", "submit", "-f", str(bad))
    assert r.returncode == 1
    for field in ("name:", "quantization:", "priority:"):
        assert field in r.stderr, r.stderr
    assert workloads(cluster) == []
    cfg = tmp_path / "sched.yaml"
    cfg.write_text("policy: binpack\ntemperature_limit_c: 500\npolicyy: x\n")
    r = _cli(cluster, tmp_path, "scheduler", "config", "set", "-f", str(cfg))
    assert r.returncode == 1 and "temperature_limit_c" in r.stderr and "policyy" in r.stderr
    r = _cli(cluster, tmp_path, "scheduler", "config", "get", "-o", "json")
    assert json.loads(r.stdout)["policy"] == "spread"
    cfg.write_text("policy: binpack\n")
    assert _cli(cluster, tmp_path, "scheduler", "config", "set", "-f", str(cfg)).returncode == 0
    assert (
        json.loads(_cli(cluster, tmp_path, "scheduler", "config", "get", "-o", "json").stdout)["policy"]
        == "binpack"
    )


def test_cli_drain_reports_what_cannot_move(cluster: LocalCluster, tmp_path: Path) -> None:
    submit(cluster, name="stuck", model="m", pin="node-b/nvidia:0")
    wait_for(lambda: placed(cluster, "stuck"), 30, "placement")
    r = _cli(cluster, tmp_path, "node", "drain", "node-b", "--wait", "30", "-o", "json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["cordoned"] is True and out["draining"] is True
    assert [c["workload"] for c in out["cannot_move"]] == ["stuck"]
    assert out["cannot_move"][0]["reason"].startswith("DrainBlocked")


def test_int8_refused_on_a_device_declared_fp16_only(cluster: LocalCluster, tmp_path: Path) -> None:
    cfg = tmp_path / "node-c.yaml"
    cfg.write_text(
        "schema_version: 1\n"
        "node: {name: node-c, address: 127.0.0.1, simulated: true}\n"
        "devices:\n"
        "  - {device_type: ascend, device_id: 0, model: 910B, hbm_memory_mb: 32768, supported_dtypes: [fp16]}\n"
    )
    proc = cluster.start_agent(cfg, "node-c")
    try:
        wait_for(lambda: cluster.node_ready("node-c"), 40, "node-c registered")
        submit(cluster, name="int8-on-c", model="llama3-8b", quantization="int8", pin="node-c/ascend:0")
        wait_for(
            lambda: (
                get(cluster, "int8-on-c").instances
                and get(cluster, "int8-on-c").instances[0].unplaced_reasons
            ),
            30,
            "reasons",
        )
        reasons = dict(get(cluster, "int8-on-c").instances[0].unplaced_reasons)
        assert reasons["node-c"] == "UnsupportedDtype (int8 not in [fp16])", reasons
        assert reasons["node-a"] == "PinMismatch"
    finally:
        proc.kill()


def test_rollout_by_hand_replaces_the_model(cluster: LocalCluster, tmp_path: Path) -> None:
    submit(cluster, name="svc", model="qwen-v1", replicas=2)
    wait_for(lambda: placed(cluster, "svc", 2), 30, "baseline placed")
    r = _cli(
        cluster, tmp_path, "rollout", "create", "svc", "--model", "qwen-v2", "--canary", "50%", "-o", "json"
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["canary_weight_pct"] == 50

    def models() -> list[str]:
        out = []
        for i in get(cluster, "svc").instances:
            cmd = list(i.launch_command)
            if "--model-path" in cmd and i.phase == "Running":
                out.append(cmd[cmd.index("--model-path") + 1])
        return sorted(out)

    wait_for(
        lambda: "qwen-v2" in models() and models().count("qwen-v1") == 2, 60, "a canary next to the baseline"
    )
    for _ in range(2):
        assert _cli(cluster, tmp_path, "rollout", "promote", "svc").returncode == 0
        wait_for(
            lambda: (
                json.loads(_cli(cluster, tmp_path, "rollout", "status", "svc", "-o", "json").stdout)[
                    "canary_weight_pct"
                ]
                == 100
                or json.loads(_cli(cluster, tmp_path, "rollout", "status", "svc", "-o", "json").stdout)[
                    "phase"
                ]
                == "Completed"
            ),
            60,
            "the promotion applied",
        )
    wait_for(
        lambda: (
            json.loads(_cli(cluster, tmp_path, "rollout", "status", "svc", "-o", "json").stdout)["phase"]
            == "Completed"
        ),
        60,
        "completed",
    )
    assert get(cluster, "svc").workload.spec.model == "qwen-v2"
    wait_for(lambda: models() == ["qwen-v2", "qwen-v2"], 90, "nothing serves the old model")


def _page(cluster: LocalCluster, size: int, token: str = "") -> workload_pb2.ListWorkloadsResponse:
    resp = call(
        cluster,
        lambda s: s.ListWorkloads,
        workload_pb2.ListWorkloadsRequest(page_size=size, page_token=token),
    )
    assert isinstance(resp, workload_pb2.ListWorkloadsResponse)
    return resp


def test_workload_list_pages_are_one_consistent_snapshot(cluster: LocalCluster, tmp_path: Path) -> None:
    names = [f"pg-{i}" for i in range(7)]
    for n in names:
        submit(
            cluster, name=n, model="m", replicas=1, preferred_device_types=["ascend"], memory_per_device_mb=10
        )
    wait_for(lambda: all(get(cluster, n).instances for n in names), 30, "every workload has its instance")
    first = _page(cluster, 3)
    assert len(first.workloads) == 3 and first.next_page_token and first.revision > 0
    # changes after the first page do not show in the later pages of this listing ...
    submit(cluster, name="pg-late", model="m", replicas=1)
    call(
        cluster,
        lambda s: s.DeleteWorkload,
        workload_pb2.DeleteWorkloadRequest(name=first.workloads[0].workload.id),
    )
    pages = [first]
    while pages[-1].next_page_token:
        pages.append(_page(cluster, 3, pages[-1].next_page_token))
        assert pages[-1].revision == first.revision
    assert [len(p.workloads) for p in pages] == [3, 3, 1]
    listed = [s.workload.id for p in pages for s in p.workloads]
    assert listed == sorted(listed) and len(set(listed)) == 7
    assert sorted(s.workload.spec.name for p in pages for s in p.workloads) == names
    assert all(
        len(s.instances) == 1 and s.instances[0].workload_id == s.workload.id
        for p in pages
        for s in p.workloads
    )
    # ... and a new listing (or the unpaged call, or the CLI, which pages) sees them
    assert "pg-late" in {s.workload.spec.name for s in workloads(cluster)}
    cli = _cli(cluster, tmp_path, "-o", "json", "workload", "list")
    assert cli.returncode == 0, cli.stderr
    assert "pg-late" in {i["name"] for i in json.loads(cli.stdout)["items"]}


def test_bad_page_requests_are_refused_with_the_field(cluster: LocalCluster) -> None:
    for size, token, field in (
        (1001, "", "page_size"),
        (-1, "", "page_size"),
        (5, "not-a-token!", "page_token"),
    ):
        req = workload_pb2.ListWorkloadsRequest(page_size=size, page_token=token)
        with pytest.raises(grpc.RpcError) as e:
            call(cluster, lambda s: s.ListWorkloads, req)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in (e.value.details() or "")
