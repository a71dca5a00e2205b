"""Placement safety against a real cluster: the node grace measured by the leader, engines that
fence themselves when their agent is frozen or killed, the device handoff on one node, and the
fencing inequality checked where its numbers enter. Overlap is judged from the engine ledgers."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from devcluster.cluster import LocalCluster
from devcluster.procs import pid_alive, wait_for
from kunlun_common.api import workload_pb2
from tests.fault_helpers import (
    all_events,
    events_of,
    fault_cluster,
    fencing_agent_args,
    ledger,
    nodes_ready,
    overlaps,
    restore,
    running_on,
)
from tests.sched_helpers import call, get, set_config, submit, targets

LEASE_S, GRACE_S, DEADLINE_S, STOP_GRACE_S = 3, 5.0, 3.0, 3.0


@pytest.fixture(scope="module")
def safe_cluster() -> Iterator[LocalCluster]:
    """Short node lease, deadline and grace: 3 + 1 (slack) + 3 (fenced) < 3 + 5 (moved)."""
    with fault_cluster(
        "test_placement_safety",
        node_lease_ttl_s=LEASE_S,
        gateways=0,
        agent_args=fencing_agent_args(DEADLINE_S, STOP_GRACE_S),
    ) as c:
        set_config(c, f"node_not_ready_grace_seconds: {GRACE_S:g}\n")
        yield c


@pytest.fixture(autouse=True)
def clean(safe_cluster: LocalCluster) -> Iterator[None]:
    yield
    restore(safe_cluster)


def _lose_agent(cluster: LocalCluster, how: str) -> None:
    """The agent of the instance's node frozen (SIGSTOP) or killed (-9) while its engine serves: no
    move before the grace (on the leader's clock), and the old engine ends by itself before the new
    one starts on the other node."""
    submit(cluster, name="svc", model="m", preferred_device_types=["cambricon", "ascend"], replicas=1)
    wait_for(lambda: running_on(cluster, "svc", "node-"), 120, "svc Running")
    inst = get(cluster, "svc").instances[0]
    iid, lost = inst.id, inst.node
    other = next(n for n in cluster.node_names() if n != lost)
    old = events_of(cluster, lost, iid, "start")[-1]
    assert pid_alive(old["pid"])
    agent = cluster.agents[lost]
    if how == "stop":
        agent.pause()
    else:
        agent.kill()
    try:
        wait_for(lambda: not nodes_ready(cluster)[lost], 30, f"{lost} NotReady")
        not_ready_at = time.monotonic()
        wait_for(lambda: not targets(cluster, "svc")[0].startswith(f"{lost}/"), 40, "svc moved")
        moved_after = time.monotonic() - not_ready_at
        # the leader waited the grace from when it saw the lease gone (test polling adds lag, not less)
        assert moved_after >= GRACE_S - 1.0, f"moved {moved_after:.1f}s after NotReady, grace {GRACE_S}s"
        reasons = [h.reason for i in get(cluster, "svc").instances for h in i.history]
        assert any("NotReady" in r and "as seen by this leader" in r for r in reasons), reasons
        wait_for(lambda: running_on(cluster, "svc", f"{other}/"), 120, f"svc Running on {other}")
        # the old engine stopped by itself (its agent is frozen or dead) and before the new one started
        stops = events_of(cluster, lost, iid, "stop")
        assert stops and "fenced" in stops[-1]["cause"], stops
        assert not pid_alive(old["pid"])
        new = events_of(cluster, other, iid, "start")
        assert new and stops[-1]["mono_ns"] < new[-1]["mono_ns"]
        assert stops[-1]["boot_id"] == new[-1]["boot_id"]
        assert overlaps(all_events(cluster)) == []
    finally:
        if how == "stop":
            agent.resume()


def test_frozen_agent_engine_fences_itself_before_the_move(safe_cluster: LocalCluster) -> None:
    _lose_agent(safe_cluster, "stop")


def test_killed_agent_engine_fences_itself_before_the_move(safe_cluster: LocalCluster) -> None:
    _lose_agent(safe_cluster, "kill")


def test_available_engine_keeps_serving_without_contact(safe_cluster: LocalCluster) -> None:
    """`fencing: available`: a frozen agent's engine is not fenced. It still serves past the
    disconnect deadline while its replacement starts elsewhere (the trade-off that setting states),
    and the agent stops it once it is back and learns the instance moved."""
    c = safe_cluster
    submit(
        c,
        name="avail",
        model="m",
        preferred_device_types=["cambricon", "ascend"],
        replicas=1,
        fencing="available",
    )
    wait_for(lambda: running_on(c, "avail", "node-"), 120, "avail Running")
    inst = get(c, "avail").instances[0]
    iid, lost = inst.id, inst.node
    other = next(n for n in c.node_names() if n != lost)
    old = events_of(c, lost, iid, "start")[-1]
    agent = c.agents[lost]
    paused_at = time.monotonic()
    agent.pause()
    try:
        wait_for(lambda: not nodes_ready(c)[lost], 30, f"{lost} NotReady")
        wait_for(lambda: running_on(c, "avail", f"{other}/"), 120, f"avail Running on {other}")
        # a strict engine would have fenced itself by now: the fence counts from the last ack before
        # the pause (deadline + slack + stop grace), and the move came after lease + grace
        assert time.monotonic() - paused_at > DEADLINE_S + 1 + STOP_GRACE_S
        assert pid_alive(old["pid"]), "the available engine was stopped without contact"
        assert not events_of(c, lost, iid, "stop")
    finally:
        agent.resume()
    wait_for(lambda: not pid_alive(old["pid"]), 60, "the old engine stopped once its agent is back")
    # the supervisor stamps the stop after the engine is reaped and its cgroup removed
    wait_for(lambda: events_of(c, lost, iid, "stop"), 30, "the old engine's stop in the ledger")
    stops = events_of(c, lost, iid, "stop")
    assert "fenced" not in stops[-1]["cause"], stops


def test_device_handoff_waits_for_the_old_engine(safe_cluster: LocalCluster) -> None:
    """Delete and resubmit onto the same device while the old engine ignores SIGTERM for 2.5 s:
    the new engine starts only once the old one is gone, and says what it waits for meanwhile."""
    c = safe_cluster
    spec: dict[str, Any] = {"model": "m", "preferred_device_types": ["nvidia"], "replicas": 1}
    submit(c, name="slow", engine_args=["--ignore-sigterm", "2.5"], **spec)
    wait_for(lambda: running_on(c, "slow", "node-b/nvidia"), 120, "slow Running")
    device = targets(c, "slow")[0]
    # "next" waits for that very device, so it is placed on the tick that frees it: the old engine
    # is still in its SIGTERM grace when the assignment reaches the agent
    submit(c, name="next", pin=device, model="m", replicas=1)
    wait_for(lambda: bool(get(c, "next").instances), 30, "next queued")
    call(c, lambda s: s.DeleteWorkload, workload_pb2.DeleteWorkloadRequest(name="slow"))
    seen: list[str] = []

    def started() -> bool:
        s = get(c, "next")
        seen.extend(i.reason for i in s.instances)
        return running_on(c, "next", "node-b/nvidia")

    wait_for(started, 120, "next Running")
    assert targets(c, "next") == [device]
    assert any(r.startswith(f"waiting for device {device}") for r in seen), set(seen)
    assert overlaps(ledger(c, "node-b")) == []


def test_ledger_is_readable_through_the_control_plane(safe_cluster: LocalCluster, tmp_path: Path) -> None:
    from controlplane.cli.config import ClientConfig, write_client_config
    from kunlun_common.pki import paths_for

    c = safe_cluster
    submit(c, name="led", model="m", preferred_device_types=["ascend"], replicas=1)
    wait_for(lambda: running_on(c, "led", "node-a/"), 120, "led Running")
    iid = get(c, "led").instances[0].id
    p = paths_for(c.cert_dir, "operator", "admin")
    cfg = tmp_path / "config.yaml"
    write_client_config(cfg, ClientConfig(tuple(c.endpoints), str(p.ca), str(p.cert), str(p.key)))
    r = subprocess.run(
        [sys.executable, "-m", "controlplane.cli.main", "node", "engines", "node-a", "-o", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"KUNLUN_CONFIG": str(cfg), "PATH": "/usr/bin:/bin"},
    )
    assert r.returncode == 0, r.stderr
    items = json.loads(r.stdout)["items"]
    assert items == ledger(c, "node-a")
    mine = [e for e in items if e["instance"] == iid]
    assert mine[-1]["event"] == "start" and mine[-1]["devices"] == targets(c, "led")
    assert set(mine[-1]) == {
        "event",
        "node",
        "instance",
        "devices",
        "pid",
        "wall_ms",
        "mono_ns",
        "boot_id",
        "cause",
    }
    bad = subprocess.run(
        [sys.executable, "-m", "controlplane.cli.main", "node", "engines", "Bad_Node"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"KUNLUN_CONFIG": str(cfg), "PATH": "/usr/bin:/bin"},
    )
    assert bad.returncode == 1 and "not a valid node name" in bad.stderr


def test_grace_below_the_fencing_budget_is_refused(safe_cluster: LocalCluster) -> None:
    with pytest.raises(grpc.RpcError) as err:
        set_config(safe_cluster, "node_not_ready_grace_seconds: 1\n")
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    msg = err.value.details() or ""
    assert "disconnect deadline 4s + stop grace 3s = 7s" in msg and "= 4s" in msg, msg
    text = _config_text(safe_cluster)  # the stored grace is unchanged
    assert f"node_not_ready_grace_seconds: {GRACE_S:g}\n" in text


def _config_text(cluster: LocalCluster) -> str:
    resp = call(cluster, lambda s: s.GetSchedulerConfig, workload_pb2.SchedulerConfigRequest())
    assert isinstance(resp, workload_pb2.SchedulerConfigText)
    return resp.yaml


def test_agent_refuses_a_deadline_shorter_than_a_restart(safe_cluster: LocalCluster) -> None:
    argv = safe_cluster.agent_argv(safe_cluster.spec.node_configs[0], "node-a")
    r = subprocess.run([*argv, "--disconnect-stop=1"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "shorter than an agent restart" in r.stderr, r.stderr
    r = subprocess.run(
        [*argv, "--disconnect-stop=35", "--stop-grace=10"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2 and "35s + fence check slack 1s + --stop-grace 10s = 46s" in r.stderr, r.stderr
