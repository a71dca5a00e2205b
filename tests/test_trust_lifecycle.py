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
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from controlplane.cli.config import ClientConfig, write_client_config
from controlplane.cli.main import main as cli_main
from devcluster.cluster import LocalCluster
from devcluster.procs import wait_for
from kunlun_common.api import (
    agent_pb2,
    agent_pb2_grpc,
    cluster_pb2,
    cluster_pb2_grpc,
    security_pb2,
    security_pb2_grpc,
    workload_pb2,
    workload_pb2_grpc,
)
from kunlun_common.pki import ClusterCerts, certificate_serial, init_cluster_certs, issue, paths_for
from kunlun_common.tls import channel_credentials, load_tls, server_certificate
from tests.conftest import FAST_TMP, start_cluster
from tests.prom_helpers import scrape, tls_context
from tests.sched_helpers import get, submit
from tests.test_cluster_serving import chat, running

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
    settings = base / "replica-audit.yaml"  # the leader enforces audit retention every second
    settings.write_text("audit:\n  prune_interval_s: 1\n")
    c = start_cluster(base, gateways=1, replica_args=(f"--config={settings}",))
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

    # each change's record was committed in the change's own transaction: same etcd revision
    cordon_rev, records = _cordon_and_audit_revisions(lc_cluster, "node-a")
    assert ("CordonNode", "node-a", "OK") in records.get(cordon_rev, []), (cordon_rev, records)
    refused_at = [r for r, es in records.items() if ("CordonNode", "node-b", "PERMISSION_DENIED") in es]
    assert refused_at and cordon_rev not in refused_at

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


def _cordon_and_audit_revisions(
    c: LocalCluster, node: str
) -> tuple[int, dict[int, list[tuple[str, str, str]]]]:
    import asyncio

    from controlplane import audit, keys
    from controlplane.store import EtcdStore, StoreSettings
    from kunlun_common.pki import etcd_client_paths

    p = etcd_client_paths(c.cert_dir)

    async def read() -> tuple[int, dict[int, list[tuple[str, str, str]]]]:
        store = EtcdStore(StoreSettings(tuple(c.etcd.endpoints), str(p.ca), str(p.cert), str(p.key)))
        try:
            kv = await store.get(keys.cordon(node))
            assert kv is not None
            kvs, _ = await store.get_prefix(audit.API)
        finally:
            await store.close()
        out: dict[int, list[tuple[str, str, str]]] = {}
        for a in kvs:
            e = audit.entry_of(a.value)
            if e is not None:
                out.setdefault(a.mod_revision, []).append((e.action, e.object, e.result))
        return kv.mod_revision, out

    return asyncio.run(read())


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


def _channel(
    c: LocalCluster, role: str, name: str, address: str, server_role: str = "replica"
) -> grpc.Channel:
    creds = channel_credentials(load_tls(paths_for(c.cert_dir, role, name)), server_role=server_role)
    return grpc.secure_channel(address, creds)


def _code(fn: Callable[[], object]) -> grpc.StatusCode:
    try:
        fn()
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def _wait_code(fn: Callable[[], object], want: grpc.StatusCode, what: str, deadline_s: float = 20.0) -> float:
    """Poll until `fn` ends with status `want`; return how long it took."""
    t0 = time.monotonic()
    wait_for(lambda: _code(fn) == want, deadline_s, what)
    return time.monotonic() - t0


def _etcd_get(c: LocalCluster, user: str) -> bool:
    import asyncio

    from controlplane.store import EtcdStore, StoreSettings
    from kunlun_common.errors import KunlunError
    from kunlun_common.pki import etcd_client_paths

    p = etcd_client_paths(c.cert_dir, user)

    async def get() -> bool:
        settings = StoreSettings(
            tuple(c.etcd.endpoints), str(p.ca), str(p.cert), str(p.key), retry_deadline_s=2.0
        )
        store = EtcdStore(settings)
        try:
            await store.get("/kunlun/v1/leader-state")
            return True
        except KunlunError:
            return False
        finally:
            await store.close()

    return asyncio.run(get())


def test_revoked_certificates_are_refused_by_replicas_agents_gateways_and_etcd(
    lc_cluster: LocalCluster,
) -> None:
    c = lc_cluster
    admin = _config(c, "operator", "admin")
    for role, name in (
        ("viewer", "revokee"),
        ("agent", "node-z"),
        ("replica", "replica-9"),
        ("monitoring", "prom-2"),
    ):
        issue(c.cert_dir, role, name)
    replica = c.replica_addrs["replica-1"]
    nodes = c.call_any("ListNodes", cluster_pb2.ListNodesRequest())
    assert isinstance(nodes, cluster_pb2.ListNodesResponse)
    node_a = next(n.node_service for n in nodes.nodes if n.name == "node-a")
    whoami = cluster_pb2.WhoAmIRequest()
    viewer_ch = _channel(c, "viewer", "revokee", replica)
    agent_ch = _channel(c, "agent", "node-z", replica)
    replica_ch = _channel(c, "replica", "replica-9", node_a, server_role="agent")
    prom = tls_context(c.cert_dir, "monitoring", "prom-2")
    metrics = [c.metrics_addrs["agent-node-a"], c.metrics_addrs["gateway-1"]]
    calls: dict[str, Callable[[], object]] = {
        "viewer WhoAmI": lambda: cluster_pb2_grpc.ClusterServiceStub(viewer_ch).WhoAmI(whoami, timeout=5),
        "agent ListRevocations": lambda: security_pb2_grpc.SecurityServiceStub(agent_ch).ListRevocations(
            security_pb2.ListRevocationsRequest(), timeout=5
        ),
        "replica cert at node-a's NodeService": lambda: agent_pb2_grpc.NodeServiceStub(replica_ch).Engines(
            agent_pb2.EnginesRequest(), timeout=5
        ),
    }
    for what, fn in calls.items():
        assert _code(fn) == grpc.StatusCode.OK, what
    assert [scrape(a, prom)[0] for a in metrics] == [200, 200]
    assert _etcd_get(c, "kunlun-admin")
    stream = workload_pb2_grpc.WorkloadServiceStub(viewer_ch).WatchEndpoints(
        workload_pb2.WatchEndpointsRequest(), timeout=60
    )
    next(iter(stream))  # the first snapshot: the stream is open

    full_9 = f"{certificate_serial(paths_for(c.cert_dir, 'replica', 'replica-9').cert):x}"
    prom_serial = f"{certificate_serial(paths_for(c.cert_dir, 'monitoring', 'prom-2').cert):x}"
    # by name without the folder: found among the certificates the replicas saw in use
    r = cli(admin, "certs", "revoke", "viewer/revokee", "--reason", "test")
    assert r.returncode == 0 and "revoked viewer/revokee" in r.stdout, r.stderr
    for target in ("node-z", "etcd-client/kunlun-admin"):  # by name from the folder, which rewrites the CRL
        r = cli(admin, "certs", "revoke", target, "--dir", str(c.cert_dir), "--reason", "test")
        assert r.returncode == 0, r.stderr
        assert "revoked" in r.stdout and "crl/etcd.crl" in r.stdout
    for serial in (full_9, prom_serial):
        r = cli(admin, "certs", "revoke", serial, "-o", "json")
        assert r.returncode == 0 and json.loads(r.stdout)["serial"] == serial.lstrip("0"), r.stderr
    bad = cli(admin, "certs", "revoke", "no-such-cert", "--dir", str(c.cert_dir))
    assert bad.returncode != 0 and "no certificate named" in bad.stderr

    took = {what: _wait_code(fn, grpc.StatusCode.UNAUTHENTICATED, what) for what, fn in calls.items()}
    with pytest.raises(grpc.RpcError) as cut:
        for _ in stream:
            pass
    assert cut.value.code() == grpc.StatusCode.UNAUTHENTICATED and "revoked" in (cut.value.details() or "")
    wait_for(
        lambda: [scrape(a, prom)[0] for a in metrics] == [403, 403],
        20,
        "exporters refuse the revoked scraper",
    )
    detail = ""
    try:
        calls["viewer WhoAmI"]()
    except grpc.RpcError as e:
        detail = str(e)
    assert "was revoked" in detail
    print(f"\nrevocation enforced after: {', '.join(f'{k} {v:.1f}s' for k, v in took.items())}")

    # etcd reads its CRL on each new connection: the admin certificate is refused, replicas' is not
    c.distribute_crl()
    assert not _etcd_get(c, "kunlun-admin")
    assert _etcd_get(c, "kunlun")
    # everyone else is untouched, and the revocations are in the audit log
    assert (
        _code(
            lambda: cluster_pb2_grpc.ClusterServiceStub(_channel(c, "operator", "admin", replica)).WhoAmI(
                whoami, timeout=5
            )
        )
        == grpc.StatusCode.OK
    )
    objects = {
        e["object"]
        for e in audit(admin, "--identity", "operator:admin")
        if e["action"] == "RevokeCertificate"
    }
    assert {"viewer/revokee", "agent/node-z", "etcd-client/kunlun-admin", full_9.lstrip("0")} <= objects
    for ch in (viewer_ch, agent_ch, replica_ch):
        ch.close()


def _serial_at(c: LocalCluster, address: str, ca: str, role: str, name: str) -> str:
    p = paths_for(c.cert_dir, role, name)
    roots = (c.cert_dir / ca).read_bytes()
    return f"{server_certificate(address, roots, p.cert, p.key).serial_number:x}"


def _file_serial(c: LocalCluster, role: str, name: str) -> str:
    return f"{certificate_serial(paths_for(c.cert_dir, role, name).cert):x}"


def test_rotate_and_sighup_new_connections_get_new_serials_while_serving_continues(
    lc_cluster: LocalCluster,
) -> None:
    """Runs after the revocation test: rotating skips the revoked certificates."""
    c = lc_cluster
    admin = _config(c, "operator", "admin")
    submit(c, name="chat", model="m", replicas=1)
    wait_for(lambda: running(c, "chat", 1), 90, "chat Running")
    gateway = c.gateway_addrs["gateway-1"]
    wait_for(lambda: chat(gateway) == 200, 30, "the gateway routes to chat")
    instance = get(c, "chat").instances[0].id
    pids = {n: p.pid for n, p in c.agents.items()}
    nodes = c.call_any("ListNodes", cluster_pb2.ListNodesRequest())
    assert isinstance(nodes, cluster_pb2.ListNodesResponse)
    node_a = next(n.node_service for n in nodes.nodes if n.name == "node-a")
    # (what is probed, how): the serial a new TLS connection is shown
    probes: dict[str, tuple[str, str, str, str, str]] = {
        "replica-1 gRPC": (
            c.replica_addrs["replica-1"],
            "replica-ca.crt",
            "operator",
            "admin",
            "replica/replica-1",
        ),
        "node-a NodeService": (node_a, "ca.crt", "replica", "replica-2", "agent/node-a"),
        "replica-1 metrics": (
            c.metrics_addrs["replica-1"],
            "replica-ca.crt",
            "monitoring",
            "prometheus",
            "replica/replica-1",
        ),
        "node-a metrics": (
            c.metrics_addrs["agent-node-a"],
            "ca.crt",
            "monitoring",
            "prometheus",
            "agent/node-a",
        ),
        "gateway-1 metrics": (
            c.metrics_addrs["gateway-1"],
            "ca.crt",
            "monitoring",
            "prometheus",
            "gateway/gateway-1",
        ),
        "etcd-1 client port": (
            c.etcd.members[0].endpoint.removeprefix("https://"),
            "etcd-ca.crt",
            "etcd-client",
            "kunlun",
            "etcd/etcd-1",
        ),
    }

    def shown() -> dict[str, str]:
        return {k: _serial_at(c, a, ca, r, n) for k, (a, ca, r, n, _) in probes.items()}

    before = shown()
    assert before == {k: _file_serial(c, *v[4].split("/")) for k, v in probes.items()}

    codes: list[int] = []
    stop = threading.Event()

    def client() -> None:  # a client of the workload all along (bounded: at most 600 requests)
        for _ in range(600):
            if stop.is_set():
                return
            codes.append(chat(gateway))
            time.sleep(0.1)

    t = threading.Thread(target=client)
    t.start()
    try:
        r = cli(admin, "certs", "rotate", str(c.cert_dir), "-o", "json")
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert "viewer/revokee" in out["skipped_revoked"] and "agent/node-z" in out["skipped_revoked"]
        renewed = {f"{i['role']}/{i['name']}" for i in out["items"]}
        assert {v[4] for v in probes.values()} <= renewed and "viewer/revokee" not in renewed
        assert shown() == before, "nothing changes before the components reload"
        c.reload_certs()
        want = {k: _file_serial(c, *v[4].split("/")) for k, v in probes.items()}
        assert not set(want.values()) & set(before.values())
        wait_for(lambda: shown() == want, 30, "new connections shown the new certificates")

        def agent_serial() -> str:
            resp = security_pb2_grpc.SecurityServiceStub(
                _channel(c, "operator", "admin", c.replica_addrs["replica-1"])
            ).ListCertificates(security_pb2.ListCertificatesRequest(), timeout=10)
            return next((x.serial for x in resp.certificates if (x.role, x.name) == ("agent", "node-a")), "")

        # the agent's next connection to a replica presents its new certificate too
        wait_for(
            lambda: agent_serial() == _file_serial(c, "agent", "node-a"),
            30,
            "the agent's new client certificate",
        )
        time.sleep(1.0)  # a few more requests after everything reloaded
    finally:
        stop.set()
        t.join(timeout=30)
    assert codes and set(codes) == {200}, f"{len(codes)} requests: {sorted(set(codes))}"
    assert get(c, "chat").instances[0].id == instance and running(c, "chat", 1)
    assert {n: p.pid for n, p in c.agents.items()} == pids
    assert c.node_ready("node-a") and c.node_ready("node-b")
    print(f"\nrotation: {len(codes)} requests during it, all 200; {len(renewed)} certificates renewed")


def test_audit_retention_keeps_the_newest_records_within_both_bounds(lc_cluster: LocalCluster) -> None:
    """Runs last in this module: it deletes audit records. Records older than the age bound are
    deleted by the leader's loop (every second in this cluster); the count bound by `prune`."""
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

            async def old_ones() -> int:
                return sum(e.identity == "operator:old" for _, e in await audit.read_all(store))

            assert await old_ones() == 3
            for _ in range(60):  # poll for up to 30 s: the leader's loop deletes them
                if not await old_ones():
                    break
                await asyncio.sleep(0.5)
            aged_out = 3 - await old_ones()
            before = len(await audit.read_all(store))
            counted_out = await audit.prune(store, audit.AuditSettings(max_records=2, max_age_days=90))
            left = [e.identity for _, e in await audit.read_all(store)]
            return before - counted_out, aged_out, left
        finally:
            await store.close()

    remaining, aged_out, left = asyncio.run(run())
    assert aged_out == 3 and remaining == 2 and len(left) == 2 and "operator:old" not in left
