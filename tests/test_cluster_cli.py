"""`kunlun-cli` against a real cluster, role checks, and refused connections."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from controlplane.api.auth import PERMISSIONS
from controlplane.cli.config import ClientConfig, write_client_config
from devcluster.cluster import LocalCluster
from devcluster.procs import wait_for
from kunlun_common.api import (
    agent_pb2,
    agent_pb2_grpc,
    cluster_pb2,
    cluster_pb2_grpc,
    gateway_pb2,
    types_pb2,
    workload_pb2,
)
from kunlun_common.pki import ClusterCerts, init_cluster_certs, issue, paths_for
from kunlun_common.tls import channel_credentials, load_tls

CLI = [sys.executable, "-m", "controlplane.cli.main"]


@pytest.fixture(scope="module")
def cli_config(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    p = paths_for(cluster.cert_dir, "operator", "admin")
    path = tmp_path_factory.mktemp("cli") / "config.yaml"
    write_client_config(path, ClientConfig(tuple(cluster.endpoints), str(p.ca), str(p.cert), str(p.key)))
    wait_for(
        lambda: all(d.status == types_pb2.DEVICE_STATUS_READY for d in cluster.devices()),
        60,
        "all devices Ready",
    )
    yield path


def run_cli(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={"KUNLUN_CONFIG": str(config), "PATH": "/usr/bin:/bin"},
    )


def test_device_list_json_shows_all_seven_ready(cli_config: Path) -> None:
    r = run_cli(cli_config, "device", "list", "-o", "json")
    assert r.returncode == 0, r.stderr
    items = json.loads(r.stdout)["items"]
    assert sorted(d["name"] for d in items) == [
        "node-a/ascend:0",
        "node-a/ascend:1",
        "node-a/ascend:2",
        "node-a/ascend:3",
        "node-b/cambricon:0",
        "node-b/cambricon:1",
        "node-b/nvidia:0",
    ]
    assert all(d["status"] == "Ready" for d in items), [(d["name"], d["status_reason"]) for d in items]
    a0 = next(d for d in items if d["name"] == "node-a/ascend:0")
    assert a0["hbm_memory_mb"] == 32768 and isinstance(a0["hbm_memory_mb"], int)
    assert a0["topology_distance"] == [0, 1, 2, 2] and a0["p2p_enabled"] is True
    assert a0["model"] == "910B" and a0["device_type"] == "ascend"
    assert isinstance(a0["temperature_c"], float | int) and a0["temperature_c"] > 0


def test_device_list_table(cli_config: Path) -> None:
    r = run_cli(cli_config, "device", "list")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split() == [
        "NODE",
        "DEVICE",
        "TYPE",
        "STATUS",
        "MEMORY",
        "UTILIZATION",
        "TEMPERATURE",
        "TOPOLOGY",
    ]
    assert len(lines) == 8
    assert "node-a/ascend:0" in lines[1] and "Ready" in lines[1] and "/32768 MB" in lines[1]


def test_device_describe_and_unknown_device(cli_config: Path) -> None:
    r = run_cli(cli_config, "device", "describe", "node-b/nvidia:0", "-o", "json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["name"] == "node-b/nvidia:0" and d["node_ready"] is True and d["model"] == "A100-SXM4-40GB"
    r = run_cli(cli_config, "device", "describe", "node-b/nvidia:7")
    assert r.returncode == 1 and "not found" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = run_cli(cli_config, "device", "describe", "garbage")
    assert r.returncode == 1 and "<node>/<type>:<index>" in r.stderr


def test_cluster_status_json(cli_config: Path, cluster: LocalCluster) -> None:
    r = run_cli(cli_config, "cluster", "status", "-o", "json")
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)
    leaders = [x for x in st["replicas"] if x["leader"] is True]
    assert len(leaders) == 1 and leaders[0]["name"] == st["leader"]
    assert all(x["healthy"] is True and isinstance(x["pid"], int) for x in st["replicas"])
    assert {x["pid"] for x in st["replicas"]} == {p.pid for p in cluster.replicas.values()}
    assert len(st["etcd_members"]) == 3 and all(m["healthy"] for m in st["etcd_members"])

    def gateways() -> list[dict[str, object]]:
        out = run_cli(cli_config, "cluster", "status", "-o", "json")
        return list(json.loads(out.stdout)["gateways"])

    wait_for(lambda: len(gateways()) == 3, 30, "3 gateways listed")
    assert {g["pid"] for g in gateways()} == {p.pid for p in cluster.gateways.values()}
    assert all(g["healthy"] is True and g["address"] for g in gateways())


def test_node_list(cli_config: Path) -> None:
    r = run_cli(cli_config, "node", "list", "-o", "json")
    nodes = {n["name"]: n for n in json.loads(r.stdout)["items"]}
    assert set(nodes) == {"node-a", "node-b"}
    assert nodes["node-a"]["ready"] is True and nodes["node-a"]["devices"] == 4 and nodes["node-a"]["pid"] > 0
    assert nodes["node-a"]["updated_by"] == "agent:node-a"


def test_cli_fails_over_to_a_live_endpoint(cli_config: Path, cluster: LocalCluster, tmp_path: Path) -> None:
    dead = "127.0.0.1:1"
    r = run_cli(cli_config, "--endpoints", f"{dead},{cluster.endpoints[1]}", "device", "list", "-o", "json")
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["items"]) == 7


def test_cli_errors_are_one_line(cli_config: Path, tmp_path: Path) -> None:
    r = run_cli(cli_config, "--endpoints", "127.0.0.1:1,127.0.0.1:2", "--timeout", "1", "device", "list")
    assert r.returncode == 1
    assert "no replica answered" in r.stderr and "127.0.0.1:1" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = run_cli(tmp_path / "missing.yaml", "device", "list")
    assert r.returncode == 1 and "no client config" in r.stderr and "make demo" in r.stderr


def _stub(
    cluster: LocalCluster, role: str, name: str, cert_dir: Path | None = None
) -> tuple[grpc.Channel, cluster_pb2_grpc.ClusterServiceStub]:
    creds = channel_credentials(load_tls(paths_for(cert_dir or cluster.cert_dir, role, name)))
    ch = grpc.secure_channel(
        cluster.endpoints[0], creds, options=[("grpc.ssl_target_name_override", "localhost")]
    )
    return ch, cluster_pb2_grpc.ClusterServiceStub(ch)


def test_roles_from_certificates(cluster: LocalCluster) -> None:
    ch, stub = _stub(cluster, "viewer", "viewer")
    with ch:
        assert len(stub.ListDevices(cluster_pb2.ListDevicesRequest(), timeout=10).devices) == 7
        who = stub.WhoAmI(cluster_pb2.WhoAmIRequest(), timeout=10)
        assert (who.identity, who.role) == ("viewer", "viewer")
    for role, name in (("agent", "node-a"), ("gateway", "gateway-1")):
        ch, stub = _stub(cluster, role, name)
        with ch, pytest.raises(grpc.RpcError) as e:
            stub.ListDevices(cluster_pb2.ListDevicesRequest(), timeout=10)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert f"{role}:{name} may not call ListDevices" in (e.value.details() or "")
    log = "".join(p.log_text() for p in cluster.replicas.values())
    assert "refused call" in log and "gateway:gateway-1" in log


def _register(cluster: LocalCluster, role: str, name: str, node: str) -> grpc.RpcError:
    creds = channel_credentials(load_tls(paths_for(cluster.cert_dir, role, name)))
    with grpc.secure_channel(
        cluster.endpoints[0], creds, options=[("grpc.ssl_target_name_override", "localhost")]
    ) as ch:
        reg = agent_pb2.RegisterNode(node=node, address="127.0.0.1")
        call = agent_pb2_grpc.AgentServiceStub(ch).Connect(
            iter([agent_pb2.AgentMessage(register=reg)]), timeout=10
        )
        with pytest.raises(grpc.RpcError) as e:
            list(call)
        return e.value


def test_agent_may_only_speak_for_its_own_node(cluster: LocalCluster) -> None:
    err = _register(cluster, "agent", "node-x", "node-a")
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "certificate is for node 'node-x'" in (err.details() or "")
    assert cluster.node_ready("node-a")
    err = _register(cluster, "gateway", "gateway-1", "node-a")
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    err = _register(cluster, "operator", "admin", "node-a")
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED


def test_connections_without_valid_certs_are_refused(cluster: LocalCluster, tmp_path: Path) -> None:
    # no client certificate at all
    ca = (cluster.cert_dir / "replica-ca.crt").read_bytes()
    creds = grpc.ssl_channel_credentials(root_certificates=ca)
    with grpc.secure_channel(cluster.endpoints[0], creds) as ch:
        with pytest.raises(grpc.RpcError) as e:
            cluster_pb2_grpc.ClusterServiceStub(ch).ListDevices(cluster_pb2.ListDevicesRequest(), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    # a certificate from another CA
    init_cluster_certs(tmp_path, ClusterCerts())
    ch, stub = _stub(cluster, "operator", "admin", cert_dir=tmp_path)
    with ch, pytest.raises(grpc.RpcError) as e:
        stub.ListDevices(cluster_pb2.ListDevicesRequest(), timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_every_served_method_has_a_role_rule() -> None:
    served = {
        f"/kunlun.v1.{svc.name}/{m.name}"
        for mod in (cluster_pb2, agent_pb2, workload_pb2, gateway_pb2)
        for svc in mod.DESCRIPTOR.services_by_name.values()
        for m in svc.methods
    }
    assert served <= set(PERMISSIONS), served - set(PERMISSIONS)


def test_expired_and_wrong_role_certificates_are_refused_at_load(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    import datetime as dt

    from kunlun_common.errors import ConfigError

    d = tmp_path / "c"
    init_cluster_certs(d, ClusterCerts())
    past = dt.datetime.now(dt.UTC) - dt.timedelta(days=10)
    p = issue(d, "operator", "old", not_before=past, not_after=past + dt.timedelta(days=1))
    with pytest.raises(ConfigError, match="expired"):
        load_tls(p)
    with pytest.raises(ConfigError, match="needs a certificate with role replica"):
        load_tls(paths_for(d, "viewer", "viewer"), expect_roles=("replica",))
