"""`kunlun-cli model trust add|remove|list` and `model push|list|delete` against a real cluster (3 etcd members, 3 replicas):
operators change the list, viewers only read it, every change leaves an audit record in etcd; packages are stored
verified on two replicas' disks, within a quota, with only the index in etcd."""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from controlplane.api.auth import PERMISSIONS
from controlplane.api.package_service import AUDIT_TRUST, TRUST
from controlplane.cli.config import ClientConfig, write_client_config
from controlplane.store import EtcdStore
from devcluster.cluster import LocalCluster
from devcluster.procs import wait_for
from kunlun_common.api import package_pb2
from kunlun_common.modelpkg import PackOptions, load_private_key, pack
from kunlun_common.pki import paths_for
from tests.conftest import FAST_TMP, start_cluster, store_settings
from tests.modelpkg_helpers import add_sparse_safetensors, cli, make_keys, make_model

QUOTA = 12_000_000
# Two small accelerators: the tiny test model (514 MiB minimum at 8 bits) fits only across both.
SMALL_NODE = """schema_version: 1
node: {name: node-a, address: 127.0.0.1, simulated: true}
devices:
  - device_type: ascend
    device_ids: [0, 1]
    model: 310P
    hbm_memory_mb: 512
    supported_dtypes: [fp16, bf16, int8]
    topology_distance: [[0, 1], [1, 0]]
"""


@pytest.fixture(scope="module")
def small_cluster() -> Iterator[LocalCluster]:
    base = Path(tempfile.mkdtemp(prefix="kunlun-trust-", dir=FAST_TMP))
    decl = base / "node-a.yaml"
    decl.write_text(SMALL_NODE)
    c = start_cluster(
        base,
        node_configs=(decl,),
        gateways=0,
        replica_args=(f"--package-store-dir={base}/store/{{name}}", f"--package-store-quota-bytes={QUOTA}"),
    )
    try:
        yield c
    finally:
        c.stop()
        shutil.rmtree(base, ignore_errors=True)


def home_for(cluster: LocalCluster, base: Path, role: str, name: str) -> Path:
    """A HOME whose client config speaks as `role/name`."""
    home = base / f"home-{name}"
    p = paths_for(cluster.cert_dir, role, name)
    cfg = home / ".config" / "kunlun" / "config.yaml"
    cfg.parent.mkdir(parents=True)
    write_client_config(cfg, ClientConfig(tuple(cluster.endpoints), str(p.ca), str(p.cert), str(p.key)))
    return home


def audit_records(cluster: LocalCluster) -> list[dict[str, object]]:
    async def read() -> list[dict[str, object]]:
        store = EtcdStore(store_settings(cluster.cert_dir, cluster.etcd.endpoints))
        await store.connect()
        try:
            kvs, _ = await store.get_prefix(AUDIT_TRUST)
            assert all(kv.key.startswith(AUDIT_TRUST) for kv in kvs)
            left, _ = await store.get_prefix(TRUST)
            return [json.loads(kv.value) for kv in kvs] + [{"trusted_now": len(left)}]
        finally:
            await store.close()

    return asyncio.run(read())


def test_operators_add_and_remove_keys_viewers_only_list(small_cluster: LocalCluster, tmp_path: Path) -> None:
    op = home_for(small_cluster, tmp_path, "operator", "admin")
    viewer = home_for(small_cluster, tmp_path, "viewer", "viewer")
    _, pub, kid = make_keys(tmp_path / "keys", "release")
    r = cli("model", "trust", "add", str(pub), "--name", "release team", "-o", "json", home=op)
    assert r.returncode == 0, r.stderr
    added = json.loads(r.stdout)
    assert added["key_id"] == kid and added["added_by"] == "operator:admin"
    again = cli("model", "trust", "add", str(pub), "-o", "json", home=op)  # idempotent
    assert again.returncode == 0 and json.loads(again.stdout)["added_at_unix_ms"] == added["added_at_unix_ms"]

    r = cli("model", "trust", "list", "-o", "json", home=viewer)
    assert r.returncode == 0, r.stderr
    assert [k["key_id"] for k in json.loads(r.stdout)["items"]] == [kid]
    r = cli("model", "trust", "list", home=viewer)
    assert kid in r.stdout and "release team" in r.stdout

    _, pub2, kid2 = make_keys(tmp_path / "keys", "mallory")
    r = cli("model", "trust", "add", str(pub2), home=viewer)
    assert r.returncode == 1 and "permission denied" in r.stderr and "AddTrustedKey" in r.stderr
    r = cli("model", "trust", "remove", kid, home=viewer)
    assert r.returncode == 1 and "permission denied" in r.stderr

    bad = tmp_path / "bad.pub"
    bad.write_text("-----BEGIN PUBLIC KEY-----\nnot a key\n-----END PUBLIC KEY-----\n")
    r = cli("model", "trust", "add", str(bad), home=op)
    assert r.returncode == 1 and "invalid argument" in r.stderr and "public_key_pem" in r.stderr
    r = cli("model", "trust", "remove", "ed25519:0000000000000000", home=op)
    assert r.returncode == 1 and "not found" in r.stderr

    r = cli("model", "trust", "remove", kid, home=op)
    assert r.returncode == 0, r.stderr
    r = cli("model", "trust", "list", "-o", "json", home=op)
    assert json.loads(r.stdout)["items"] == []
    records = audit_records(small_cluster)
    assert [(a.get("op"), a.get("key_id"), a.get("by")) for a in records[:-1]] == [
        ("add", kid, "operator:admin"),
        ("remove", kid, "operator:admin"),
    ]
    assert records[-1] == {"trusted_now": 0}
    assert kid2 not in json.dumps(records)  # the refused call changed nothing


def test_every_package_method_has_a_role_rule() -> None:
    svc = package_pb2.DESCRIPTOR.services_by_name["PackageService"]
    for m in svc.methods:
        assert f"/kunlun.v1.PackageService/{m.name}" in PERMISSIONS, m.name


def test_push_list_delete_two_verified_copies_and_a_quota(
    small_cluster: LocalCluster, tmp_path: Path
) -> None:
    op = home_for(small_cluster, tmp_path, "operator", "admin")
    priv, pub, kid = make_keys(tmp_path / "keys", "store")
    assert cli("model", "trust", "add", str(pub), home=op).returncode == 0
    model = make_model(tmp_path / "tiny")
    good = pack(PackOptions(model, tmp_path / "tiny.kunlunpkg"), load_private_key(priv))
    r = cli("model", "push", str(good.path), "--quiet", "-o", "json", home=op)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert (
        info["digest"] == good.digest
        and info["signed_by"] == kid
        and info["size_bytes"] == good.path.stat().st_size
    )
    assert sorted(info["holders"]) == ["replica-1", "replica-2"]
    hexd = good.digest.removeprefix("sha256:")
    store = small_cluster.base / "store"
    for rep in ("replica-1", "replica-2"):
        assert (store / rep / "blobs" / f"{hexd}.kunlunpkg").read_bytes() == good.path.read_bytes()
    assert not list(store.glob("*/tmp/*")), "no partial upload left"
    r = cli("model", "list", "-o", "json", home=op)
    assert [p["ref"] for p in json.loads(r.stdout)["items"]] == [f"tiny@{good.digest}"]

    # Refused at the door, nothing stored: a flipped bit, an untrusted signer, a package past the quota.
    bad = tmp_path / "bad.kunlunpkg"
    data = bytearray(good.path.read_bytes())
    data[len(data) // 2] ^= 1
    bad.write_bytes(bytes(data))
    r = cli("model", "push", str(bad), "--quiet", home=op)
    assert r.returncode == 1 and "package refused" in r.stderr and "SHA-256" in r.stderr
    other, _, other_kid = make_keys(tmp_path / "other", "mallory")
    by_other = pack(PackOptions(model, tmp_path / "o.kunlunpkg", name="tiny-other"), load_private_key(other))
    r = cli("model", "push", str(by_other.path), "--quiet", home=op)
    assert r.returncode == 1 and f"untrusted key {other_kid}" in r.stderr
    big_model = make_model(tmp_path / "big")
    add_sparse_safetensors(big_model, "model-2.safetensors", 10_000_000)
    big = pack(PackOptions(big_model, tmp_path / "big.kunlunpkg"), None)
    r = cli("model", "push", str(big.path), "--quiet", home=op)
    assert r.returncode == 1 and "quota" in r.stderr, r.stderr
    r = cli("model", "list", "-o", "json", home=op)
    assert [p["name"] for p in json.loads(r.stdout)["items"]] == ["tiny"]
    assert sorted(p.name for p in store.glob("*/blobs/*")) == sorted(
        [f"{hexd}.chunks", f"{hexd}.kunlunpkg"] * 2
    )

    viewer = home_for(small_cluster, tmp_path, "viewer", "viewer")
    r = cli("model", "delete", f"tiny@{good.digest}", home=viewer)
    assert r.returncode == 1 and "permission denied" in r.stderr
    r = cli("model", "delete", f"tiny@{good.digest}", home=op)
    assert r.returncode == 0, r.stderr
    assert json.loads(cli("model", "list", "-o", "json", home=op).stdout)["items"] == []
    assert not list(store.glob("*/blobs/*"))
    r = cli("model", "delete", f"tiny@{good.digest}", home=op)
    assert r.returncode == 1 and "no package" in r.stderr


def test_submit_checks_a_package_against_the_devices_and_writes_nothing(
    small_cluster: LocalCluster, tmp_path: Path
) -> None:
    op = home_for(small_cluster, tmp_path, "operator", "admin")
    wait_for(lambda: len(small_cluster.devices()) == 2, 60, "node-a's 2 devices registered")
    model = make_model(tmp_path / "tiny")
    w8 = pack(PackOptions(model, tmp_path / "w8.kunlunpkg", name="tiny-w8", quantization="w8a8"), None)
    r = cli("model", "push", str(w8.path), "--quiet", home=op)
    assert r.returncode == 0, r.stderr
    ref = f"tiny-w8@{w8.digest}"
    r = cli("workload", "submit", "--package", ref, home=op)
    assert r.returncode == 1
    assert (
        "quantization: w8a8 is in no candidate device's supported_dtypes (they offer bf16, fp16, int8)"
        in r.stderr
    )
    assert "memory: the package needs 514 MiB per device and the largest candidate has 512 MiB" in r.stderr
    r = cli("workload", "submit", "--package", "tiny-w8@sha256:" + "0" * 64, home=op)
    assert r.returncode == 1 and "is not in the cluster store" in r.stderr
    r = cli("workload", "submit", "--package", ref, "--preferred-device-types", "nvidia", home=op)
    assert r.returncode == 1 and "devices: no device of type nvidia" in r.stderr
    assert json.loads(cli("workload", "list", "-o", "json", home=op).stdout)["items"] == []  # nothing written
    # Split over two devices and run at int8: every check passes. A dry run says where, writes nothing.
    r = cli(
        "workload", "submit", "--package", ref, "--quantization", "int8", "--devices-per-instance", "2",
        "--dry-run", "-o", "json", home=op,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    dry = json.loads(r.stdout)
    assert dry["result"] == "dry-run"
    assert dry["plan"][0].startswith("instance 0: node-a/ascend:0, node-a/ascend:1 (score")
    r = cli("workload", "submit", "--package", ref, "--quantization", "int8", "--devices-per-instance", "2",
            "--replicas", "2", "--dry-run", home=op)  # fmt: skip
    assert r.returncode == 0 and "instance 1: not placed now (node-a:" in r.stdout, r.stdout
    assert json.loads(cli("workload", "list", "-o", "json", home=op).stdout)["items"] == []
    r = cli(
        "workload", "submit", "--package", ref, "--quantization", "int8", "--devices-per-instance", "2",
        "-o", "json", home=op,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["spec"]["package"] == ref
    assert cli("workload", "delete", "tiny-w8", home=op).returncode == 0
    assert cli("model", "delete", ref, home=op).returncode == 0
