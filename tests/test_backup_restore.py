"""`kunlun-cli cluster backup|restore` on a real cluster: back up a cluster that serves workloads,
lose etcd entirely, restore into a fresh etcd cluster, and find everything again, placed and running.

One scenario, in order (each step needs the state the previous one left):
1. two workloads Running, an API key and a routing policy; `cluster backup` (etcd endpoints asked
   of the replicas) while it all runs;
2. replicas and etcd stopped, etcd's data deleted; a fresh etcd cluster on the same ports and
   with the same cluster token has the old cluster id but rewound revisions: refused, naming the
   token; a damaged file is refused before etcd is even contacted;
3. a fresh etcd cluster with a new token: restored; a second restore is refused (not empty); an
   interrupted restore (its marker left) is refused without --force, replicas started on it wait,
   and `restore --force` finishes it;
4. replicas started on it: the same workloads (same ids) are placed and Running again, the key
   and policy are there, a new leader leads, and a restore is now refused (replicas running);
5. `restore --force` under the running replicas (the operator's way back to a known state): a
   workload created after the backup is gone and its engine stopped, the backed-up ones keep
   serving on the same devices, the replicas re-elect and the node is Ready again, and no device
   ever ran two engines at once (the agent's engine ledger).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from controlplane import keys
from controlplane.cli.config import ClientConfig, write_client_config
from controlplane.cli.main import main
from controlplane.store import EtcdStore
from devcluster.cluster import EXAMPLES, LocalCluster
from devcluster.etcd_cluster import build_etcd_cluster
from devcluster.procs import stop_all, wait_for
from kunlun_common.api import workload_pb2
from kunlun_common.pki import paths_for
from tests.conftest import FAST_TMP, LOG_KEEP, start_cluster, store_settings
from tests.fault_helpers import events_of, ledger, overlaps
from tests.sched_helpers import get, submit, workloads

CLI = [sys.executable, "-m", "controlplane.cli.main"]


@pytest.fixture(scope="module")
def backup_cluster() -> Iterator[LocalCluster]:
    base = Path(tempfile.mkdtemp(prefix="kunlun-backup-", dir=FAST_TMP))
    c = start_cluster(base, gateways=0, metrics=False, node_configs=(EXAMPLES / "node-a.yaml",))
    try:
        yield c
    finally:
        c.stop()
        keep = LOG_KEEP / "test_backup_restore"
        shutil.rmtree(keep, ignore_errors=True)
        for log in [*base.glob("replicas/*.log"), *base.glob("agents/*/agent.log")]:
            dest = keep / log.relative_to(base)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(log, dest)
        shutil.rmtree(base, ignore_errors=True)


@dataclass
class Run:
    args: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def cli(
    backup_cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> Callable[..., Run]:
    """`kunlun-cli ARGS` in this process (its exit code, stdout and stderr): the same code path as
    the command line without a Python start-up per call. One real process run is in the test too."""
    c = backup_cluster
    config = c.base / "cli.yaml"
    p = paths_for(c.cert_dir, "operator", "admin")
    write_client_config(config, ClientConfig(tuple(c.endpoints), str(p.ca), str(p.cert), str(p.key)))
    monkeypatch.setenv("KUNLUN_CONFIG", str(config))
    monkeypatch.setenv("KUNLUN_ETCD_CERT_DIR", str(c.cert_dir))

    def run(*args: str) -> Run:
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            main(list(args))
        out = capsys.readouterr()
        return Run(args, int(e.value.code or 0), out.out, out.err)

    return run


def ok(r: Run) -> str:
    assert r.returncode == 0, (r.args, r.stdout, r.stderr)
    return r.stdout


def running(c: LocalCluster, name: str) -> workload_pb2.Instance | None:
    insts = get(c, name).instances
    return insts[0] if len(insts) == 1 and insts[0].phase == "Running" and insts[0].endpoint else None


async def _put(c: LocalCluster, key: str, value: bytes) -> None:
    s = EtcdStore(store_settings(c.cert_dir, c.etcd.endpoints))
    try:
        await s.put(key, value)
    finally:
        await s.close()


def fresh_etcd(c: LocalCluster, token: str) -> None:
    """Stop etcd, delete every member's data, and start a new, empty cluster on the same ports."""
    ports = [(m.client_port, m.peer_port) for m in c.etcd.members]
    c.etcd.stop()
    shutil.rmtree(c.base / "etcd")
    c.etcd = build_etcd_cluster(c.base / "etcd", c.cert_dir, ports=ports, token=token)
    c.etcd.start()
    wait_for(c._etcd_healthy, 60, "the fresh etcd cluster to form")


def test_backup_wipe_restore_and_the_cluster_serves_again(
    backup_cluster: LocalCluster, cli: Callable[..., Run]
) -> None:
    c = backup_cluster
    etcd_eps = ",".join(c.etcd.endpoints)
    # ---- 1. a cluster at work, backed up while it runs
    chat = submit(c, name="chat", model="qwen2-0.5b", pin="ascend:0", batch_size=1)
    embed = submit(c, name="embed", model="bge-m3", pin="ascend:1", batch_size=1)
    wait_for(lambda: running(c, "chat") and running(c, "embed"), 90, "both workloads Running")
    before = {n: running(c, n) for n in ("chat", "embed")}
    key = json.loads(ok(cli("gateway", "keys", "create", "team-search", "-o", "json")))
    ok(cli("gateway", "policy", "set", "chat", "least_outstanding"))
    backup = c.base / "cluster.backup"
    r = cli("cluster", "backup", str(backup), "-o", "json")  # etcd endpoints asked of the replicas
    taken = json.loads(ok(r))
    assert "read " in r.stderr and "keys (100%)" in r.stderr  # progress
    assert taken["keys"] > 10 and taken["left_out"].get("leased", 0) >= 3  # leader, replicas, nodes
    assert taken["revision"] > 0 and len(taken["sha256"]) == 64
    assert backup.stat().st_mode & 0o077 == 0
    checked = ok(cli("cluster", "restore", str(backup), "--check"))
    assert "valid" in checked and f"revision {taken['revision']}" in checked

    # ---- 2. etcd lost; the same token again gives the old cluster id with rewound revisions
    stop_all(list(c.replicas.values()))
    fresh_etcd(c, token="kunlun-local")
    r = cli("cluster", "restore", str(backup), "--etcd-endpoints", etcd_eps)
    assert r.returncode == 1 and "ETCD_INITIAL_CLUSTER_TOKEN" in r.stderr, r.stderr
    damaged = c.base / "damaged.backup"
    data = bytearray(backup.read_bytes())
    data[len(data) // 2] ^= 0x20
    damaged.write_bytes(bytes(data))
    proc = subprocess.run(  # the real command line once: exit code and one line on stderr
        [*CLI, "cluster", "restore", str(damaged), "--etcd-endpoints", "https://127.0.0.1:1"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"KUNLUN_ETCD_CERT_DIR": str(c.cert_dir), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 1, proc.stdout
    assert f"{damaged}: header.sha256" in proc.stderr and "use another copy" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr

    # ---- 3. a really new etcd cluster: restored, and only once
    fresh_etcd(c, token="kunlun-restored")
    r = cli("cluster", "restore", str(backup), "--etcd-endpoints", etcd_eps, "-o", "json")
    restored = json.loads(ok(r))
    assert restored["written"] == taken["keys"] - restored["left_out"]
    assert restored["cluster_id"] != taken["cluster_id"]
    assert "wrote " in r.stderr
    r = cli("cluster", "restore", str(backup), "--etcd-endpoints", etcd_eps)
    assert r.returncode == 1 and "already holds" in r.stderr and "--force" in r.stderr, r.stderr
    # an interrupted restore (its marker left behind): replicas started on it wait, and
    # `restore --force` finishes it (what is there is deleted first, then everything written)
    asyncio.run(_put(c, keys.RESTORING, b'{"schema":1}'))
    r = cli("cluster", "restore", str(backup), "--etcd-endpoints", etcd_eps)
    assert r.returncode == 1 and "did not finish" in r.stderr and "--force" in r.stderr, r.stderr
    for name in c.replicas:
        c.restart_replica(name)
    log = c.base / "replicas" / "replica-1.log"
    wait_for(
        lambda: "a restore from backup is writing" in log.read_text(), 60, "replica-1 to wait for the restore"
    )
    assert not c.replica_serving("replica-1")
    again = json.loads(
        ok(
            cli(
                "cluster",
                "restore",
                str(backup),
                "--etcd-endpoints",
                etcd_eps,
                "--force",
                "--quiet",
                "-o",
                "json",
            )
        )
    )
    assert again["written"] == restored["written"] and again["cluster_id"] == restored["cluster_id"]

    # ---- 4. replicas on the restored etcd: the same workloads, placed and Running again
    for name in c.replicas:
        wait_for(lambda n=name: c.replica_serving(n), 60, f"{name} serving")
    wait_for(lambda: all(c.node_ready(n) for n in c.agents), 60, "nodes Ready again")
    assert {w.workload.id for w in workloads(c)} == {chat.id, embed.id}
    wait_for(lambda: running(c, "chat") and running(c, "embed"), 90, "both workloads Running again")
    for n, inst in before.items():
        now = running(c, n)
        assert inst is not None and now is not None
        assert list(now.target_devices) == list(inst.target_devices)
    assert c.leader() in c.replicas
    keys_now = json.loads(ok(cli("gateway", "keys", "list", "-o", "json")))["items"]
    assert [k["id"] for k in keys_now] == [key["id"]]
    policies = json.loads(ok(cli("gateway", "policy", "list", "-o", "json")))["items"]
    assert [(p["workload"], p["policy"]) for p in policies] == [("chat", "least_outstanding")]
    r = cli("cluster", "restore", str(backup), "--etcd-endpoints", etcd_eps)
    assert r.returncode == 1 and "replicas are running" in r.stderr, r.stderr

    # ---- 5. restore --force under the running replicas: back to the backup's state
    extra = submit(c, name="extra", model="qwen2-0.5b", pin="ascend:2", batch_size=1)
    wait_for(lambda: running(c, "extra"), 90, "the workload made after the backup Running")
    extra_iid = get(c, "extra").instances[0].id
    serving = {n: running(c, n) for n in ("chat", "embed")}
    forced = json.loads(
        ok(
            cli(
                "cluster",
                "restore",
                str(backup),
                "--etcd-endpoints",
                etcd_eps,
                "--force",
                "--quiet",
                "-o",
                "json",
            )
        )
    )
    assert forced["written"] == restored["written"], forced
    for name in c.replicas:
        wait_for(lambda n=name: c.replica_serving(n), 60, f"{name} serving after the forced restore")
    wait_for(lambda: all(c.node_ready(n) for n in c.agents), 60, "the node Ready after the forced restore")
    wait_for(lambda: c.leader() in c.replicas, 60, "a leader after the forced restore")
    wait_for(
        lambda: {w.workload.id for w in workloads(c)} == {chat.id, embed.id} != {extra.id},
        60,
        "only the backed-up workloads",
    )
    wait_for(
        lambda: bool(events_of(c, "node-a", extra_iid, "stop")),
        60,
        "the engine of the workload made after the backup stopped",
    )
    wait_for(lambda: running(c, "chat") and running(c, "embed"), 90, "the backed-up workloads Running")
    for n, inst in serving.items():
        now = running(c, n)
        assert inst is not None and now is not None
        assert (now.id, list(now.target_devices)) == (inst.id, list(inst.target_devices)), (n, now, inst)
    assert overlaps(ledger(c, "node-a")) == []
