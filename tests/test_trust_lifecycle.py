"""Certificate lifecycle and audit on one live cluster: `kunlun-cli audit` with its filters, the
`cluster status` expiry warning, `certs revoke` (replicas, agents, etcd) and `certs rotate`
(SIGHUP reload, new serials on new connections, workloads keep serving)."""

from __future__ import annotations

import contextlib
import datetime as dt
import io
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from controlplane.cli.config import ClientConfig, write_client_config
from controlplane.cli.main import main as cli_main
from devcluster.cluster import LocalCluster
from kunlun_common.pki import ClusterCerts, init_cluster_certs, issue, paths_for
from tests.conftest import FAST_TMP, start_cluster

CLI = [sys.executable, "-m", "controlplane.cli.main"]
SHORT_LIVED = "node-b"
"""The agent whose certificate is issued to expire in 10 days (the expiry warning's subject)."""


@pytest.fixture(scope="module")
def lc_cluster() -> Iterator[LocalCluster]:
    base = Path(tempfile.mkdtemp(prefix="kunlun-lifecycle-", dir=FAST_TMP))
    certs = base / "certs"
    init_cluster_certs(certs, ClusterCerts(nodes=("node-a", "node-b")))
    end = dt.datetime.now(dt.UTC) + dt.timedelta(days=10)
    issue(certs, "agent", SHORT_LIVED, not_after=end, overwrite=True)
    c = start_cluster(base, gateways=1)
    try:
        yield c
    finally:
        c.stop()
        import shutil

        shutil.rmtree(base, ignore_errors=True)


def _config(c: LocalCluster, role: str, name: str) -> Path:
    p = paths_for(c.cert_dir, role, name)
    path = c.base / f"cli-{role}-{name}.yaml"
    write_client_config(path, ClientConfig(tuple(c.endpoints), str(p.ca), str(p.cert), str(p.key)))
    return path


def cli(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`kunlun-cli --config CONFIG ARGS` in this process (the same code path as the command, without
    paying an interpreter start per call on a loaded machine)."""
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            cli_main(["--config", str(config), *args])
        except SystemExit as e:
            code = int(e.code or 0)
    return subprocess.CompletedProcess([*CLI, *args], code, out.getvalue(), err.getvalue())


def test_the_installed_command_runs_audit(lc_cluster: LocalCluster) -> None:
    r = subprocess.run(
        [*CLI, "--config", str(_config(lc_cluster, "viewer", "viewer")), "audit", "--since", "1d"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and r.stdout.startswith("TIME (UTC)"), r.stderr


def audit(config: Path, *args: str) -> list[dict[str, object]]:
    r = cli(config, "audit", "-o", "json", *args)
    assert r.returncode == 0, r.stderr
    items: list[dict[str, object]] = json.loads(r.stdout)["items"]
    return items


def test_audit_lists_changes_and_refusals_with_filters(lc_cluster: LocalCluster) -> None:
    admin, viewer = _config(lc_cluster, "operator", "admin"), _config(lc_cluster, "viewer", "viewer")
    t0 = int(time.time() * 1000)
    assert cli(admin, "node", "cordon", "node-a").returncode == 0
    assert cli(admin, "node", "uncordon", "node-a").returncode == 0
    refused = cli(viewer, "node", "cordon", "node-b")
    assert refused.returncode != 0 and "may not call" in refused.stderr
    assert cli(admin, "node", "list").returncode == 0  # reads are not audited

    everything = audit(admin)
    mine = [e for e in everything if int(str(e["at_unix_ms"])) >= t0 - 1000]
    assert [(e["identity"], e["action"], e["object"], e["result"]) for e in mine] == [
        ("operator:admin", "CordonNode", "node-a", "OK"),
        ("operator:admin", "CordonNode", "node-a", "OK"),
        ("viewer:viewer", "CordonNode", "node-b", "PERMISSION_DENIED"),
    ]
    assert all(e["replica"] and e["serial"] for e in mine)
    assert [e["result"] for e in audit(admin, "--identity", "viewer")] == ["PERMISSION_DENIED"]
    assert [e["identity"] for e in audit(admin, "--object", "node-b")] == ["viewer:viewer"]
    assert len(audit(admin, "--object", "node-a", "--identity", "operator:admin")) == 2
    assert audit(admin, "--since", "1h")[-1]["object"] == "node-b"
    future = (dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)).isoformat()
    assert audit(admin, "--since", future) == []
    bad = cli(admin, "audit", "--since", "yesterday-ish")
    assert bad.returncode != 0 and "--since" in bad.stderr
    table = cli(admin, "audit", "--identity", "viewer")
    assert table.returncode == 0 and "PERMISSION_DENIED" in table.stdout and "node-b" in table.stdout


def test_cluster_status_warns_30_days_before_a_component_certificate_expires(
    lc_cluster: LocalCluster,
) -> None:
    admin = _config(lc_cluster, "operator", "admin")
    deadline = time.monotonic() + 60
    while True:  # the agent's certificate is recorded once the agent called a replica
        r = cli(admin, "cluster", "status", "-o", "json")
        assert r.returncode == 0, r.stderr
        status = json.loads(r.stdout)
        seen = {(c["role"], c["name"]) for c in status["certificates"]}
        if ("agent", SHORT_LIVED) in seen or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert ("agent", SHORT_LIVED) in seen
    assert {
        ("agent", "node-a"),
        ("replica", "replica-1"),
        ("etcd", "etcd-1"),
        ("gateway", "gateway-1"),
    } <= seen
    warned = [w for w in status["warnings"] if "certificate" in w]
    assert len(warned) == 1 and f"agent:{SHORT_LIVED}" in warned[0], status["warnings"]
    assert "certs rotate" in warned[0]
    table = cli(admin, "cluster", "status")
    assert table.returncode == 0
    assert f"WARNING: certificate agent:{SHORT_LIVED}" in table.stdout
    assert "days" in table.stdout.split(f"agent:{SHORT_LIVED}", 1)[1].splitlines()[0]


def test_audit_retention_keeps_the_newest_records_within_both_bounds(lc_cluster: LocalCluster) -> None:
    """Runs last in this module: it deletes audit records."""
    import asyncio

    from controlplane import audit, keys
    from controlplane.store import EtcdStore, StoreSettings
    from kunlun_common.pki import etcd_client_paths

    assert audit.to_prune([("a", 5), ("b", 1), ("c", 9)], audit.AuditSettings(max_records=2), now=10) == ["b"]
    day = 86_400_000
    aged = audit.to_prune(
        [("old", 0), ("new", 100 * day)], audit.AuditSettings(max_age_days=90), now=100 * day
    )
    assert aged == ["old"]

    p = etcd_client_paths(lc_cluster.cert_dir)

    async def run() -> tuple[int, int, list[str]]:
        store = EtcdStore(StoreSettings(tuple(lc_cluster.etcd.endpoints), str(p.ca), str(p.cert), str(p.key)))
        try:
            now = int(time.time() * 1000)
            for i in range(3):  # three records from 200 days ago
                rec = {"at_ms": now - 200 * day + i, "identity": "operator:old", "action": "X", "object": "o"}
                await store.put(f"{audit.API}{now - 200 * day + i:013d}-test-{i}", keys.encode(rec))
            before = len(await audit.read_all(store))
            aged_out = await audit.prune(store, audit.AuditSettings(max_records=10_000, max_age_days=90))
            counted_out = await audit.prune(store, audit.AuditSettings(max_records=2, max_age_days=90))
            left = [e.identity for _, e in await audit.read_all(store)]
            return before - aged_out - counted_out, aged_out, left
        finally:
            await store.close()

    remaining, aged_out, left = asyncio.run(run())
    assert aged_out == 3 and remaining == 2 and len(left) == 2 and "operator:old" not in left
