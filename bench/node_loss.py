"""Node loss: from losing an instance's agent to its replacement serving on another node.

`python -m bench.node_loss [--modes kill,stop] [--trials 1]`: on a local cluster with the default
timings (node lease, node_not_ready_grace_seconds, the agents' --disconnect-stop and --stop-grace;
each can be overridden), a 1-replica workload serves on some node; its agent is killed (-9) or
frozen (SIGSTOP). Measured from the signal, on this machine's monotonic clock:

* NotReady: the node shown NotReady (`node list`);
* fenced: the old engine's stop, as its supervisor wrote it in the node's engine ledger;
* moved: the instance placed on another node;
* serving: the first 200 answer of the replacement engine at its endpoint (a completion request);
* overlap: how long the old and the new engine were both alive, from the two nodes' ledgers
  (`node_agent/executor/ledger.py`; both nodes run on this machine, one monotonic clock). Must be 0.

Each figure is printed per trial, then p50/max per mode.
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from bench.common import pct, temp_cluster
from controlplane.scheduler.config import SchedulerConfig
from controlplane.settings import ReplicaSettings
from devcluster.cluster import LocalCluster
from devcluster.procs import wait_for
from kunlun_common.api import cluster_pb2, workload_pb2, workload_pb2_grpc
from node_agent.executor.ledger import OPEN, overlap_s, runs_of
from node_agent.settings import ExecutorSettings


@dataclass
class Trial:
    mode: str
    not_ready_s: float
    fenced_s: float
    moved_s: float
    serving_s: float
    overlap_s: float


_CHANNELS: dict[str, Any] = {}


def _wl(cluster: LocalCluster, fn: str, req: object) -> Any:
    """Call WorkloadService on the first replica that answers (channels kept open: polls stay cheap)."""
    last: Exception | None = None
    for addr in cluster.replica_addrs.values():
        ch = _CHANNELS.get(addr)
        if ch is None:
            ch = _CHANNELS[addr] = cluster.channel(addr)
        try:
            return getattr(workload_pb2_grpc.WorkloadServiceStub(ch), fn)(req, timeout=5)
        except Exception as e:  # another replica may answer
            last = e
    raise RuntimeError(f"no replica answered {fn}: {last}")


def _instance(cluster: LocalCluster) -> workload_pb2.Instance | None:
    s = _wl(cluster, "GetWorkload", workload_pb2.GetWorkloadRequest(name="loss"))
    return s.instances[0] if s.instances else None


def _ready(cluster: LocalCluster) -> dict[str, bool]:
    resp = cluster.call_any("ListNodes", cluster_pb2.ListNodesRequest())
    assert isinstance(resp, cluster_pb2.ListNodesResponse)
    return {n.name: n.ready for n in resp.nodes}


def _answers(endpoint: str) -> bool:
    body = json.dumps({"model": "loss", "prompt": "hi", "max_tokens": 1}).encode()
    req = urllib.request.Request(
        f"http://{endpoint}/v1/completions", body, {"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=2) as r:
            return int(r.status) == 200
    except (urllib.error.URLError, OSError):
        return False


def one_trial(cluster: LocalCluster, mode: str) -> Trial:
    _wl(
        cluster,
        "SubmitWorkload",
        workload_pb2.SubmitWorkloadRequest(
            spec=workload_pb2.WorkloadSpec(
                name="loss", model="m", replicas=1, preferred_device_types=["cambricon", "ascend"]
            )
        ),
    )

    def serving() -> workload_pb2.Instance | None:
        inst = _instance(cluster)
        return inst if inst and inst.phase == "Running" and inst.endpoint else None

    wait_for(serving, 120, "the instance serving")
    inst = serving()
    assert inst is not None
    iid, lost = inst.id, inst.node
    agent = cluster.agents[lost]
    t0 = time.monotonic()
    t0_ns = time.monotonic_ns()
    if mode == "kill":
        agent.kill()
    else:
        agent.pause()
    marks: dict[str, float] = {}
    try:
        deadline = t0 + 80
        while time.monotonic() < deadline and "serving" not in marks:
            now = time.monotonic()
            if "not_ready" not in marks and not _ready(cluster).get(lost, True):
                marks["not_ready"] = now - t0
            cur = _instance(cluster)
            if cur is not None and cur.node and cur.node != lost:
                marks.setdefault("moved", now - t0)
                if cur.phase == "Running" and cur.endpoint and _answers(cur.endpoint):
                    marks["serving"] = time.monotonic() - t0
            time.sleep(0.05)
        runs = runs_of({n: cluster.base / "agents" / n for n in cluster.node_names()}, iid)
        old_stops = [stop for node, _, stop in runs if node == lost and stop < OPEN]
        fenced = (max(old_stops) - t0_ns) / 1e9 if old_stops else float("nan")
        trial = Trial(
            mode,
            marks.get("not_ready", float("nan")),
            fenced,
            marks.get("moved", float("nan")),
            marks.get("serving", float("nan")),
            overlap_s(runs),
        )
    finally:
        if mode == "stop":
            agent.resume()
    if mode == "kill":
        cfg = dict(zip(cluster.node_names(), cluster.spec.node_configs, strict=True))[lost]
        cluster.start_agent(cfg, lost)
    wait_for(lambda: cluster.node_ready(lost), 60, f"{lost} ready again")
    _wl(cluster, "DeleteWorkload", workload_pb2.DeleteWorkloadRequest(name="loss"))
    wait_for(
        lambda: not _wl(cluster, "ListWorkloads", workload_pb2.ListWorkloadsRequest()).workloads,
        60,
        "deleted",
    )
    return trial


def measure(
    modes: list[str], trials: int, lease_s: int, grace_s: float, deadline_s: float, stop_grace_s: float
) -> list[Trial]:
    agent_args = (
        "--test-engine-fallback",
        "--stop-engines-on-exit",
        f"--disconnect-stop={deadline_s:g}",
        f"--stop-grace={stop_grace_s:g}",
    )
    with temp_cluster(node_lease_ttl_s=lease_s, gateways=0, agent_args=agent_args) as cluster:
        cluster.start_agents()
        text = workload_pb2.SchedulerConfigText(yaml=f"node_not_ready_grace_seconds: {grace_s:g}\n")
        _wl(cluster, "SetSchedulerConfig", text)
        print(
            f"node loss, node lease {lease_s}s, node_not_ready_grace_seconds {grace_s:g}s, "
            f"--disconnect-stop {deadline_s:g}s, --stop-grace {stop_grace_s:g}s",
            flush=True,
        )
        print(f"{'mode':>5} {'NotReady':>9} {'fenced':>7} {'moved':>6} {'serving':>8} {'overlap':>8}")
        out = []
        for _ in range(trials):
            for mode in modes:
                t = one_trial(cluster, mode)
                out.append(t)
                print(
                    f"{mode:>5} {t.not_ready_s:8.2f}s {t.fenced_s:6.2f}s {t.moved_s:5.2f}s "
                    f"{t.serving_s:7.2f}s {t.overlap_s:7.3f}s",
                    flush=True,
                )
    for mode in modes:
        vals = [t.serving_s for t in out if t.mode == mode]
        overlap = max(t.overlap_s for t in out if t.mode == mode)
        print(
            f"{mode:>5}: loss -> replacement serving p50 {pct(vals, 50):.2f}s max {max(vals):.2f}s; "
            f"overlap max {overlap:.3f}s (n={len(vals)})"
        )
    return out


def main() -> None:
    ex, sched = ExecutorSettings(), SchedulerConfig()
    lease = ReplicaSettings.__dataclass_fields__["node_lease_ttl_s"].default
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--modes", default="kill,stop", help="kill (-9) and/or stop (SIGSTOP), comma separated")
    ap.add_argument("--trials", type=int, default=1, help="trials per mode")
    ap.add_argument("--lease", type=int, default=lease, help="node lease TTL (s)")
    ap.add_argument("--grace", type=float, default=sched.node_not_ready_grace_seconds)
    ap.add_argument("--deadline", type=float, default=ex.disconnect_stop_s, help="agent --disconnect-stop")
    ap.add_argument("--stop-grace", type=float, default=ex.stop_grace_s, help="agent --stop-grace")
    a = ap.parse_args()
    modes = [m for m in a.modes.split(",") if m]
    if not modes or any(m not in ("kill", "stop") for m in modes):
        ap.error("--modes: expected kill and/or stop")
    measure(modes, a.trials, a.lease, a.grace, a.deadline, a.stop_grace)


if __name__ == "__main__":
    main()
