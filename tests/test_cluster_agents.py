# ruff: noqa: RUF001  (Chinese text is written with its own full-width punctuation)
"""Node agents: failover between replicas, node lease expiry, and bad input at start-up."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from controlplane.cli.config import ClientConfig, write_client_config
from devcluster.cluster import LocalCluster
from devcluster.procs import wait_for
from kunlun_common.api import cluster_pb2, types_pb2
from kunlun_common.pki import paths_for


def nodes(cluster: LocalCluster) -> dict[str, types_pb2.Node]:
    resp = cluster.call_any("ListNodes", cluster_pb2.ListNodesRequest())
    assert isinstance(resp, cluster_pb2.ListNodesResponse)
    return {n.name: n for n in resp.nodes}


def connected_replica(cluster: LocalCluster, node: str) -> str:
    n = nodes(cluster).get(node)
    return n.connected_replica if n is not None and n.ready else ""


def _agent_log(cluster: LocalCluster, node: str) -> str:
    return cluster.agents[node].log_text()


def test_agent_moves_when_its_replica_is_killed(cluster: LocalCluster) -> None:
    wait_for(lambda: connected_replica(cluster, "node-a"), 30, "node-a connected")
    holder = connected_replica(cluster, "node-a")
    cluster.replicas[holder].kill()
    try:
        wait_for(
            lambda: connected_replica(cluster, "node-a") not in ("", holder),
            30,
            "node-a to move to another replica",
        )
        assert nodes(cluster)["node-a"].ready
        assert all(d.status == types_pb2.DEVICE_STATUS_READY for d in nodes(cluster)["node-a"].devices)
    finally:
        cluster.restart_replica(holder)
        wait_for(lambda: cluster.replica_serving(holder), 30, "replica back")


def test_agent_moves_when_its_replica_is_paused(cluster: LocalCluster) -> None:
    wait_for(lambda: connected_replica(cluster, "node-b"), 30, "node-b connected")
    holder = connected_replica(cluster, "node-b")
    proc = cluster.replicas[holder]
    proc.pause()
    try:
        wait_for(
            lambda: connected_replica(cluster, "node-b") not in ("", holder),
            40,
            "node-b to leave the SIGSTOPped replica",
        )
        assert "acknowledged no heartbeat" in _agent_log(
            cluster, "node-b"
        ) or "replica link lost" in _agent_log(cluster, "node-b")
    finally:
        proc.resume()
    assert nodes(cluster)["node-b"].ready


def cli(cluster: LocalCluster, tmp_path: Path, *args: str, lang: str = "") -> str:
    """kunlun-cli as the operator, in the language `lang` (English when empty); its stdout."""
    p = paths_for(cluster.cert_dir, "operator", "admin")
    cfg = tmp_path / "client.yaml"
    write_client_config(cfg, ClientConfig(tuple(cluster.endpoints), str(p.ca), str(p.cert), str(p.key)))
    env = {"KUNLUN_CONFIG": str(cfg), "PATH": "/usr/bin:/bin", **({"LANG": lang} if lang else {})}
    r = subprocess.run(
        [sys.executable, "-m", "controlplane.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_dead_agent_turns_node_not_ready_and_devices_unavailable(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    wait_for(lambda: nodes(cluster)["node-b"].ready, 30, "node-b ready")
    cluster.agents["node-b"].kill()
    wait_for(lambda: not nodes(cluster)["node-b"].ready, 40, "node-b NotReady after its lease expires")
    devs = nodes(cluster)["node-b"].devices
    assert devs and all(d.status == types_pb2.DEVICE_STATUS_UNAVAILABLE for d in devs)
    assert "NotReady" in devs[0].status_reason
    # kunlun-cli device describe: the replica's reason in English, in Chinese under zh_CN; JSON English
    english = "node node-b is NotReady (its agent stopped sending heartbeats)"
    en, zh, js = (
        cli(cluster, tmp_path, "device", "describe", "node-b/cambricon:0", *more, lang=lang)
        for more, lang in (((), ""), ((), "zh_CN.UTF-8"), (("-o", "json"), "zh_CN.UTF-8"))
    )
    assert f"Unavailable: {english}\n" in en and json.loads(js)["status_reason"] == english, (en, js)
    assert "节点 node-b 未就绪（其 agent 已停止发送心跳）\n" in zh and "heartbeats" not in zh, zh
    # the leader recorded the transition
    log = "".join(p.log_text() for p in cluster.replicas.values())
    assert "node readiness changed" in log and "node lease expired" in log
    # and node-a is untouched
    assert nodes(cluster)["node-a"].ready
    cluster.start_agent(cluster.spec.node_configs[1], "node-b")
    wait_for(lambda: nodes(cluster)["node-b"].ready, 40, "node-b Ready again after restart")
    wait_for(
        lambda: all(d.status == types_pb2.DEVICE_STATUS_READY for d in nodes(cluster)["node-b"].devices),
        30,
        "node-b devices Ready again",
    )


def _run(args: list[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=timeout)


def test_replica_config_with_unknown_field_exits_with_one_line(tmp_path: Path, cluster: LocalCluster) -> None:
    cfg = tmp_path / "replica.yaml"
    cfg.write_text(
        f"name: replica-1\ncert_dir: {cluster.cert_dir}\netcd_endpoints: [https://127.0.0.1:1]\nlisen: 127.0.0.1:1\n"
    )
    r = _run(["controlplane.main", "--config", str(cfg)])
    assert r.returncode == 2
    assert "lisen: unknown field; did you mean 'listen'?" in r.stderr and "Traceback" not in r.stderr


def test_replica_with_bad_election_timing_is_refused(cluster: LocalCluster) -> None:
    r = _run(
        [
            "controlplane.main",
            "--name=replica-1",
            f"--cert-dir={cluster.cert_dir}",
            "--etcd-endpoints=https://127.0.0.1:1",
            "--election-ttl=5",
            "--renew-deadline=1",
            "--retry-period=1",
        ]
    )
    assert r.returncode == 2 and "1.2 x retry_period_s" in r.stderr


def test_replica_with_certificate_of_other_role_is_refused(cluster: LocalCluster) -> None:
    r = _run(
        [
            "controlplane.main",
            "--name=viewer",
            f"--cert-dir={cluster.cert_dir}",
            "--etcd-endpoints=https://127.0.0.1:1",
        ]
    )
    assert r.returncode == 2
    assert "does not exist" in r.stderr or "role" in r.stderr


def test_replica_without_etcd_says_so_and_exits(cluster: LocalCluster, tmp_path: Path) -> None:
    cfg = tmp_path / "r.yaml"
    cfg.write_text(
        f"name: replica-1\ncert_dir: {cluster.cert_dir}\netcd_endpoints: [https://127.0.0.1:1]\n"
        "listen: 127.0.0.1:0\netcd_wait_s: 3\n"
    )
    r = _run(["controlplane.main", "--config", str(cfg)])
    assert r.returncode == 1
    assert "unreachable or without quorum" in r.stderr and "waiting for etcd" in r.stderr


def test_agent_config_that_is_not_yaml(cluster: LocalCluster, tmp_path: Path) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("node: [unclosed\n  - x: {\n")
    r = _run(
        [
            "node_agent.main",
            "--config",
            str(cfg),
            "--endpoints",
            cluster.endpoints[0],
            "--cert-dir",
            str(cluster.cert_dir),
        ]
    )
    assert r.returncode == 2 and str(cfg) in r.stderr and "Traceback" not in r.stderr


def test_agent_certificate_decides_the_node(cluster: LocalCluster, tmp_path: Path) -> None:
    text = Path(cluster.spec.node_configs[0]).read_text().replace("name: node-a", "name: node-zz")
    cfg = tmp_path / "node-zz.yaml"
    cfg.write_text(text)
    r = _run(
        [
            "node_agent.main",
            "--config",
            str(cfg),
            "--endpoints",
            cluster.endpoints[0],
            "--cert-dir",
            str(cluster.cert_dir),
        ]
    )
    assert r.returncode == 2 and "node-zz" in r.stderr


def _device(cluster: LocalCluster, name: str) -> types_pb2.Device:
    return next(d for n in nodes(cluster).values() for d in n.devices if d.name == name)


def test_health_flap_reaches_device_list_both_ways(cluster: LocalCluster) -> None:
    from node_agent.plugins.standin.state import update_chip

    state = cluster.base / "agents" / "node-a" / "sim-state.json"
    wait_for(
        lambda: _device(cluster, "node-a/ascend:1").status == types_pb2.DEVICE_STATUS_READY,
        30,
        "ascend:1 Ready",
    )
    update_chip(state, "ascend", 1, health="Critical")
    wait_for(
        lambda: _device(cluster, "node-a/ascend:1").status == types_pb2.DEVICE_STATUS_UNHEALTHY,
        30,
        "ascend:1 Unhealthy",
    )
    assert "Critical" in _device(cluster, "node-a/ascend:1").status_reason
    update_chip(state, "ascend", 1, health="OK")
    wait_for(
        lambda: _device(cluster, "node-a/ascend:1").status == types_pb2.DEVICE_STATUS_READY,
        30,
        "ascend:1 Ready again",
    )
    update_chip(state, "ascend", 2, present=False)
    wait_for(
        lambda: _device(cluster, "node-a/ascend:2").status == types_pb2.DEVICE_STATUS_ERROR,
        30,
        "ascend:2 Error",
    )
    assert "declared but not found by npu-smi" in _device(cluster, "node-a/ascend:2").status_reason
    update_chip(state, "ascend", 2, present=True)
    wait_for(
        lambda: _device(cluster, "node-a/ascend:2").status == types_pb2.DEVICE_STATUS_READY,
        30,
        "ascend:2 back",
    )


def test_wrong_declaration_is_shown_as_error_while_the_rest_serve(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    cfg = tmp_path / "node-c.yaml"
    cfg.write_text(
        "schema_version: 1\n"
        "node: {name: node-c, address: 127.0.0.1, simulated: true}\n"
        "devices:\n"
        "  - {device_type: ascend, device_id: 0, model: 910B, hbm_memory_mb: 32768, supported_dtypes: [fp16],"
        " topology_distance: [0, 1, 2, 2]}\n"
        "  - {device_type: ascend, device_id: 1, model: 910B, hbm_memory_mb: 32768, supported_dtypes: [fp16],"
        " topology_distance: [1, 0, 2, 2]}\n"
        "  - {device_type: ascend, device_id: 2, model: 910B, hbm_memory_mb: 32768, supported_dtypes: [fp16],"
        " topology_distance: [0, 1, 2]}\n"
        "  - {device_type: ascend, device_id: 3, model: 910B, hbm_memory_mb: 32768, supported_dtypes: [fp16],"
        " topology_distance: [2, 2, 1, 0]}\n"
    )
    proc = cluster.start_agent(cfg, "node-c")
    try:
        wait_for(
            lambda: "node-c" in nodes(cluster) and nodes(cluster)["node-c"].ready, 40, "node-c registered"
        )
        wait_for(
            lambda: _device(cluster, "node-c/ascend:0").status == types_pb2.DEVICE_STATUS_READY,
            30,
            "good devices Ready",
        )
        bad = _device(cluster, "node-c/ascend:2")
        assert bad.status == types_pb2.DEVICE_STATUS_ERROR
        assert "4x4" in bad.status_reason and "[0, 1, 2]" in bad.status_reason
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "controlplane.cli.main",
                "--endpoints",
                cluster.endpoints[0],
                "device",
                "list",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env={"KUNLUN_CONFIG": str(_client_config(cluster, tmp_path)), "PATH": "/usr/bin:/bin"},
        )
        line = next(x for x in r.stdout.splitlines() if "node-c/ascend:2" in x)
        assert "Error" in line
    finally:
        proc.kill()


def _client_config(cluster: LocalCluster, tmp_path: Path) -> Path:
    from controlplane.cli.config import ClientConfig, write_client_config
    from kunlun_common.pki import paths_for

    p = paths_for(cluster.cert_dir, "operator", "admin")
    path = tmp_path / "client.yaml"
    write_client_config(path, ClientConfig(tuple(cluster.endpoints), str(p.ca), str(p.cert), str(p.key)))
    return path
