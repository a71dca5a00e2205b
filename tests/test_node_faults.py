"""Node-side faults against one real cluster: a preemption onto a device whose engine is slow to
stop, a device turning Unhealthy end to end, a stop that fails and is retried, a registration refused
for its fencing numbers, and a workload history that stays bounded. Overlap of engines is judged
from the agents' engine ledgers (every start and stop event), not from the final state."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from controlplane.redact import REDACTED
from devcluster.cluster import EXAMPLES, LocalCluster
from devcluster.procs import ManagedProcess, pid_alive, wait_for
from kunlun_common.api import cluster_pb2, types_pb2, workload_pb2, workload_pb2_grpc
from node_agent.executor import ledger as engine_ledger
from tests.fault_helpers import events_of, fault_cluster, fencing_agent_args, ledger, overlaps, running_on
from tests.sched_helpers import allocations, call, delete_all, get, set_config, submit, targets

LEASE_S, DEADLINE_S, STOP_GRACE_S, GRACE_S = 3, 3.0, 5.0, 8.0
"""Fenced after 3 + 1 (slack) + 5 = 9 s, moved after 3 + 8 = 11 s; a stop grace long enough for an
engine that ignores SIGTERM for 4 s to end by itself."""
UNHEALTHY_GRACE_S = 2.0
SLOW_STOP_S = 4.0
"""How long the slow test engines keep serving after SIGTERM (below the agents' stop grace)."""


@pytest.fixture(scope="module")
def faults_cluster() -> Iterator[LocalCluster]:
    with fault_cluster(
        "test_node_faults",
        node_lease_ttl_s=LEASE_S,
        gateways=0,
        metrics=False,
        extra_nodes=("node-x", "node-y"),
        agent_args=fencing_agent_args(DEADLINE_S, STOP_GRACE_S),
    ) as c:
        set_config(
            c,
            f"node_not_ready_grace_seconds: {GRACE_S:g}\n"
            f"device_unhealthy_grace_seconds: {UNHEALTHY_GRACE_S:g}\n",
        )
        yield c


@pytest.fixture(autouse=True)
def clean(faults_cluster: LocalCluster) -> Iterator[None]:
    yield
    delete_all(faults_cluster)


def device_status(cluster: LocalCluster, name: str) -> int:
    return next(d.status for d in cluster.devices() if d.name == name)


def test_preemption_waits_for_the_victims_slow_engine(faults_cluster: LocalCluster) -> None:
    """A high-priority workload preempts a low-priority one on the only device it may use, whose
    engine keeps serving 4 s after SIGTERM: the new engine starts only once the old one is gone, and
    its phase reason says what it waits for meanwhile."""
    c = faults_cluster
    dev = "node-b/nvidia:0"
    submit(
        c,
        name="low",
        model="m",
        pin=dev,
        priority="low",
        engine_args=["--ignore-sigterm", f"{SLOW_STOP_S:g}"],
    )
    wait_for(lambda: running_on(c, "low", dev), 120, "low Running")
    low = get(c, "low").instances[0].id
    (low_run,) = events_of(c, "node-b", low, "start")
    submit(c, name="high", model="m", pin=dev, priority="high")
    seen: list[str] = []

    def high_running() -> bool:
        seen.extend(i.reason for i in get(c, "high").instances)
        return running_on(c, "high", dev)

    wait_for(high_running, 120, "high Running on the preempted device")
    high = get(c, "high").instances[0].id
    victim = get(c, "low").instances[0]
    assert victim.phase == "Pending" and not victim.target_devices
    assert any(h.reason == f"Preempted by {high} (priority high)" for h in victim.history), victim.history
    assert any(r.startswith(f"waiting for device {dev}: still held by instance {low}") for r in seen), set(
        seen
    )
    # the victim's engine (serving on 4 s after SIGTERM) was gone before the new one started
    (low_stop,) = events_of(c, "node-b", low, "stop")
    (high_start,) = events_of(c, "node-b", high, "start")
    assert not pid_alive(low_run["pid"])
    assert low_stop["mono_ns"] < high_start["mono_ns"]
    assert overlaps(ledger(c, "node-b")) == []


def test_unhealthy_device_moves_its_instance_after_the_grace(faults_cluster: LocalCluster) -> None:
    """The stand-in tool reports a device Critical: after device_unhealthy_grace_seconds (on the
    leader's clock) the instance leaves it for a healthy device, its old engine stops first, and the
    reason names the device. Until the grace passed it stays where it is."""
    from node_agent.plugins.standin.state import update_chip

    c = faults_cluster
    submit(c, name="sick", model="m", preferred_device_types=["ascend"])
    wait_for(lambda: running_on(c, "sick", "node-a/ascend:"), 120, "sick Running")
    inst = get(c, "sick").instances[0]
    iid, (dev,) = inst.id, inst.target_devices
    (old,) = events_of(c, "node-a", iid, "start")
    state = c.base / "agents" / "node-a" / "sim-state.json"
    index = int(dev.rsplit(":", 1)[1])
    update_chip(state, "ascend", index, health="Critical")
    marked = time.monotonic()
    try:
        wait_for(lambda: device_status(c, dev) == types_pb2.DEVICE_STATUS_UNHEALTHY, 30, f"{dev} Unhealthy")
        wait_for(lambda: targets(c, "sick") != [dev], 60, "sick moved off the unhealthy device")
        moved_after = time.monotonic() - marked
        assert moved_after >= UNHEALTHY_GRACE_S, f"moved {moved_after:.1f}s after the device turned Critical"
        wait_for(lambda: running_on(c, "sick", "node-a/ascend:"), 120, "sick Running on another ascend")
        new_dev = targets(c, "sick")[0]
        assert new_dev != dev and get(c, "sick").instances[0].id == iid
        reasons = [h.reason for h in get(c, "sick").instances[0].history]
        assert f"Rescheduled: device {dev} Unhealthy" in reasons, reasons
        # the same instance on the same agent: the old engine was gone before the new one started
        stops, starts = events_of(c, "node-a", iid, "stop"), events_of(c, "node-a", iid, "start")
        assert len(stops) == 1 and len(starts) == 2 and starts[0] == old
        assert stops[0]["pid"] == old["pid"] and stops[0]["mono_ns"] < starts[1]["mono_ns"]
        assert starts[1]["devices"] == [new_dev] and not pid_alive(old["pid"])
        assert overlaps(ledger(c, "node-a")) == []
    finally:
        update_chip(state, "ascend", index, health="OK")
    wait_for(lambda: device_status(c, dev) == types_pb2.DEVICE_STATUS_READY, 30, f"{dev} Ready again")


def test_a_failed_stop_is_retried_and_the_device_stays_held(faults_cluster: LocalCluster) -> None:
    """The engine's stop fails (its supervisor's stop request cannot be written: a folder sits where
    the file goes). The worker keeps retrying, is never marked Stopped while its engine lives, keeps
    its folder, and the next engine on that device waits. Once the obstacle is gone the retry stops
    the engine, the folder is removed and the waiting engine starts."""
    c = faults_cluster
    dev = "node-b/cambricon:1"
    submit(c, name="stuck", model="m", pin=dev)
    wait_for(lambda: running_on(c, "stuck", dev), 120, "stuck Running")
    iid = get(c, "stuck").instances[0].id
    (run,) = events_of(c, "node-b", iid, "start")
    folder = c.base / "agents" / "node-b" / "instances" / iid
    blocker = folder / "stop.json" / "blocker"
    blocker.mkdir(parents=True)
    agent_log = c.agents["node-b"].log_path
    failures_before = agent_log.read_text().count("could not stop the engine")
    call(c, lambda s: s.DeleteWorkload, workload_pb2.DeleteWorkloadRequest(name="stuck"))
    submit(c, name="after", model="m", pin=dev)

    def saved() -> dict[str, Any]:
        data = json.loads((folder / "agent.json").read_text())
        return dict(data["status"])

    wait_for(lambda: "stop failed" in saved().get("reason", ""), 60, "the failed stop in the worker's status")
    wait_for(
        lambda: agent_log.read_text().count("could not stop the engine") >= failures_before + 2,
        30,
        "the stop retried",
    )
    status = saved()
    assert status["phase"] != "Stopped" and "retrying in" in status["reason"], status
    assert pid_alive(run["pid"]) and folder.is_dir() and not events_of(c, "node-b", iid, "stop")
    after = get(c, "after").instances
    assert after and after[0].phase != "Running"
    assert after[0].reason.startswith(f"waiting for device {dev}: still held by instance {iid}"), after[
        0
    ].reason
    shutil.rmtree(folder / "stop.json")
    wait_for(lambda: not pid_alive(run["pid"]), 30, "the retried stop to end the engine")
    wait_for(lambda: not folder.exists(), 30, "the stopped instance's folder removed")
    wait_for(lambda: running_on(c, "after", dev), 120, "after Running once the device is free")
    (stop,) = events_of(c, "node-b", iid, "stop")
    (start,) = events_of(c, "node-b", get(c, "after").instances[0].id, "start")
    assert stop["mono_ns"] < start["mono_ns"]
    assert overlaps(ledger(c, "node-b")) == []


def test_registration_is_refused_with_the_fencing_numbers(
    faults_cluster: LocalCluster, tmp_path: Path
) -> None:
    """An agent whose own check passes (its numbers fit the default lease and grace) but whose fencing
    is too slow for THIS cluster's 3 s lease + 8 s grace is refused at registration, and never becomes
    a node."""
    c = faults_cluster
    config = tmp_path / "node-y.yaml"
    text = (Path(c.spec.node_configs[0])).read_text().replace("name: node-a", "name: node-y")
    config.write_text(text)
    argv = [
        a
        for a in c.agent_argv(config, "node-y")
        if not a.startswith(("--state-dir=", "--disconnect-stop=", "--stop-grace="))
    ]
    argv += [f"--state-dir={tmp_path / 'state'}", "--disconnect-stop=6", "--stop-grace=5"]
    agent = ManagedProcess("agent-node-y", argv, tmp_path / "agent.log")
    agent.start()
    try:
        want = (
            "node node-y: disconnect deadline 7s + stop grace 5s = 12s is not below node lease 3s + "
            "node_not_ready_grace_seconds 8s = 11s"
        )
        wait_for(lambda: want in agent.log_text(), 60, "the refusal in the agent's log")
        assert agent.alive(), "the agent keeps trying (the operator may raise the grace)"
        resp = c.call_any("ListNodes", cluster_pb2.ListNodesRequest())
        assert isinstance(resp, cluster_pb2.ListNodesResponse)
        assert "node-y" not in {n.name for n in resp.nodes}
    finally:
        agent.stop()
    replica_logs = "".join(p.read_text() for p in (c.base / "replicas").glob("*.log"))
    assert "registration refused" in replica_logs and want in replica_logs


def test_history_stays_bounded_and_the_workload_still_scales_and_deletes(
    faults_cluster: LocalCluster,
) -> None:
    """60 updates: the record keeps the last 50 events and counts the others per phase; scaling and
    deleting still work. A spec whose record would pass the size cap is refused before any write."""
    c = faults_cluster
    submit(c, name="hist", model="m")
    for i in range(60):  # rolling settings only: no new generation, nothing restarts
        submit(c, name="hist", model="m", max_surge=i + 1)
    w = get(c, "hist").workload
    assert len(w.history) == 50 and dict(w.history_dropped) == {"Submitted": 1, "Updated": 10}
    assert [h.reason for h in w.history] == ["replicas/rolling settings only"] * 50
    resp = call(c, lambda s: s.ScaleWorkload, workload_pb2.ScaleWorkloadRequest(name="hist", replicas=0))
    assert isinstance(resp, workload_pb2.SubmitWorkloadResponse)
    wait_for(lambda: not get(c, "hist").instances, 60, "hist scaled to 0")
    w = get(c, "hist").workload
    assert len(w.history) == 50 and w.history[-1].phase == "Scaled to 0"
    assert dict(w.history_dropped) == {"Submitted": 1, "Updated": 11}
    with pytest.raises(grpc.RpcError) as err:
        submit(c, name="hist", model="m", env={"BIG": "x" * (1 << 20)})
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "over the 1048576-byte limit" in (err.value.details() or ""), err.value.details()
    after = get(c, "hist").workload
    assert (after.generation, len(after.history), after.spec.replicas) == (w.generation, 50, 0)
    call(c, lambda s: s.DeleteWorkload, workload_pb2.DeleteWorkloadRequest(name="hist"))
    wait_for(lambda: "hist" not in names(c), 60, "hist deleted")


def names(cluster: LocalCluster) -> list[str]:
    resp = call(cluster, lambda s: s.ListWorkloads, workload_pb2.ListWorkloadsRequest())
    assert isinstance(resp, workload_pb2.ListWorkloadsResponse)
    return [w.workload.spec.name for w in resp.workloads]


BIG_ENV = {f"KUNLUN_TEST_PAD_{i}": "p" * (110 << 10) for i in range(8)}
"""About 0.9 MiB of spec (each value under Linux's 128 KiB limit for one environment string)."""


def test_a_node_full_of_large_specs_still_gets_its_assignments(
    faults_cluster: LocalCluster, tmp_path: Path
) -> None:
    """Five instances of one workload with a 0.9 MiB spec on one 8-device node: an assignment set
    with the spec in every item (4.5 MiB) passed gRPC's default 4 MiB limit, so the agent dropped
    the stream on every push and never started them. The set carries each distinct spec once, and
    both ends of the agent channel use the same limits."""
    c = faults_cluster
    config = tmp_path / "node-x.yaml"
    text = (EXAMPLES / "hygon-k100-x8.yaml").read_text()
    text = text.replace("name: dcu-01", "name: node-x").replace(
        "address: dcu-01.cluster.local", "address: 127.0.0.1\n  simulated: true"
    )
    config.write_text(text)
    argv = [a for a in c.agent_argv(config, "node-x") if not a.startswith("--state-dir=")]
    agent = ManagedProcess(
        "agent-node-x", [*argv, f"--state-dir={tmp_path / 'state'}"], tmp_path / "agent.log"
    )
    agent.start()
    try:
        wait_for(lambda: c.node_ready("node-x"), 60, "node-x registered")
        submit(c, name="wide", model="m", replicas=5, preferred_device_types=["hygon"], env=BIG_ENV)

        def started() -> int:
            events = engine_ledger.read(engine_ledger.ledger_path(tmp_path / "state"))
            return len({e["instance"] for e in events if e["event"] == "start"})

        wait_for(lambda: started() == 5, 120, "5 engines started on node-x")
        assert "RESOURCE_EXHAUSTED" not in agent.log_text() and "larger than max" not in agent.log_text()
        # the API too: `workload describe` (gRPC's default 4 MiB here) gets the spec once, in the
        # workload, not again in each instance placed with that same spec
        s = get(c, "wide")
        assert len(s.instances) == 5 and not any(i.HasField("spec") for i in s.instances)
        assert dict(s.workload.spec.env) == BIG_ENV
    finally:
        call(c, lambda s: s.DeleteWorkload, workload_pb2.DeleteWorkloadRequest(name="wide"))
        try:
            wait_for(lambda: not any(d.startswith("node-x/") for d in allocations(c)), 60, "wide removed")
        finally:
            agent.stop()


def test_a_viewer_sees_no_secret_through_the_instances(faults_cluster: LocalCluster) -> None:
    """A viewer's `workload describe`/`list` redacts env values and secret arguments in the
    workload's spec, in the specs its instances were placed with (set by rolling updates) and in
    the launch commands their nodes reported: those two once carried every secret in clear."""
    c = faults_cluster
    secret = "hf_do_not_show_4711"
    submit(c, name="sec", model="m", env={"HF_TOKEN": secret}, engine_args=["--api-key", secret])
    wait_for(lambda: running_on(c, "sec", "node-"), 120, "sec Running")
    # a new generation whose engine takes 5 s to serve: the old instance (its own spec) stays meanwhile
    new_args = ["--api-key", secret, "--startup-delay", "5"]
    submit(c, name="sec", model="m", env={"HF_TOKEN": secret + "x"}, engine_args=new_args)
    addr = next(iter(c.replica_addrs.values()))

    def as_viewer() -> bytes:
        with c.channel(addr, role="viewer", name="viewer") as ch:
            stub = workload_pb2_grpc.WorkloadServiceStub(ch)
            one = stub.GetWorkload(workload_pb2.GetWorkloadRequest(name="sec"), timeout=10)
            every = stub.ListWorkloads(workload_pb2.ListWorkloadsRequest(), timeout=10)
            page = stub.ListWorkloads(workload_pb2.ListWorkloadsRequest(page_size=10), timeout=10)
            assert any(i.HasField("spec") for i in one.instances), "an instance of the old spec"
            return one.SerializeToString() + every.SerializeToString() + page.SerializeToString()

    operator = get(c, "sec")
    seen = as_viewer()
    assert secret.encode() not in seen and REDACTED.encode() in seen
    assert any(i.spec.env.get("HF_TOKEN") == secret for i in operator.instances if i.HasField("spec"))
