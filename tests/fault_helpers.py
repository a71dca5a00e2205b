"""Shared by the placement-safety cluster tests (test_placement_safety, test_cp_faults,
test_node_faults): the module-scoped fault cluster, restoring it between tests, and judging engine
overlap from the nodes' engine ledgers (every start and stop event), never from the final state."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from devcluster.cluster import LocalCluster
from devcluster.procs import wait_for
from kunlun_common.api import cluster_pb2
from tests.conftest import FAST_TMP, LOG_KEEP, start_cluster
from tests.sched_helpers import delete_all, get


def fencing_agent_args(deadline_s: float, stop_grace_s: float) -> tuple[str, ...]:
    """Agent flags of a cluster with short fencing numbers: engines fence themselves `deadline_s`
    (+ 1 s slack) after the agent's last acknowledged heartbeat and get `stop_grace_s` to stop."""
    return (
        "--test-engine-fallback",
        "--stop-engines-on-exit",
        f"--disconnect-stop={deadline_s:g}",
        "--ack-timeout=1.5",  # + heartbeat 0.5 + failover 1 <= the deadline: one frozen replica
        "--heartbeat-interval=0.5",  # must not stop the engines
        f"--stop-grace={stop_grace_s:g}",
    )


@contextmanager
def fault_cluster(keep_as: str, **spec: Any) -> Iterator[LocalCluster]:
    """A whole local cluster (ClusterSpec fields in `spec`) in a fresh folder; on exit it is stopped,
    its replica, agent and gateway logs are kept under $TMPDIR/kunlun-test-logs/<keep_as>/ for
    post-mortems, and the folder is removed."""
    base = Path(tempfile.mkdtemp(prefix=f"kunlun-{keep_as}-", dir=FAST_TMP))
    c = start_cluster(base, **spec)
    try:
        yield c
    finally:
        c.stop()
        keep = LOG_KEEP / keep_as
        shutil.rmtree(keep, ignore_errors=True)
        logs = [*base.glob("replicas/*.log"), *base.glob("agents/*/agent.log"), *base.glob("gateways/*")]
        for log in logs:
            dest = keep / log.relative_to(base)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(log, dest)
        shutil.rmtree(base, ignore_errors=True)


def restore(c: LocalCluster) -> None:
    """Undo what a test did to the processes (etcd members, replicas and agents resumed or started
    again), wait until every replica serves and every node is Ready, then delete every workload."""
    for m in c.etcd.members:
        if not m.proc.alive():
            m.proc.start()
    for name, proc in c.replicas.items():
        proc.resume()
        if not proc.alive():
            c.restart_replica(name)
    for node, cfg in zip(c.node_names(), c.spec.node_configs, strict=True):
        proc = c.agents[node]
        proc.resume()
        if not proc.alive():
            c.start_agent(cfg, node)
    for name in c.replicas:
        wait_for(lambda n=name: c.replica_serving(n), 60, f"{name} serving again")
    for node in c.node_names():
        wait_for(lambda n=node: c.node_ready(n), 60, f"{node} ready again")
    delete_all(c)


# ------------------------------------------------------------------------------- engine ledgers


def ledger(cluster: LocalCluster, node: str) -> list[dict[str, Any]]:
    """A node's engine ledger (its agent's state folder), oldest event first."""
    path = cluster.base / "agents" / node / "ledger" / "engines.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def all_events(cluster: LocalCluster) -> list[dict[str, Any]]:
    return [e for n in cluster.node_names() for e in ledger(cluster, n)]


def events_of(cluster: LocalCluster, node: str, iid: str, event: str) -> list[dict[str, Any]]:
    """The `event` ("start" or "stop") events of one instance in a node's ledger."""
    return [e for e in ledger(cluster, node) if e["instance"] == iid and e["event"] == event]


def engine_run(cluster: LocalCluster, node: str, iid: str) -> dict[str, Any]:
    """The ledger's last start event of an instance on a node."""
    starts = events_of(cluster, node, iid, "start")
    assert starts, f"no engine start of {iid} in {node}'s ledger"
    return starts[-1]


def intervals(events: list[dict[str, Any]]) -> list[tuple[str, str, list[str], int, int]]:
    """(node, instance, devices, start_ns, stop_ns) per engine run; a run without a stop is open."""
    open_runs: dict[tuple[str, str, int], dict[str, Any]] = {}
    out = []
    for e in sorted(events, key=lambda e: e["mono_ns"]):
        key = (e["node"], e["instance"], e["pid"])
        if e["event"] == "start":
            open_runs[key] = e
        elif key in open_runs:
            s = open_runs.pop(key)
            out.append((s["node"], s["instance"], s["devices"], s["mono_ns"], e["mono_ns"]))
    for s in open_runs.values():
        out.append((s["node"], s["instance"], s["devices"], s["mono_ns"], 2**63))
    return out


def overlaps(events: list[dict[str, Any]], per_instance: Callable[[str], bool] = lambda _: True) -> list[str]:
    """Pairs of engine runs alive at once on one device, or (for the instances `per_instance` picks:
    every one by default) of one instance."""
    runs = intervals(events)
    bad = []
    for i, a in enumerate(runs):
        for b in runs[i + 1 :]:
            same = a[1] == b[1] and per_instance(a[1])
            if a[3] < b[4] and b[3] < a[4] and (same or set(a[2]) & set(b[2])):
                bad.append(f"{a[1]}@{a[0]} {a[2]} overlaps {b[1]}@{b[0]} {b[2]}")
    return bad


# ------------------------------------------------------------------------------- cluster views


def log_events(path: Path, event: str) -> list[dict[str, Any]]:
    """JSON log lines of one process whose `event` is `event`, oldest first."""
    out = []
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    for line in text.splitlines():
        if event in line:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("event") == event:
                out.append(rec)
    return out


def agent_log(c: LocalCluster, node: str) -> Path:
    return c.base / "agents" / node / "agent.log"


def stream_holder(c: LocalCluster, node: str) -> str:
    """The replica (name) the node's agent registered with last."""
    regs = log_events(agent_log(c, node), "registered with replica")
    assert regs, f"{node} never registered"
    return str(regs[-1]["replica_name"])


def leader(c: LocalCluster) -> str:
    try:
        return c.leader()
    except RuntimeError:
        return ""


def nodes_ready(cluster: LocalCluster) -> dict[str, bool]:
    resp = cluster.call_any("ListNodes", cluster_pb2.ListNodesRequest())
    assert isinstance(resp, cluster_pb2.ListNodesResponse)
    return {n.name: n.ready for n in resp.nodes}


def running_on(cluster: LocalCluster, name: str, prefix: str) -> bool:
    """Every instance of workload `name` Running on devices whose names start with `prefix`."""
    s = get(cluster, name)
    return bool(s.instances) and all(
        i.phase == "Running" and all(t.startswith(prefix) for t in i.target_devices) for i in s.instances
    )
