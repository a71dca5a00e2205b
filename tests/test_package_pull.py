"""Agents pull model packages from the cluster store through the replicas (mTLS, chunked, resumable,
every chunk and the whole package verified), keep them in a size-limited node cache with LRU eviction
of unused packages, and obey the cluster's `require_signed_packages` policy on every node.

One cluster for the module: 3 etcd members, 3 replicas keeping packages, agents for node-a and
node-b (3 simulated NVIDIA devices each) that pull at most PULL_RATE_MB MiB/s (so a test can act in
the middle of a pull) into a cache of CACHE_MB MiB. Each test pins its workloads to its own devices.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from controlplane.package_policy import AUDIT_POLICY
from controlplane.store import EtcdStore
from devcluster.cluster import LocalCluster
from devcluster.procs import wait_for
from kunlun_common.api import package_pb2, package_pb2_grpc, workload_pb2
from kunlun_common.modelpkg import PackOptions, load_private_key, pack
from kunlun_common.pki import paths_for
from kunlun_common.tls import channel_credentials, load_tls
from tests.conftest import FAST_TMP, LOG_KEEP, start_cluster, store_settings
from tests.modelpkg_helpers import add_sparse_safetensors, cli, make_keys, make_model
from tests.sched_helpers import get
from tests.test_package_trust import home_for

MIB = 1 << 20
PULL_RATE_MB = 1.5
CACHE_MB = 18
NODE = """schema_version: 1
node: {{name: {name}, address: 127.0.0.1, simulated: true, health_interval_seconds: 1.0}}
devices:
  - device_type: nvidia
    device_ids: [0, 1, 2]
    model: A100-SXM4-40GB
    total_memory_mb: 40960
    hbm_memory_mb: 40960
    fp16_compute_power_tflops: 312
    bf16_compute_power_tflops: 312
    supported_dtypes: [fp16, bf16]
    topology_distance: [[0, 1, 1], [1, 0, 1], [1, 1, 0]]
"""


@pytest.fixture(scope="module")
def pc() -> Iterator[LocalCluster]:
    base = Path(tempfile.mkdtemp(prefix="kunlun-pull-", dir=FAST_TMP))
    decls = []
    for name in ("node-a", "node-b"):
        decls.append(base / f"{name}.yaml")
        decls[-1].write_text(NODE.format(name=name))
    c = start_cluster(
        base,
        node_configs=tuple(decls),
        gateways=0,
        replica_args=(
            f"--package-store-dir={base}/store/{{name}}",
            f"--package-store-quota-bytes={200 * MIB}",
        ),
        agent_args=(
            "--test-engine-fallback",
            "--stop-engines-on-exit",
            "--probe-interval=0.2",
            "--restart-backoff=0.3",
            "--restart-backoff-max=1",
            f"--package-pull-rate-mb={PULL_RATE_MB}",
            f"--package-cache-mb={CACHE_MB}",
        ),
    )
    try:
        yield c
    finally:
        c.stop()
        keep = LOG_KEEP / "test_package_pull"
        shutil.rmtree(keep, ignore_errors=True)
        for log in [*base.glob("replicas/*.log"), *base.glob("agents/*/agent.log")]:
            dest = keep / log.relative_to(base)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(log, dest)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def op(pc: LocalCluster, tmp_path: Path) -> Path:
    return home_for(pc, tmp_path, "operator", "admin")


def make_package(tmp: Path, name: str, extra_bytes: int = 0, key: Path | None = None) -> tuple[Path, str]:
    """A package of the tiny model (plus `extra_bytes` of weights); (file, NAME@sha256:HEX)."""
    model = make_model(tmp / f"model-{name}")
    (model / "name.txt").write_text(name)  # a distinct digest per package
    if extra_bytes:
        add_sparse_safetensors(model, "model-2.safetensors", extra_bytes)
    built = pack(
        PackOptions(model, tmp / f"{name}.kunlunpkg", name=name), load_private_key(key) if key else None
    )
    return built.path, f"{name}@{built.digest}"


def push(home: Path, path: Path) -> dict[str, Any]:
    r = cli("model", "push", str(path), "--quiet", "-o", "json", home=home)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert isinstance(info, dict)
    return info


def submit(home: Path, name: str, ref: str, device: str, *extra: str) -> None:
    r = cli("workload", "submit", "--name", name, "--package", ref, "--device", device, *extra, home=home)
    assert r.returncode == 0, r.stderr


def delete(home: Path, name: str) -> None:
    assert cli("workload", "delete", name, home=home).returncode == 0


def instances(pc: LocalCluster, name: str) -> list[workload_pb2.Instance]:
    return list(get(pc, name).instances)


def phase_is(pc: LocalCluster, name: str, phase: str, n: int = 1) -> bool:
    insts = instances(pc, name)
    return len(insts) == n and all(i.phase == phase for i in insts)


def packages_dir(pc: LocalCluster, node: str) -> Path:
    return pc.base / "agents" / node / "packages"


def pull_record(pc: LocalCluster, node: str, ref: str) -> dict[str, Any]:
    data = json.loads((packages_dir(pc, node) / "pulls" / f"{ref.rsplit(':', 1)[1]}.json").read_text())
    assert isinstance(data, dict)
    return data


# ------------------------------------------------------------------------------------------ tests


def test_a_cut_pull_resumes_from_the_last_verified_chunk_and_the_engine_starts(
    pc: LocalCluster, op: Path, tmp_path: Path
) -> None:
    path, ref = make_package(tmp_path, "resumable", extra_bytes=6 * MIB)
    total = path.stat().st_size
    assert total > 6 * MIB  # more than six chunks
    push(op, path)
    submit(op, "resumable", ref, "node-a/nvidia:0")

    # Progress is visible through the control plane; kill -9 the agent in the middle of the pull.
    seen: list[str] = []

    def mid_pull() -> bool:
        insts = instances(pc, "resumable")
        m = re.search(r"pulling package resumable: (\d+)%", insts[0].reason) if insts else None
        if m:
            seen.append(insts[0].reason)
        return m is not None and 10 <= int(m[1]) < 85

    wait_for(lambda: instances(pc, "resumable")[0].node == "node-a", 180, "resumable placed")
    try:
        wait_for(mid_pull, 60, "the pull to be between 10% and 85%", interval=0.05)
    except TimeoutError:
        raise AssertionError(f"reasons seen: {seen[-3:]}; now: {instances(pc, 'resumable')}") from None
    pc.agents["node-a"].kill()
    hexd = ref.rsplit(":", 1)[1]
    state = json.loads((packages_dir(pc, "node-a") / "pulling" / f"{hexd}.json").read_text())
    verified_at_kill = int(state["verified"])
    assert 0 < verified_at_kill < total and verified_at_kill % MIB == 0, state
    assert "MiB, from replica-" in seen[-1], seen

    pc.start_agent(pc.spec.node_configs[0], "node-a")
    wait_for(lambda: phase_is(pc, "resumable", "Running"), 180, "resumable Running after the restart")
    rec = pull_record(pc, "node-a", ref)
    resumed = [int(x) for x in rec["resumed_at"]]
    assert resumed and resumed[0] >= verified_at_kill, rec
    fetched = int(str(rec["fetched_bytes"]))
    assert total <= fetched < 2 * total, rec  # re-fetched less than the whole package
    assert rec["refused_chunks"] == []
    unpacked = packages_dir(pc, "node-a") / "unpacked" / hexd
    assert (unpacked / ".verified").is_file() and (unpacked / "model" / "model-2.safetensors").is_file()
    assert not list((packages_dir(pc, "node-a") / "pulling").glob(f"{hexd}*")), "no partial left"
    assert not (packages_dir(pc, "node-a") / "pulled" / f"{hexd}.kunlunpkg").exists(), (
        "blob dropped once unpacked"
    )
    delete(op, "resumable")


def test_a_tampered_chunk_is_refused_and_fetched_from_another_holder(
    pc: LocalCluster, op: Path, tmp_path: Path
) -> None:
    path, ref = make_package(tmp_path, "tampered", extra_bytes=3 * MIB)
    info = push(op, path)
    assert sorted(info["holders"]) == ["replica-1", "replica-2"]
    hexd = ref.rsplit(":", 1)[1]
    blob = pc.base / "store" / "replica-1" / "blobs" / f"{hexd}.kunlunpkg"
    data = bytearray(blob.read_bytes())
    data[2 * MIB + 100] ^= 0x01  # chunk 2 of replica-1's copy changes on its disk after the push
    blob.write_bytes(bytes(data))

    # An agent may pull only what its node's assignments name.
    with _agent_channel(pc, "node-b") as ch:
        stub = package_pb2_grpc.PackageServiceStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            next(iter(stub.PullPackage(package_pb2.PullPackageRequest(ref=ref), timeout=10)))
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and "agent:node-b" in str(
            e.value.details()
        )

    submit(op, "tampered", ref, "node-a/nvidia:1")
    wait_for(lambda: phase_is(pc, "tampered", "Running"), 180, "tampered Running (from replica-2)")
    rec = pull_record(pc, "node-a", ref)
    assert [(c["offset"], c["replica"]) for c in rec["refused_chunks"]] == [(2 * MIB, "replica-1")], rec
    assert "SHA-256 does not match" in rec["refused_chunks"][0]["why"]
    assert 2 * MIB in rec["resumed_at"]  # went on from the refused chunk elsewhere
    delete(op, "tampered")


def test_the_cache_limit_evicts_only_packages_no_instance_uses(
    pc: LocalCluster, op: Path, tmp_path: Path
) -> None:
    pa, ref_a = make_package(tmp_path, "evict-a", extra_bytes=5 * MIB)
    pb, ref_b = make_package(tmp_path, "evict-b", extra_bytes=5 * MIB)
    size = pa.stat().st_size
    assert size + 2 * size > CACHE_MB * MIB >= 2 * size  # one unpacked and a pull do not fit together
    push(op, pa)
    push(op, pb)
    unpacked = packages_dir(pc, "node-b") / "unpacked"
    submit(op, "evict-a", ref_a, "node-b/nvidia:0")
    wait_for(lambda: phase_is(pc, "evict-a", "Running"), 180, "evict-a Running")
    submit(op, "evict-b", ref_b, "node-b/nvidia:1")
    wait_for(
        lambda: "package cache full" in (instances(pc, "evict-b") or [workload_pb2.Instance()])[0].reason,
        60,
        "evict-b waiting for room",
    )
    assert (unpacked / ref_a.rsplit(":", 1)[1] / ".verified").is_file(), "a package in use was evicted"
    assert phase_is(pc, "evict-a", "Running")
    delete(op, "evict-a")
    wait_for(lambda: phase_is(pc, "evict-b", "Running"), 180, "evict-b Running once evict-a is gone")
    assert not (unpacked / ref_a.rsplit(":", 1)[1]).exists(), "the unused package was not evicted"
    assert (unpacked / ref_b.rsplit(":", 1)[1] / ".verified").is_file()
    delete(op, "evict-b")


def test_require_signed_packages_is_a_cluster_policy_enforced_on_every_node(
    pc: LocalCluster, op: Path, tmp_path: Path
) -> None:
    viewer = home_for(pc, tmp_path, "viewer", "viewer")
    priv, pub, kid = make_keys(tmp_path / "keys", "release")
    assert cli("model", "trust", "add", str(pub), home=op).returncode == 0
    unsigned, ref_u = make_package(tmp_path, "unsigned")
    revoked, ref_r = make_package(tmp_path, "revoked", key=priv)
    good_priv, good_pub, _ = make_keys(tmp_path / "keys", "good")
    assert cli("model", "trust", "add", str(good_pub), home=op).returncode == 0  # in the cluster only
    good, ref_g = make_package(tmp_path, "good", key=good_priv)
    push(op, unsigned)
    push(op, revoked)
    push(op, good)
    r = cli("model", "policy", "set", "--require-signed-packages", "on", home=viewer)
    assert r.returncode == 1 and "permission denied" in r.stderr
    r = cli("model", "policy", "set", "--require-signed-packages", "on", "-o", "json", home=op)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["require_signed_packages"] is True
    try:
        r = cli("model", "policy", "get", home=viewer)
        assert "require_signed_packages: on" in r.stdout and "operator:admin" in r.stdout
        assert [(a["require_signed_packages"], a["by"]) for a in _audit(pc)] == [(True, "operator:admin")]
        assert (
            cli("model", "trust", "remove", kid, home=op).returncode == 0
        )  # its packages are not trusted now

        submit(op, "unsigned-a", ref_u, "node-a/nvidia:2")  # the same package on each node
        submit(op, "unsigned-b", ref_u, "node-b/nvidia:2")
        submit(op, "revoked", ref_r, "node-a/nvidia:0")
        submit(op, "good", ref_g, "node-b/nvidia:0")  # signed by a key the cluster trusts: it runs
        wait_for(lambda: phase_is(pc, "good", "Running"), 180, "good Running under the policy")
        for name in ("unsigned-a", "unsigned-b", "revoked"):
            wait_for(lambda name=name: phase_is(pc, name, "Failed"), 180, f"{name} Failed")
        for name in ("unsigned-a", "unsigned-b"):
            r = cli("workload", "describe", name, home=op)
            assert r.returncode == 0, r.stderr
            assert "package is unsigned" in r.stdout, r.stdout
        r = cli("workload", "describe", "revoked", home=op)
        assert f"untrusted key {kid}" in r.stdout, r.stdout
        for name in ("unsigned-a", "unsigned-b", "revoked"):
            assert all(i.pid == 0 and not i.endpoint for i in instances(pc, name)), "an engine started"
            delete(op, name)
        delete(op, "good")
    finally:
        assert cli("model", "policy", "set", "--require-signed-packages", "off", home=op).returncode == 0


# ---------------------------------------------------------------------------------------- helpers


def _agent_channel(pc: LocalCluster, node: str) -> grpc.Channel:
    material = load_tls(paths_for(pc.cert_dir, "agent", node), expect_roles=("agent",))
    return grpc.secure_channel(pc.endpoints[0], channel_credentials(material))


def _audit(pc: LocalCluster) -> list[dict[str, object]]:
    async def read() -> list[dict[str, object]]:
        store = EtcdStore(store_settings(pc.cert_dir, tuple(pc.etcd.endpoints)))
        await store.connect()
        try:
            kvs, _ = await store.get_prefix(AUDIT_POLICY)
            return [json.loads(kv.value) for kv in kvs]
        finally:
            await store.close()

    return asyncio.run(read())
