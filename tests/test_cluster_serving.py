"""Serving through the three gateways of a real cluster: a gateway dies under a round-robin client,
and a leader dies in the middle of a rollout."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from controlplane.cli.config import ClientConfig, write_client_config
from devcluster.cluster import LocalCluster
from devcluster.procs import wait_for
from kunlun_common.api import workload_pb2
from kunlun_common.pki import paths_for
from tests.sched_helpers import delete_all, get, submit


@pytest.fixture(autouse=True)
def clean(cluster: LocalCluster) -> Iterator[None]:
    yield
    delete_all(cluster)


def chat(gateway: str, timeout: float = 10.0) -> int:
    body = json.dumps(
        {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    ).encode()
    req = urllib.request.Request(
        f"http://{gateway}/v1/chat/completions", body, {"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except OSError:
        return 0


def running(cluster: LocalCluster, name: str, n: int) -> bool:
    return sum(1 for i in get(cluster, name).instances if i.phase == "Running" and i.endpoint) == n


def test_client_round_robin_over_three_gateways_survives_one_dying(cluster: LocalCluster) -> None:
    submit(cluster, name="chat", model="m", replicas=2)
    wait_for(lambda: running(cluster, "chat", 2), 60, "2 instances Running")
    gateways = list(cluster.gateway_addrs.values())
    wait_for(lambda: all(chat(g) == 200 for g in gateways), 30, "every gateway routes to the workload")
    # a client that round-robins over the three and, like SGLang's round-robin balancer, moves to the
    # next gateway when one refuses the connection
    results: list[int] = []
    skipped = 0
    victim = cluster.gateways["gateway-2"]
    for i in range(300):
        if i == 100:
            victim.kill()
        status = chat(gateways[i % 3])
        if status == 0:
            skipped += 1
            status = chat(gateways[(i + 1) % 3])
        results.append(status)
    assert results == [200] * 300, [s for s in results if s != 200]
    assert 60 <= skipped <= 70  # every request meant for the dead gateway, and nothing else


def test_leader_killed_mid_rollout_the_rollout_finishes(cluster: LocalCluster, tmp_path: Path) -> None:
    submit(cluster, name="chat", model="chat-v1", replicas=1)
    wait_for(lambda: running(cluster, "chat", 1), 60, "baseline Running")
    p = paths_for(cluster.cert_dir, "operator", "admin")
    cfg = tmp_path / "client.yaml"
    write_client_config(cfg, ClientConfig(tuple(cluster.endpoints), str(p.ca), str(p.cert), str(p.key)))

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "controlplane.cli.main", *args],
            capture_output=True,
            text=True,
            timeout=60,
            env={"KUNLUN_CONFIG": str(cfg), "PATH": "/usr/bin:/bin"},
        )

    r = cli(
        "rollout",
        "create",
        "chat",
        "--model",
        "chat-v2",
        "--steps",
        "50,100",
        "--interval",
        "3s",
        "--min-requests",
        "0",
    )
    assert r.returncode == 0, r.stderr
    wait_for(
        lambda: any(i.variant == "canary" for i in get(cluster, "chat").instances), 30, "a canary instance"
    )
    leader = cluster.leader()
    cluster.replicas[leader].kill()

    def phase() -> str:
        out = cli("rollout", "status", "chat", "-o", "json")
        return str(json.loads(out.stdout)["phase"]) if out.returncode == 0 else ""

    wait_for(lambda: phase() == "Completed", 90, "the rollout to finish under a new leader")
    assert cluster.leader() not in ("", leader)
    assert get(cluster, "chat").workload.spec.model == "chat-v2"
    cluster.restart_replica(leader)


def serving(s: workload_pb2.WorkloadSummary) -> int:
    """Instances the gateways route to: Running with an endpoint, not retiring."""
    return sum(1 for i in s.instances if i.phase == "Running" and i.endpoint and not i.retiring)


def test_spec_update_under_traffic_rolls_without_a_failed_request(cluster: LocalCluster) -> None:
    """A spec update replaces the 3 instances one at a time (max_surge 1, max_unavailable 0): every
    request through the gateway succeeds, and at least 3 instances serve at every sample."""
    roll = {"max_surge": 1, "max_unavailable": 0}  # explicit: never below 3, even on a full cluster
    submit(cluster, name="chat", model="m", replicas=3, env={"ROLL": "1"}, **roll)
    wait_for(lambda: running(cluster, "chat", 3), 90, "3 instances Running")
    gateway = next(iter(cluster.gateway_addrs.values()))
    wait_for(lambda: chat(gateway) == 200, 30, "the gateway routes to the workload")
    before = {i.id for i in get(cluster, "chat").instances}
    w = submit(cluster, name="chat", model="m", replicas=3, env={"ROLL": "2"}, **roll)
    assert w.generation == 2
    statuses: list[int] = []
    samples: list[int] = []
    progress: set[str] = set()
    deadline = time.monotonic() + 240  # generous: engines start slowly on a loaded machine
    done = False
    for n in range(20000):  # bounded in count and in time
        statuses.append(chat(gateway))
        if n % 4 == 0:
            s = get(cluster, "chat")
            samples.append(serving(s))
            if s.rolling:
                progress.add(s.rolling.split(" serving")[0])
            fresh = [i for i in s.instances if i.generation == 2 and i.id not in before]
            done = len(s.instances) == 3 and len(fresh) == 3 and serving(s) == 3
            if done or time.monotonic() > deadline:
                break
    failed = [s for s in statuses if s != 200]
    assert not failed, f"{len(failed)} of {len(statuses)} requests failed: {sorted(set(failed))}"
    assert min(samples) >= 3, samples
    last = get(cluster, "chat")
    assert done, (
        f"the roll did not finish: {last.rolling} {[(i.id, i.phase, i.reason) for i in last.instances]}"
    )
    assert len(samples) >= 10
    # describe showed the way: "rolling: 0/3 updated" ... at least one intermediate step
    assert any(p.startswith("rolling: 1/3") or p.startswith("rolling: 2/3") for p in progress), progress
