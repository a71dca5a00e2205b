"""Revoked *server* certificates on one live cluster: agents, gateways and the CLI leave a replica
whose certificate is revoked and use another (grpc-python shows a client no server certificate,
so each client checks the serial with a TLS handshake of its own: kunlun_common/server_check.py).
And the replicas' etcd client certificate: rotated, reloaded on SIGHUP, the old one revoked at etcd."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from controlplane.cli.client import Client, CliError
from controlplane.cli.config import ClientConfig
from controlplane.store import EtcdStore, StoreSettings
from devcluster.cluster import LocalCluster
from devcluster.procs import wait_for
from kunlun_common.api import (
    cluster_pb2,
    cluster_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    workload_pb2,
    workload_pb2_grpc,
)
from kunlun_common.errors import KunlunError
from kunlun_common.pki import CertPaths, certificate_serial, etcd_client_paths, paths_for
from tests.conftest import FAST_TMP, start_cluster
from tests.sched_helpers import placed
from tests.test_cluster_serving import running
from tests.test_trust_lifecycle import _config, _serial_at, cli


@pytest.fixture(scope="module")
def sr_cluster() -> Iterator[LocalCluster]:
    base = Path(tempfile.mkdtemp(prefix="kunlun-server-revocation-", dir=FAST_TMP))
    c = start_cluster(base, gateways=1)
    try:
        yield c
    finally:
        c.stop()
        shutil.rmtree(base, ignore_errors=True)


SECRET_ENV = "s3cr3t-env-value-4f9a1c"
SECRET_ARG = "s3cr3t-arg-value-7b2e8d"


def test_secret_values_never_reach_a_log_file_nor_the_audit_log(sr_cluster: LocalCluster) -> None:
    """A workload with a secret env value and a secret engine argument runs; no log file of the
    cluster (replicas, agents, gateways, etcd) and no audit entry holds either value."""
    c = sr_cluster
    spec = workload_pb2.WorkloadSpec(
        name="secretive",
        model="m",
        replicas=1,
        env={"HF_TOKEN": SECRET_ENV},
        engine_args=["--api-key", SECRET_ARG],
    )
    with c.channel(c.replica_addrs["replica-1"]) as ch:
        workload_pb2_grpc.WorkloadServiceStub(ch).SubmitWorkload(
            workload_pb2.SubmitWorkloadRequest(spec=spec), timeout=10
        )
    wait_for(lambda: running(c, "secretive", 1), 90, "secretive Running")
    admin = _config(c, "operator", "admin")
    r = cli(admin, "audit", "-o", "json")
    assert r.returncode == 0 and "SubmitWorkload" in r.stdout, r.stderr
    leaks = []
    for path in sorted(c.base.rglob("*.log")):
        text = path.read_text(errors="replace")
        leaks += [f"{path.relative_to(c.base)}: {s}" for s in (SECRET_ENV, SECRET_ARG) if s in text]
    assert SECRET_ENV not in r.stdout and SECRET_ARG not in r.stdout
    assert not leaks, leaks
    with c.channel(c.replica_addrs["replica-1"]) as ch:
        workload_pb2_grpc.WorkloadServiceStub(ch).DeleteWorkload(
            workload_pb2.DeleteWorkloadRequest(name="secretive"), timeout=10
        )


def where(c: LocalCluster, via: str) -> dict[str, str]:
    """Which replica (by name) holds each agent's stream and each gateway's feed, asked of `via`."""
    with c.channel(c.replica_addrs[via]) as ch:
        nodes = cluster_pb2_grpc.ClusterServiceStub(ch).ListNodes(cluster_pb2.ListNodesRequest(), timeout=10)
        gws = gateway_pb2_grpc.GatewayServiceStub(ch).ListGateways(
            gateway_pb2.ListGatewaysRequest(), timeout=10
        )
    out = {n.name: n.connected_replica for n in nodes.nodes if n.connected_replica}
    out.update({g.name: g.replica for g in gws.gateways})
    return out


def test_clients_leave_replicas_whose_certificate_is_revoked(sr_cluster: LocalCluster) -> None:
    c = sr_cluster
    clients = ("node-a", "node-b", "gateway-1")
    wait_for(lambda: set(where(c, "replica-1")) >= set(clients), 60, "agents and the gateway connected")
    before = where(c, "replica-1")
    # keep the replica that holds the fewest clients; revoke the other two, so at least two of
    # the three clients sit on a revoked replica and must move
    load = {r: sum(before[k] == r for k in clients) for r in c.replica_addrs}
    keep = min(load, key=lambda r: (load[r], r))
    victims = sorted(r for r in c.replica_addrs if r != keep)
    assert sum(before[k] in victims for k in clients) >= 2, before
    admin = _config(c, "operator", "admin")
    for v in victims:
        shown = _serial_at(c, c.replica_addrs[v], "replica-ca.crt", "operator", "admin")
        assert shown == f"{certificate_serial(paths_for(c.cert_dir, 'replica', v).cert):x}"
        r = cli(admin, "certs", "revoke", v, "--dir", str(c.cert_dir), "--reason", "test")
        assert r.returncode == 0 and "revoked" in r.stdout, r.stderr

    t0 = time.monotonic()
    wait_for(
        lambda: all(where(c, keep).get(k) == keep for k in clients),
        45,
        f"agents and the gateway on {keep}, the only replica whose certificate is not revoked",
    )
    print(f"\nclients left the revoked replicas after {time.monotonic() - t0:.1f}s: {before} -> {keep}")
    time.sleep(3.0)  # a few more heartbeats and revocation polls: nobody goes back to a victim
    assert all(where(c, keep).get(k) == keep for k in clients)
    logs = {k: c.base / "agents" / k / "agent.log" for k in ("node-a", "node-b")}
    logs["gateway-1"] = c.base / "gateways" / "gateway-1.log"
    for k in clients:
        if before[k] in victims:  # it says why it left
            assert "was revoked" in logs[k].read_text(errors="replace"), k

    # the CLI reads the folder's CRL (beside its CA): it skips the revoked replicas ...
    p = paths_for(c.cert_dir, "operator", "admin")
    eps = tuple(c.replica_addrs[r] for r in (*victims, keep))
    client = Client(ClientConfig(eps, str(p.ca), str(p.cert), str(p.key)))
    who = client.call(lambda s: s.WhoAmI, cluster_pb2.WhoAmIRequest())
    assert who.role == "operator" and client.answered_by == c.replica_addrs[keep]
    # ... and says why when only revoked ones are left
    only = Client(ClientConfig(eps[:2], str(p.ca), str(p.cert), str(p.key)))
    with pytest.raises(CliError, match="revoked"):
        only.call(lambda s: s.WhoAmI, cluster_pb2.WhoAmIRequest())
    # without a revocation list the CLI cannot know (what the CRL adds)
    bare = c.base / "bare-ca"
    bare.mkdir(exist_ok=True)
    for f in ("ca.crt", "replica-ca.crt"):
        shutil.copy(c.cert_dir / f, bare / f)
    blind = Client(ClientConfig(eps[:1], str(bare / "ca.crt"), str(p.cert), str(p.key)))
    assert blind.revoked is None
    blind.call(lambda s: s.WhoAmI, cluster_pb2.WhoAmIRequest())
    assert blind.answered_by == eps[0]


def _status(c: LocalCluster) -> tuple[str, int]:
    resp = c.call_any("ClusterStatus", cluster_pb2.ClusterStatusRequest())
    assert isinstance(resp, cluster_pb2.ClusterStatusResponse)
    return resp.leader, resp.leader_epoch


def _etcd_answers(endpoints: tuple[str, ...], pair: CertPaths) -> bool:
    """Whether etcd at `endpoints` serves a read to a new connection with this client pair."""

    async def read() -> bool:
        store = EtcdStore(
            StoreSettings(
                endpoints,
                str(pair.ca),
                str(pair.cert),
                str(pair.key),
                request_timeout_s=2.0,
                retry_deadline_s=2.0,
            )
        )
        try:
            await store.get("/kunlun/v1/leader")
            return True
        except KunlunError:
            return False
        finally:
            await store.close()

    return asyncio.run(read())


def test_replicas_reload_their_etcd_certificate_on_sighup_and_the_old_one_can_be_revoked(
    sr_cluster: LocalCluster, tmp_path: Path
) -> None:
    c = sr_cluster
    admin = _config(c, "operator", "admin")
    current = etcd_client_paths(c.cert_dir)
    kept = CertPaths(current.ca, tmp_path / "old.crt", tmp_path / "old.key")
    shutil.copy(current.cert, kept.cert)
    shutil.copy(current.key, kept.key)
    old = f"{certificate_serial(current.cert):x}"
    before = _status(c)

    r = cli(admin, "certs", "rotate", str(c.cert_dir), "--name", "etcd-client/kunlun", "-o", "json")
    assert r.returncode == 0, r.stderr
    new = f"{certificate_serial(current.cert):x}"
    assert new != old
    # the old certificate revoked at etcd before the replicas reload: new connections with it fail
    r = cli(admin, "certs", "revoke", old, "--dir", str(c.cert_dir), "--reason", "rotated")
    assert r.returncode == 0, r.stderr
    c.distribute_crl()
    assert not _etcd_answers(c.etcd.endpoints, kept)
    assert _etcd_answers(c.etcd.endpoints, current)

    logs = {name: c.base / "replicas" / f"{name}.log" for name in c.replicas}
    c.reload_certs()  # the bundles again, and SIGHUP
    wait_for(
        lambda: all(
            f"serial={new}" in p.read_text(errors="replace")
            or f'"serial": "{new}"' in p.read_text(errors="replace")
            for p in logs.values()
        ),
        30,
        "every replica reloaded its etcd client certificate",
    )
    wait_for(
        lambda: all(
            "previous client certificate closed" in p.read_text(errors="replace") for p in logs.values()
        ),
        30,
        "every replica closed its old etcd channel",
    )
    assert _status(c) == before, "leadership (leader and fencing epoch) kept through the reload"

    # every connection to etcd made again, now that etcd refuses the old certificate: restart the
    # members one at a time (each keeps the quorum of the other two)
    for m in c.etcd.members:
        m.proc.stop()
        m.proc.start()
        wait_for(lambda m=m: _etcd_answers((m.endpoint,), current), 60, f"{m.name} serving again")

    # each replica still writes (etcd took the new certificate) and reads; the leader's
    # watch-driven loops still place what is submitted; agents' node leases are still refreshed
    for i, (name, addr) in enumerate(c.replica_addrs.items()):
        spec = workload_pb2.WorkloadSpec(name=f"after-{i}", model="m", replicas=1)

        def submitted(addr: str = addr, spec: workload_pb2.WorkloadSpec = spec) -> bool:
            with c.channel(addr) as ch:
                try:
                    workload_pb2_grpc.WorkloadServiceStub(ch).SubmitWorkload(
                        workload_pb2.SubmitWorkloadRequest(spec=spec), timeout=5
                    )
                except grpc.RpcError:
                    return False
            return True

        wait_for(submitted, 30, f"a write through {name}")
    for addr in c.replica_addrs.values():
        with c.channel(addr) as ch:
            stub = workload_pb2_grpc.WorkloadServiceStub(ch)
            for i in range(len(c.replica_addrs)):
                got = stub.GetWorkload(workload_pb2.GetWorkloadRequest(name=f"after-{i}"), timeout=10)
                assert got.workload.spec.name == f"after-{i}"
    wait_for(
        lambda: all(placed(c, f"after-{i}") for i in range(len(c.replica_addrs))),
        60,
        "the leader placed the workloads submitted after the reload",
    )
    assert c.node_ready("node-a") and c.node_ready("node-b")
    assert _etcd_answers(c.etcd.endpoints, current) and not _etcd_answers(c.etcd.endpoints, kept)
