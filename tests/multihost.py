"""Hosts for the multi-host install test: each a network namespace of the chaos topology AND a mount
namespace of its own, in which `/etc`, `/opt` and `/var/lib` are that host's own folders.

Every command for a host runs as

    ip netns exec NS unshare --mount --propagation private sh -c \
        'mount --bind ROOT/H/etc /etc && mount --bind ROOT/H/opt /opt && mount --bind ROOT/H/varlib /var/lib
         && exec "$@"' sh ARGV...

so the installer writes the host's real paths (`/opt/kunlun`, `/etc/kunlun`, `/etc/systemd/system`,
`/var/lib/kunlun`, the service user in `/etc/passwd`) into that host's folders and nowhere else; its
`/etc` starts as a copy of this machine's. The namespaces have only the bridge: no route out, so the
install is offline by construction. The mounts live only as long as the processes of the host's
commands: nothing is mounted in this machine's own mount namespace.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from chaos.netns import Topology, TopologySettings
from kunlun_common.pki import bundle as cert_bundle

ROOT = Path(__file__).resolve().parent.parent
HOST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def host_python() -> tuple[str, str]:
    """The interpreter a host runs the installer with, and the service user.

    A host's own system Python 3.x (the bundle's minor version) with `venv` and `ensurepip`, so the
    services run as the unprivileged `kunlun` user as in production; where the machine has none
    (only an interpreter under root's home, which another user cannot reach), the test's own one
    with services as root."""
    want = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for d in ("/usr/bin", "/usr/local/bin"):
        cand = Path(d) / want
        if cand.is_file():
            r = subprocess.run([str(cand), "-c", "import venv, ensurepip"], capture_output=True, timeout=60)
            if r.returncode == 0:
                return str(cand), "kunlun"
    return sys.executable, "root"


@dataclass
class Hosts:
    """The per-host folders and how to run a command on a host."""

    topo: Topology
    root: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    """Long-running `kunlun-installer run` per host."""

    def dir(self, host: str) -> Path:
        return self.root / host

    def prepare(self, host: str) -> None:
        """The host's empty /opt and /var/lib, and its /etc as a copy of this machine's."""
        d = self.dir(host)
        (d / "opt").mkdir(parents=True, exist_ok=True)
        (d / "varlib").mkdir(exist_ok=True)
        if not (d / "etc").exists():
            # symlinks kept as links; sockets and the like skipped (copytree copies files and links)
            shutil.copytree(
                "/etc", d / "etc", symlinks=True, ignore=shutil.ignore_patterns("kunlun", "kunlun-*.service")
            )

    def argv(self, host: str, argv: Sequence[str]) -> list[str]:
        d = self.dir(host)
        script = (
            "set -e; "
            f"mount --bind {d}/etc /etc; mount --bind {d}/opt /opt; mount --bind {d}/varlib /var/lib; "
            'exec "$@"'
        )
        inner = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *argv]
        return self.topo.exec_argv(host, inner) if host in self.topo.hosts else inner

    def env(self, **extra: str) -> dict[str, str]:
        return {"PATH": HOST_PATH, "LANG": "C.UTF-8", "HOME": "/root", **extra}

    def run(
        self, host: str, argv: Sequence[str], timeout: float = 600, **env: str
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.argv(host, argv), capture_output=True, text=True, env=self.env(**env), timeout=timeout
        )

    def start(self, host: str, argv: Sequence[str], log: Path, **env: str) -> subprocess.Popen[bytes]:
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("ab") as out:
            p = subprocess.Popen(
                self.argv(host, argv), stdout=out, stderr=subprocess.STDOUT, env=self.env(**env)
            )
        self.procs[host] = p
        return p

    def stop(self, host: str, timeout: float = 60) -> int | None:
        """SIGTERM a host's runner (it stops its services) and wait for it."""
        p = self.procs.pop(host, None)
        if p is None or p.poll() is not None:
            return None if p is None else p.returncode
        p.send_signal(signal.SIGTERM)
        try:
            return p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            return p.wait(30)

    def stop_all(self, timeout: float = 30) -> None:
        """SIGTERM every runner at once, wait for them together; what is left is killed with its
        namespace (Topology.down)."""
        for p in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
        end = time.monotonic() + timeout
        for p in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.1, end - time.monotonic()))
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(30)
        self.procs.clear()


def client_cli(
    topo: Topology, config: Path, *args: str, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """`kunlun-cli` on the client host (the operator's machine: the checkout's own CLI)."""
    argv = topo.exec_argv("client", [str(ROOT / ".venv" / "bin" / "kunlun-cli"), *args])
    env = {"PATH": os.environ.get("PATH", HOST_PATH), "KUNLUN_CONFIG": str(config), "LANG": "C.UTF-8"}
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)


def cli_json(topo: Topology, config: Path, *args: str) -> dict[str, object] | None:
    r = client_cli(topo, config, "-o", "json", *args)
    if r.returncode != 0:
        return None
    try:
        data: dict[str, object] = json.loads(r.stdout)
        return data
    except ValueError:
        return None


REQUESTS = r"""
import json, ssl, sys, time, urllib.request
url, ca, key, model, n, deadline_s = sys.argv[1:7]
ctx = ssl.create_default_context(cafile=ca)
codes = []
end = time.monotonic() + float(deadline_s)
body = json.dumps({"model": model, "prompt": "hello", "max_tokens": 4}).encode()
for _ in range(int(n)):
    if time.monotonic() > end:
        break
    req = urllib.request.Request(url, data=body, method="POST",
        headers={"Authorization": "Bearer " + key, "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10, context=ctx) as r:
            codes.append(r.status)
    except urllib.error.HTTPError as e:
        codes.append(e.code)
    except OSError as e:
        codes.append(str(e)[:80])
print(json.dumps(codes))
"""


def client_requests(
    topo: Topology, url: str, ca: Path, key: str, model: str, n: int, deadline_s: float = 60
) -> list[object]:
    """`n` requests in a row from the client host (bounded by count and time); their statuses."""
    argv = topo.exec_argv(
        "client", [sys.executable, "-c", REQUESTS, url, str(ca), key, model, str(n), str(deadline_s)]
    )
    r = subprocess.run(argv, capture_output=True, text=True, timeout=deadline_s + 60)
    if r.returncode != 0:
        return [r.stderr.strip()[-200:]]
    codes: list[object] = json.loads(r.stdout)
    return codes


def wait_until(check: object, timeout: float, what: str, interval: float = 1.0) -> object:
    """Poll `check()` until it returns something truthy (returned), or fail naming `what`."""
    assert callable(check)
    end = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < end:
        last = check()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")


# ---------------------------------------------------------------------- a whole site
REPLICA_PORT, GATEWAY_PORT = 50051, 8080


def run_id() -> str:
    return format((os.getpid() * 31 + time.monotonic_ns()) % 0xFFFFFF, "x")


@dataclass(frozen=True)
class Layout:
    """Which host runs what: control-plane hosts (etcd + replica), workers (host -> node name) and
    gateway hosts (gateway i is named `gateway-i`)."""

    control: tuple[str, ...] = ("cp-1", "cp-2", "cp-3")
    workers: tuple[tuple[str, str], ...] = (("worker-1", "node-a"), ("worker-2", "node-b"))
    gateways: tuple[str, ...] = ("gw-1",)
    gateway_settings: tuple[tuple[str, object], ...] = ()
    """Extra settings for every gateway's config (over the bundle's example)."""

    @property
    def hosts(self) -> tuple[str, ...]:
        return (*self.control, *(h for h, _ in self.workers), *self.gateways)

    def gateway_name(self, host: str) -> str:
        return f"gateway-{self.gateways.index(host) + 1}"


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
    layout: Layout = field(default_factory=Layout)
    install_s: dict[str, float] = field(default_factory=dict)
    """Seconds each host's first `install` took (it builds the host's virtual environment)."""

    def addr(self, host: str) -> str:
        return self.topo.addr(host)

    def installer(
        self, host: str, *args: str, timeout: float = 600, bundle: Path | None = None
    ) -> tuple[int, str]:
        """The bundle's own entry point on `host` (runs the installer from the bundle's wheel)."""
        b = bundle or self.bundle
        r = self.hosts.run(host, [str(b / "kunlun-installer"), *args], timeout, PYTHON=self.python)
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
    lay = site.layout
    ex = site.bundle / "examples"
    cp_addrs = [site.addr(h) for h in lay.control]
    replicas = [f"{a}:{REPLICA_PORT}" for a in cp_addrs]
    out: dict[str, dict[str, Path]] = {}
    for i, h in enumerate(lay.control, 1):
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
    for h, node in lay.workers:
        d = site.hosts.dir(h) / "media"
        d.mkdir(parents=True, exist_ok=True)
        cfg = yaml.safe_load((ex / f"{node}.yaml").read_text())
        cfg["node"]["address"] = site.addr(h)
        (d / "device-plugin-config.yaml").write_text(yaml.safe_dump(cfg))
        out[h] = {"worker": d / "device-plugin-config.yaml"}
    for h in lay.gateways:
        name = lay.gateway_name(h)
        d = site.hosts.dir(h) / "media"
        d.mkdir(parents=True, exist_ok=True)
        gw = yaml.safe_load((ex / "gateway.example.yaml").read_text())
        gw.pop("key_rate_limits", None)
        gw.update(
            name=name,
            advertise=f"{site.addr(h)}:{GATEWAY_PORT}",
            endpoints=replicas,
            tls_cert=f"/etc/kunlun/certs/gateway/{name}.crt",
            tls_key=f"/etc/kunlun/certs/gateway/{name}.key",
        )
        gw.update(dict(lay.gateway_settings))
        (d / "gateway.yaml").write_text(yaml.safe_dump(gw))
        out[h] = {"gateway": d / "gateway.yaml"}
    return out


def make_certs(site: Site) -> dict[str, dict[str, Path]]:
    """`kunlun-cli certs init` on the operator's machine, every server certificate for its host's
    address only; then each host's folder with only its own certificates (pki.bundle)."""
    lay = site.layout
    hosts_args = []
    for i, h in enumerate(lay.control, 1):
        hosts_args += ["--host", f"etcd-{i}={site.addr(h)}", "--host", f"replica-{i}={site.addr(h)}"]
    for h, node in lay.workers:
        hosts_args += ["--host", f"{node}={site.addr(h)}"]
    for h in lay.gateways:
        hosts_args += ["--host", f"{lay.gateway_name(h)}={site.addr(h)}"]
    nodes = ",".join(node for _, node in lay.workers)
    assert len(lay.gateways) <= 3, "certs init issues gateway-1..gateway-3"
    r = client_cli(
        site.topo, site.client_config, "certs", "init", str(site.certs), "--nodes", nodes, *hosts_args
    )
    assert r.returncode == 0, r.stdout + r.stderr
    media: dict[str, dict[str, Path]] = {}
    for i, h in enumerate(lay.control, 1):
        d = site.hosts.dir(h) / "media"
        media[h] = {
            "etcd": cert_bundle(site.certs, d / "certs-etcd", "etcd", f"etcd-{i}"),
            "control-plane": cert_bundle(site.certs, d / "certs-replica", "replica", f"replica-{i}"),
        }
    for h, node in lay.workers:
        media[h] = {"worker": cert_bundle(site.certs, site.hosts.dir(h) / "media" / "certs", "agent", node)}
    for h in lay.gateways:
        d = site.hosts.dir(h) / "media" / "certs"
        media[h] = {"gateway": cert_bundle(site.certs, d, "gateway", lay.gateway_name(h))}
    return media


def install_host(site: Site, host: str, configs: dict[str, Path], certs: dict[str, Path]) -> None:
    replicas = ",".join(f"{site.addr(h)}:{REPLICA_PORT}" for h in site.layout.control)
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
    if len(reps) != len(site.layout.control) or len(members) != len(site.layout.control):
        return None
    return st


def nodes_ready(site: Site) -> bool:
    out = site.cli("node", "list")
    items = out.get("items") if out else None
    if not isinstance(items, list):
        return False
    ready = {str(n.get("name")) for n in items if isinstance(n, dict) and n.get("status") == "Ready"}
    return {node for _, node in site.layout.workers} <= ready


def running_endpoints(site: Site, name: str) -> list[str]:
    w = site.cli("workload", "describe", name)
    inst = w.get("instance_details") if w else None
    if not isinstance(inst, list):
        return []
    return [str(i["endpoint"]) for i in inst if i.get("phase") == "Running" and i.get("endpoint")]


def each(hosts: Sequence[str], fn: Callable[[str], None]) -> None:
    """`fn(host)` for every host at once (a thread each); the first failure is raised."""
    with ThreadPoolExecutor(max_workers=max(1, len(hosts))) as pool:
        for f in [pool.submit(fn, h) for h in hosts]:
            f.result()


@contextlib.contextmanager
def installed_site(bundle: Path, layout: Layout, subnet: str, logs: str) -> Iterator[Site]:
    """Every host of `layout` installed from `bundle` and started with `kunlun-installer run`:
    the control-plane hosts first (etcd RBAC turned on from the client host, 3 replicas and a
    leader awaited), then the workers and gateways. Everything is stopped and removed afterwards;
    the hosts' logs are kept under TMP/kunlun-test-logs/`logs`."""
    topo = Topology(TopologySettings(run_id(), layout.hosts, subnet))
    python, user = host_python()
    base = Path(tempfile.mkdtemp(prefix="kunlun-multihost-"))
    hosts = Hosts(topo, base)
    client_dir = base / "client"
    client_dir.mkdir()
    s = Site(topo, hosts, bundle, client_dir / "certs", client_dir / "config.yaml", python, user, layout)
    try:
        topo.up()
        s.client_config.write_text(
            yaml.safe_dump(
                {
                    "endpoints": [f"{topo.addr(h)}:{REPLICA_PORT}" for h in layout.control],
                    "ca": str(s.certs / "ca.crt"),
                    "cert": str(s.certs / "operator" / "admin.crt"),
                    "key": str(s.certs / "operator" / "admin.key"),
                }
            )
        )
        for h in layout.hosts:
            hosts.prepare(h)
        certs = make_certs(s)
        configs = write_configs(s)
        # hosts are independent machines: installed side by side, as an operator's tooling would
        each(layout.control, lambda h: install_host(s, h, configs[h], certs[h]))
        for h in layout.control:
            s.start(h)
        admin = [
            "--etcd-cert-dir",
            str(s.certs),
            "--etcd-endpoints",
            ",".join(f"https://{s.addr(h)}:2379" for h in layout.control),
        ]
        wait_until(
            lambda: (
                client_cli(topo, s.client_config, "cluster", "etcd", "auth", "enable", *admin).returncode == 0
            ),
            120,
            "etcd on the control-plane hosts to accept `cluster etcd auth enable`",
            interval=2,
        )
        wait_until(lambda: cluster_ok(s), 180, "the replicas, a leader and the etcd members", interval=2)
        rest = (*(w for w, _ in layout.workers), *layout.gateways)
        each(rest, lambda h: install_host(s, h, configs[h], certs[h]))
        for h in rest:
            s.start(h)
        yield s
    finally:
        hosts.stop_all()
        topo.down()
        keep = Path(tempfile.gettempdir()) / "kunlun-test-logs" / logs
        shutil.rmtree(keep, ignore_errors=True)
        for hd in hosts.root.iterdir():
            for log in [*(hd / "varlib" / "kunlun" / "log").glob("*.log"), hd / "runner.log"]:
                if log.is_file():
                    (keep / hd.name).mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(log, keep / hd.name / log.name)
        shutil.rmtree(base, ignore_errors=True)
