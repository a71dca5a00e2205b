"""Revoked *server* certificates on one live cluster: agents, gateways and the CLI leave a replica
whose certificate is revoked and use another (grpc-python shows a client no server certificate,
so each client checks the serial with a TLS handshake of its own: kunlun_common/server_check.py)."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from controlplane.cli.client import Client, CliError
from controlplane.cli.config import ClientConfig
from devcluster.cluster import LocalCluster
from devcluster.procs import wait_for
from kunlun_common.api import cluster_pb2, cluster_pb2_grpc, gateway_pb2, gateway_pb2_grpc
from kunlun_common.pki import certificate_serial, paths_for
from tests.conftest import FAST_TMP, start_cluster
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
