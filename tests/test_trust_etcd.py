"""Only replicas reach etcd: attacks with every other certificate, against a real TLS etcd cluster
with its own CA and RBAC enabled (the `etcd` fixture, set up as the dev launcher does)."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from aetcd import rpc

from controlplane.store import EtcdStore
from controlplane.store.admin import defragment
from devcluster.etcd_cluster import EtcdCluster
from kunlun_common.pki import ETCD_ADMIN, CertPaths, ca_key_dir, etcd_client_paths, paths_for
from tests.conftest import store_settings


def _creds(p: CertPaths, ca: Path) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(ca.read_bytes(), p.key.read_bytes(), p.cert.read_bytes())


async def _etcd(endpoint: str, p: CertPaths, ca: Path, what: str) -> str:
    """Try `what` (put/get/defrag) on one etcd member with certificate `p`; return "ok" or why not."""
    creds = _creds(p, ca)
    host_port = endpoint.split("://", 1)[1]
    async with grpc.aio.secure_channel(host_port, creds) as ch:
        try:
            if what == "put":
                await rpc.KVStub(ch).Put(rpc.PutRequest(key=b"/kunlun/v1/nodes/evil", value=b"x"), timeout=5)
            elif what == "put-outside":
                await rpc.KVStub(ch).Put(rpc.PutRequest(key=b"/elsewhere/x", value=b"x"), timeout=5)
            elif what == "get":
                await rpc.KVStub(ch).Range(rpc.RangeRequest(key=b"/kunlun/v1/nodes/a"), timeout=5)
            elif what == "defrag":
                await rpc.MaintenanceStub(ch).Defragment(rpc.DefragmentRequest(), timeout=20)
            elif what == "member-add":
                await rpc.ClusterStub(ch).MemberAdd(
                    rpc.MemberAddRequest(peerURLs=["https://127.0.0.1:1"], isLearner=True), timeout=5
                )
            return "ok"
        except grpc.aio.AioRpcError as e:
            return f"{e.code().name}: {(e.details() or '')[:80]}"


CLUSTER_CA_CERTS = [
    ("viewer", "viewer"),
    ("agent", "node-a"),
    ("gateway", "gateway-1"),
    ("operator", "admin"),
    ("replica", "replica-1"),
]


@pytest.mark.parametrize(("role", "name"), CLUSTER_CA_CERTS)
@pytest.mark.parametrize("what", ["put", "get"])
async def test_cluster_ca_certificates_cannot_touch_etcd(
    etcd: EtcdCluster, cert_dir: Path, role: str, name: str, what: str
) -> None:
    """The attack from the issue: `etcdctl put` with the viewer's (or an agent's) certificate."""
    p = paths_for(cert_dir, role, name)
    # trusting the etcd CA as an attacker would (it is public), the handshake still fails: etcd
    # does not accept a cluster-CA client certificate
    result = await _etcd(etcd.endpoints[0], p, cert_dir / "etcd-ca.crt", what)
    assert result.startswith("UNAVAILABLE"), f"{role} certificate could {what} on etcd: {result}"


async def test_etcd_member_certificate_has_no_etcd_user(etcd: EtcdCluster, cert_dir: Path) -> None:
    p = paths_for(cert_dir, "etcd", "etcd-2")
    result = await _etcd(etcd.endpoints[0], p, p.ca, "put")
    assert result != "ok" and not result.startswith("UNAVAILABLE"), result


async def test_replica_etcd_user_is_limited_to_the_cluster_prefix(etcd: EtcdCluster, cert_dir: Path) -> None:
    p = etcd_client_paths(cert_dir)
    ep = etcd.endpoints[0]
    assert await _etcd(ep, p, p.ca, "put") == "ok"
    assert await _etcd(ep, p, p.ca, "get") == "ok"
    assert "permission denied" in await _etcd(ep, p, p.ca, "put-outside")
    assert "permission denied" in await _etcd(ep, p, p.ca, "defrag")
    assert not (await _etcd(ep, p, p.ca, "member-add")).startswith("ok")


async def test_admin_certificate_may_defragment(etcd: EtcdCluster, cert_dir: Path) -> None:
    p = etcd_client_paths(cert_dir, ETCD_ADMIN)
    assert await _etcd(etcd.endpoints[0], p, p.ca, "defrag") == "ok"
    await defragment(etcd.endpoints[1], cert_dir)  # the maintenance helper, same certificate


async def test_replica_store_still_sees_member_status(etcd: EtcdCluster, cert_dir: Path) -> None:
    s = EtcdStore(store_settings(cert_dir, etcd.endpoints))
    try:
        statuses = await s.member_statuses()
    finally:
        await s.close()
    assert all(m.healthy for m in statuses), statuses
    assert sum(m.leader for m in statuses) == 1


def test_ca_keys_live_apart_from_the_certificate_folder(cert_dir: Path) -> None:
    assert not [p for p in cert_dir.rglob("*.key") if p.name.endswith("ca.key")]
    keys = sorted(p.name for p in ca_key_dir(cert_dir).iterdir())
    assert keys == ["ca.key", "etcd-ca.key", "replica-ca.key"]
    assert ca_key_dir(cert_dir).stat().st_mode & 0o077 == 0


def test_etcd_members_get_only_their_own_certificate(etcd: EtcdCluster) -> None:
    for m in etcd.members:
        folder = m.data_dir.parent / "certs"
        files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
        # its own key pair, the etcd CA and the revocation list it enforces (public, signed by the CA)
        assert files == ["crl/etcd.crl", "etcd-ca.crt", f"etcd/{m.name}.crt", f"etcd/{m.name}.key"]
