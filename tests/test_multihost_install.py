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
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from chaos.netns import Topology, TopologySettings, available
from kunlun_common.pki import bundle as cert_bundle
from tests.multihost import Hosts, cli_json, client_cli, client_requests, host_python, wait_until

WHY = available()
pytestmark = [
    pytest.mark.skipif(bool(WHY), reason=f"needs root and network namespaces: {WHY}"),
    # the module's site (six hosts installed from the bundle) is set up in the first test's time
    pytest.mark.timeout(1500),
]

CONTROL = ("cp-1", "cp-2", "cp-3")
WORKERS = {"worker-1": "node-a", "worker-2": "node-b"}
GATEWAY = "gw-1"
REPLICA_PORT, GATEWAY_PORT = 50051, 8080


def run_id() -> str:
    return format((os.getpid() * 31 + time.monotonic_ns()) % 0xFFFFFF, "x")


@dataclass
class Site:
    """The installed hosts and what the client needs to reach them."""

    topo: Topology
    hosts: Hosts
    bundle: Path
    certs: Path
    """The operator's `certs init` folder (CA keys beside it, never on a host)."""
    client_config: Path
    python: str
    user: str
    install_s: dict[str, float] = field(default_factory=dict)
    """Seconds each host's first `install` took (it builds the host's virtual environment)."""

    def addr(self, host: str) -> str:
        return self.topo.addr(host)

    def installer(self, host: str, *args: str, timeout: float = 600) -> tuple[int, str]:
        """The bundle's own entry point on `host` (runs the installer from the bundle's wheel)."""
        r = self.hosts.run(host, [str(self.bundle / "kunlun-installer"), *args], timeout, PYTHON=self.python)
        return r.returncode, r.stdout + r.stderr

    def start(self, host: str) -> None:
        self.hosts.start(
            host,
            [str(self.bundle / "kunlun-installer"), "run"],
            self.hosts.dir(host) / "runner.log",
            PYTHON=self.python,
        )

    def cli(self, *args: str) -> dict[str, object] | None:
        return cli_json(self.topo, self.client_config, *args)


# ---------------------------------------------------------------------- configs, from the bundle
def etcd_env(example: str, index: int, addrs: list[str]) -> str:
    """The bundle's examples/etcd.env for member `index` (1-based) of the members at `addrs`."""
    own = addrs[index - 1]
    out = []
    for line in example.splitlines():
        key = line.partition("=")[0]
        if key == "ETCD_INITIAL_CLUSTER":
            for j, a in enumerate(addrs, 1):
                line = line.replace(f"10.0.0.1{j}:", f"{a}:")
        elif key.startswith("ETCD_"):
            line = line.replace("10.0.0.11:", f"{own}:").replace("etcd-1", f"etcd-{index}")
        out.append(line)
    return "\n".join(out) + "\n"


def write_configs(site: Site) -> dict[str, dict[str, Path]]:
    """Per host: role -> config file, made from the bundle's examples with this site's addresses."""
    ex = site.bundle / "examples"
    cp_addrs = [site.addr(h) for h in CONTROL]
    replicas = [f"{a}:{REPLICA_PORT}" for a in cp_addrs]
    out: dict[str, dict[str, Path]] = {}
    for i, h in enumerate(CONTROL, 1):
        d = site.hosts.dir(h) / "media"
        d.mkdir(parents=True, exist_ok=True)
        (d / "etcd.env").write_text(etcd_env((ex / "etcd.env").read_text(), i, cp_addrs))
        rep = yaml.safe_load((ex / "replica.example.yaml").read_text())
        rep.update(
            name=f"replica-{i}",
            advertise=f"{cp_addrs[i - 1]}:{REPLICA_PORT}",
            etcd_endpoints=[f"https://{a}:2379" for a in cp_addrs],
        )
        (d / "replica.yaml").write_text(yaml.safe_dump(rep))
        out[h] = {"etcd": d / "etcd.env", "control-plane": d / "replica.yaml"}
    for h, node in WORKERS.items():
        d = site.hosts.dir(h) / "media"
        d.mkdir(parents=True, exist_ok=True)
        cfg = yaml.safe_load((ex / f"{node}.yaml").read_text())
        cfg["node"]["address"] = site.addr(h)
        (d / "device-plugin-config.yaml").write_text(yaml.safe_dump(cfg))
        out[h] = {"worker": d / "device-plugin-config.yaml"}
    d = site.hosts.dir(GATEWAY) / "media"
    d.mkdir(parents=True, exist_ok=True)
    gw = yaml.safe_load((ex / "gateway.example.yaml").read_text())
    gw.pop("key_rate_limits", None)
    gw.update(
        advertise=f"{site.addr(GATEWAY)}:{GATEWAY_PORT}",
        endpoints=replicas,
        tls_cert="/etc/kunlun/certs/gateway/gateway-1.crt",
        tls_key="/etc/kunlun/certs/gateway/gateway-1.key",
    )
    (d / "gateway.yaml").write_text(yaml.safe_dump(gw))
    out[GATEWAY] = {"gateway": d / "gateway.yaml"}
    return out


def make_certs(site: Site) -> dict[str, dict[str, Path]]:
    """`kunlun-cli certs init` on the operator's machine, every server certificate for its host's
    address only; then each host's folder with only its own certificates (pki.bundle)."""
    hosts_args = []
    for i, h in enumerate(CONTROL, 1):
        hosts_args += ["--host", f"etcd-{i}={site.addr(h)}", "--host", f"replica-{i}={site.addr(h)}"]
    for h, node in WORKERS.items():
        hosts_args += ["--host", f"{node}={site.addr(h)}"]
    hosts_args += ["--host", f"gateway-1={site.addr(GATEWAY)}"]
    r = client_cli(
        site.topo, site.client_config, "certs", "init", str(site.certs), "--nodes", ",".join(WORKERS.values()),
        *hosts_args,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    media: dict[str, dict[str, Path]] = {}
    for i, h in enumerate(CONTROL, 1):
        d = site.hosts.dir(h) / "media"
        media[h] = {
            "etcd": cert_bundle(site.certs, d / "certs-etcd", "etcd", f"etcd-{i}"),
            "control-plane": cert_bundle(site.certs, d / "certs-replica", "replica", f"replica-{i}"),
        }
    for h, node in WORKERS.items():
        media[h] = {"worker": cert_bundle(site.certs, site.hosts.dir(h) / "media" / "certs", "agent", node)}
    media[GATEWAY] = {
        "gateway": cert_bundle(
            site.certs, site.hosts.dir(GATEWAY) / "media" / "certs", "gateway", "gateway-1"
        )
    }
    return media


def install_host(site: Site, host: str, configs: dict[str, Path], certs: dict[str, Path]) -> None:
    replicas = ",".join(f"{site.addr(h)}:{REPLICA_PORT}" for h in CONTROL)
    for n, (role, cfg) in enumerate(configs.items()):
        extra = ["--replicas", replicas] if role == "worker" else []
        t0 = time.monotonic()
        rc, out = site.installer(
            host, "install", "--role", role, "--config", str(cfg), "--certs", str(certs[role]),
            "--user", site.user, *extra,
        )  # fmt: skip
        assert rc == 0, f"install --role {role} on {host}:\n{out}"
        if n == 0:
            site.install_s[host] = time.monotonic() - t0
            print(
                f"[multihost] {host}: install --role {role} from the bundle took {site.install_s[host]:.1f} s"
            )


def cluster_ok(site: Site) -> dict[str, object] | None:
    st = site.cli("cluster", "status")
    if not st or not st.get("leader"):
        return None
    reps = st.get("replicas") or []
    members = st.get("etcd_members") or []
    assert isinstance(reps, list) and isinstance(members, list)
    if len(reps) != 3 or len(members) != 3:
        return None
    return st


def nodes_ready(site: Site) -> bool:
    out = site.cli("node", "list")
    items = out.get("items") if out else None
    if not isinstance(items, list):
        return False
    ready = {str(n.get("name")) for n in items if isinstance(n, dict) and n.get("status") == "Ready"}
    return set(WORKERS.values()) <= ready


# ---------------------------------------------------------------------- the site
@pytest.fixture(scope="module")
def site(bundle_dir: Path) -> Iterator[Site]:
    topo = Topology(TopologySettings(run_id(), (*CONTROL, *WORKERS, GATEWAY), "10.214.0"))
    python, user = host_python()
    base = Path(tempfile.mkdtemp(prefix="kunlun-multihost-"))
    hosts = Hosts(topo, base)
    client_dir = base / "client"
    client_dir.mkdir()
    s = Site(topo, hosts, bundle_dir, client_dir / "certs", client_dir / "config.yaml", python, user)
    try:
        topo.up()
        s.client_config.write_text(
            yaml.safe_dump(
                {
                    "endpoints": [f"{topo.addr(h)}:{REPLICA_PORT}" for h in CONTROL],
                    "ca": str(s.certs / "ca.crt"),
                    "cert": str(s.certs / "operator" / "admin.crt"),
                    "key": str(s.certs / "operator" / "admin.key"),
                }
            )
        )
        for h in (*CONTROL, *WORKERS, GATEWAY):
            hosts.prepare(h)
        certs = make_certs(s)
        configs = write_configs(s)
        for h in CONTROL:
            install_host(s, h, configs[h], certs[h])
        for h in CONTROL:
            s.start(h)
        admin = [
            "--etcd-cert-dir",
            str(s.certs),
            "--etcd-endpoints",
            ",".join(f"https://{s.addr(h)}:2379" for h in CONTROL),
        ]
        wait_until(
            lambda: (
                client_cli(topo, s.client_config, "cluster", "etcd", "auth", "enable", *admin).returncode == 0
            ),
            120,
            "etcd on the three control-plane hosts to accept `cluster etcd auth enable`",
            interval=2,
        )
        wait_until(lambda: cluster_ok(s), 180, "3 replicas, a leader and 3 etcd members", interval=2)
        for h in (*WORKERS, GATEWAY):
            install_host(s, h, configs[h], certs[h])
            s.start(h)
        yield s
    finally:
        hosts.stop_all()
        topo.down()
        keep = Path(tempfile.gettempdir()) / "kunlun-test-logs" / "multihost"
        shutil.rmtree(keep, ignore_errors=True)
        for hd in hosts.root.iterdir():
            for log in [*(hd / "varlib" / "kunlun" / "log").glob("*.log"), hd / "runner.log"]:
                if log.is_file():
                    (keep / hd.name).mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(log, keep / hd.name / log.name)
        shutil.rmtree(base, ignore_errors=True)


def test_control_plane_hosts_installed_from_the_bundle_answer_the_client(site: Site) -> None:
    st = cluster_ok(site)
    assert st is not None
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


def running_endpoints(site: Site, name: str) -> list[str]:
    w = site.cli("workload", "describe", name)
    inst = w.get("instance_details") if w else None
    if not isinstance(inst, list):
        return []
    return [str(i["endpoint"]) for i in inst if i.get("phase") == "Running" and i.get("endpoint")]


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
