"""Multi-host install from the offline bundle, on the chaos suite's network-namespace hosts.

Three control-plane hosts (etcd + replica), two worker hosts, one gateway host and a client, each
host its own network namespace (one address on a bridge, no route out) AND its own mount namespace
(its own /etc, /opt and /var/lib: see tests/multihost.py). Each host is installed from the bundle
(`make dist`'s code path) with the bundle's own `kunlun-installer` entry point, never from this
checkout, with certificates issued for its own address; its services are started with
`kunlun-installer run` (the installed units' exact command lines). The client host (the operator's
machine) then runs a workload end to end through the gateway over HTTPS with an API key; finally an
installed host is damaged (a file deleted, a config byte changed, the unit removed), `verify` names
each problem and `verify --repair` brings it back to serving.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from chaos.netns import available
from tests.multihost import (
    GATEWAY_PORT,
    REPLICA_PORT,
    Layout,
    Site,
    client_cli,
    client_requests,
    cluster_ok,
    installed_site,
    nodes_ready,
    running_endpoints,
    wait_until,
)

WHY = available()
pytestmark = [
    pytest.mark.skipif(bool(WHY), reason=f"needs root and network namespaces: {WHY}"),
    # the module's site (six hosts installed from the bundle) is set up in the first test's time
    pytest.mark.timeout(1500),
]

LAYOUT = Layout()
CONTROL = LAYOUT.control
WORKERS = dict(LAYOUT.workers)
GATEWAY = LAYOUT.gateways[0]


@pytest.fixture(scope="module")
def site(bundle_dir: Path) -> Iterator[Site]:
    with installed_site(bundle_dir, LAYOUT, "10.214.0", "multihost") as s:
        yield s


def test_control_plane_hosts_installed_from_the_bundle_answer_the_client(site: Site) -> None:
    # the workers and the gateway were installed and started just before (a load spike on a small
    # machine): the status is awaited, not read once; a leader and all replicas must show up
    st = wait_until(lambda: cluster_ok(site), 120, "the replicas, a leader and the etcd members", interval=2)
    assert isinstance(st, dict)
    reps = st["replicas"]
    assert isinstance(reps, list)
    assert {str(r.get("address")) for r in reps} == {f"{site.addr(h)}:{REPLICA_PORT}" for h in CONTROL}
    members = site.cli("cluster", "etcd", "member", "list", "--etcd-cert-dir", str(site.certs))
    assert members is not None
    items = members["items"]
    assert isinstance(items, list)
    assert sorted(m["name"] for m in items) == ["etcd-1", "etcd-2", "etcd-3"]
    assert all(m["healthy"] for m in items), items
    assert {u for m in items for u in m["peer_urls"]} == {f"https://{site.addr(h)}:2380" for h in CONTROL}
    # etcd's RBAC was turned on from the client host (the fixture); running it again is harmless
    admin = ["--etcd-cert-dir", str(site.certs), "--etcd-endpoints", f"https://{site.addr('cp-2')}:2379"]
    again = site.cli("cluster", "etcd", "auth", "enable", *admin)
    assert again == {"enabled": True, "endpoint": f"https://{site.addr('cp-2')}:2379", "prefix": "/kunlun/"}
    for h in CONTROL:
        # each host has its own /opt and /etc: the release, config and unit exist only in its folders
        d = site.hosts.dir(h)
        assert (d / "opt" / "kunlun" / "current" / "venv" / "bin" / "kunlun-platform").exists()
        assert (d / "etc" / "kunlun" / "replica.yaml").is_file()
        assert (d / "etc" / "systemd" / "system" / "kunlun-etcd.service").is_file()
    assert not Path("/opt/kunlun").exists() and not Path("/etc/kunlun").exists()
    # offline by construction: no host has a route out of the bridge
    r = site.hosts.run("cp-1", ["ip", "route", "get", "1.1.1.1"])
    assert r.returncode != 0 and "unreachable" in r.stderr.lower(), r.stdout + r.stderr


SPEC = """name: chat
model: chat
engine: test
devices_per_instance: 1
memory_per_device_mb: 1024
replicas: 2
"""


def gateway_serves(site: Site, key: str, n: int) -> list[object]:
    url = f"https://{site.addr(GATEWAY)}:{GATEWAY_PORT}/v1/completions"
    return client_requests(site.topo, url, site.certs / "ca.crt", key, "chat", n, deadline_s=60)


def first_ok(site: Site, key: str) -> bool:
    return gateway_serves(site, key, 1) == [200]


@pytest.fixture(scope="module")
def api_key(site: Site) -> str:
    """The workload submitted and served, and an API key for the gateway (from the client host)."""
    wait_until(lambda: nodes_ready(site), 180, "node-a and node-b (the worker hosts) Ready", interval=2)
    created = site.cli("gateway", "keys", "create", "multihost")
    assert created is not None and created.get("secret")
    spec = site.hosts.root / "client" / "chat.yaml"
    spec.write_text(SPEC)
    r = client_cli(site.topo, site.client_config, "workload", "submit", "-f", str(spec))
    assert r.returncode == 0, r.stdout + r.stderr
    eps = wait_until(lambda: len(running_endpoints(site, "chat")) == 2, 240, "2 instances of chat Running")
    assert eps
    return str(created["secret"])


def test_a_workload_is_served_through_the_gateway_host_from_the_client_host(site: Site, api_key: str) -> None:
    eps = running_endpoints(site, "chat")
    worker_addrs = {site.addr(h) for h in WORKERS}
    assert len(eps) == 2 and all(e.rsplit(":", 1)[0] in worker_addrs for e in eps), eps
    wait_until(lambda: first_ok(site, api_key), 120, "the gateway host to route chat", interval=2)
    codes = gateway_serves(site, api_key, 20)
    assert codes == [200] * 20, codes
    # the gateway off loopback refuses a request without a key
    assert gateway_serves(site, "not-a-key", 1) == [401]


def test_a_damaged_host_is_named_by_verify_and_repaired_back_to_serving(site: Site, api_key: str) -> None:
    host = GATEWAY
    rc, out = site.installer(host, "verify")
    assert rc == 0 and "ok: every installed file as installed" in out, out
    assert site.hosts.stop(host) == 0
    # damage: delete a file of the release, change one byte of the config, remove the unit
    exe = "/opt/kunlun/current/venv/bin/kunlun-gateway"
    real_exe = os.path.realpath(site.hosts.dir(host) / exe.lstrip("/"))
    unit = "/etc/systemd/system/kunlun-gateway.service"
    for argv in (["rm", exe], ["rm", unit]):
        r = site.hosts.run(host, argv)
        assert r.returncode == 0, r.stderr
    cfg = site.hosts.dir(host) / "etc" / "kunlun" / "gateway.yaml"
    data = bytearray(cfg.read_bytes())
    data[0] ^= 0x20  # "advertise" -> "Advertise": a field the gateway refuses
    cfg.write_bytes(bytes(data))
    rc, out = site.installer(host, "verify")
    assert rc == 1, out
    rel_exe = "/" + str(Path(real_exe).relative_to(site.hosts.dir(host)))
    assert f"missing: {rel_exe}" in out, out
    assert "changed: /etc/kunlun/gateway.yaml" in out and f"missing: {unit}" in out, out
    assert "3 difference(s)" in out, out
    # without its unit the host cannot start its service, and says how to fix it
    rc, out = site.installer(host, "run")
    assert rc == 2 and "step 'read unit' failed" in out and "verify --repair" in out, out
    rc, out = site.installer(host, "verify", "--repair")
    assert rc == 0, out
    assert "restored /etc/kunlun/gateway.yaml (changed)" in out and f"restored {unit} (missing)" in out, out
    assert "rebuilt /opt/kunlun/releases/" in out, out
    rc, out = site.installer(host, "verify")
    assert rc == 0, out
    site.start(host)
    wait_until(lambda: first_ok(site, api_key), 120, "the repaired gateway host to serve again", interval=2)
    codes = gateway_serves(site, api_key, 20)
    assert codes == [200] * 20, codes
