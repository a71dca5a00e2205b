"""A whole local cluster: 3-member TLS etcd, replicas and agents as background processes.

State, logs and pids live under one folder (`.kunlun/` for `make demo`, a temp dir in tests):

    certs/                 every certificate and the CA certificates (CA keys: certs-ca-keys/)
    bundles/<component>/   what each process receives: its own certificate + the CA certificates
    etcd/<member>/         data dir and log
    replicas/<name>.log    agents/<node>/agent.log + state     cluster.json (pids, ports)
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from controlplane.store.admin import enable_etcd_auth
from devcluster.etcd_cluster import EtcdCluster, build_etcd_cluster
from devcluster.procs import ManagedProcess, free_port, pid_alive, stop_all, wait_for
from kunlun_common.api import cluster_pb2, cluster_pb2_grpc, types_pb2
from kunlun_common.pki import ClusterCerts, bundle, etcd_client_paths, init_cluster_certs, paths_for
from kunlun_common.tls import channel_credentials, load_tls

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "deploy" / "examples"


@dataclass
class ClusterSpec:
    """What to start."""

    base_dir: Path
    """Folder for state, logs, pids and certificates."""
    replicas: int = 3
    """Number of control-plane replicas."""
    node_configs: tuple[Path, ...] = (EXAMPLES / "node-a.yaml", EXAMPLES / "node-b.yaml")
    """One agent per device-plugin-config file (node name from the file)."""
    replica_ports: tuple[int, ...] = ()
    """Fixed replica ports (default: free ports)."""
    etcd_ports: tuple[tuple[int, int], ...] = ()
    """Fixed (client, peer) ports per etcd member (default: free ports)."""
    election_ttl_s: int = 5
    renew_deadline_s: float = 3.0
    retry_period_s: float = 1.0
    node_lease_ttl_s: int = 5
    extra_nodes: tuple[str, ...] = ()
    """More agent certificates to issue (node names) for tests."""
    replica_args: tuple[str, ...] = ()
    """Extra flags for every replica."""
    replica_env: dict[str, dict[str, str]] = field(default_factory=dict)
    """Extra environment per replica name, e.g. libfaketime's LD_PRELOAD and FAKETIME to run one
    replica with a skewed wall clock in tests (none by default)."""
    agent_args: tuple[str, ...] = ("--test-engine-fallback", "--stop-engines-on-exit")
    """Extra flags for every agent (the local cluster serves with the test engine when SGLang is
    not installed, and stops its engines when it stops)."""
    gateways: int = 3
    """Number of inference gateways (one per control-plane host in production)."""
    gateway_args: tuple[str, ...] = ()
    """Extra flags for every gateway."""
    gateway_https: bool = False
    """Gateways serve HTTPS with their own certificate (from the cluster CA, `ca.crt`) and require
    API keys, as production configs do; off: plain HTTP without keys on loopback (the demo)."""
    metrics: bool = True
    """Give every replica, agent and gateway a Prometheus exporter on a free loopback port."""
    supervise_replicas: bool = False
    """Run every replica under devcluster/supervise.py, which starts it again when it exits (as
    systemd's `Restart=always` does in production; a drained replica exits 0). `make demo` does;
    tests that kill -9 or pause a replica need its own pid, so the default is off."""
    log_format: str = "json"
    """`--log-format` of every process: `json` (as in production; what tests parse) or `console`
    (readable: `make demo`)."""


@dataclass
class LocalCluster:
    spec: ClusterSpec
    etcd: EtcdCluster = field(default_factory=EtcdCluster)
    replicas: dict[str, ManagedProcess] = field(default_factory=dict)
    replica_addrs: dict[str, str] = field(default_factory=dict)
    agents: dict[str, ManagedProcess] = field(default_factory=dict)
    gateways: dict[str, ManagedProcess] = field(default_factory=dict)
    gateway_addrs: dict[str, str] = field(default_factory=dict)
    metrics_addrs: dict[str, str] = field(default_factory=dict)
    """Process name (replica-1, agent-node-a, gateway-1) -> host:port of its metrics exporter."""

    @property
    def base(self) -> Path:
        return self.spec.base_dir

    @property
    def cert_dir(self) -> Path:
        return self.base / "certs"

    @property
    def profile_dir(self) -> Path:
        """Where every process writes its run-time profiles (when `advanced_profiling` is on)."""
        return self.base / "profiles"

    def bundle(self, role: str, name: str) -> Path:
        """The certificate folder handed to one process: only its own certificate and the CAs."""
        return bundle(self.cert_dir, self.base / "bundles" / name, role, name)

    @property
    def endpoints(self) -> list[str]:
        return list(self.replica_addrs.values())

    def node_names(self) -> list[str]:
        import yaml

        names = []
        for cfg in self.spec.node_configs:
            data = yaml.safe_load(cfg.read_text())
            names.append(str(data["node"]["name"]))
        return names

    def metrics_flag(self, process: str) -> list[str]:
        """`--metrics-listen` for a process (the same port again when it restarts)."""
        if not self.spec.metrics:
            return []
        if process not in self.metrics_addrs:
            self.metrics_addrs[process] = f"127.0.0.1:{free_port()}"
        return [f"--metrics-listen={self.metrics_addrs[process]}"]

    def monitoring_tls(self) -> tuple[Path, Path, Path]:
        """CA, certificate and key of the `monitoring` identity (what Prometheus scrapes with)."""
        p = paths_for(self.cert_dir, "monitoring", "prometheus")
        return p.ca, p.cert, p.key

    # ---------------------------------------------------------------- start
    def make_certs(self) -> None:
        names = tuple(f"replica-{i + 1}" for i in range(self.spec.replicas))
        init_cluster_certs(
            self.cert_dir, ClusterCerts(replicas=names, nodes=(*self.node_names(), *self.spec.extra_nodes))
        )

    def start_etcd(self, timeout: float = 60.0) -> None:
        self.etcd = build_etcd_cluster(
            self.base / "etcd", self.cert_dir, ports=list(self.spec.etcd_ports) or None
        )
        self.etcd.start()
        self.save()
        wait_for(self._etcd_healthy, timeout, "etcd members to form a cluster")
        enable_etcd_auth(self.etcd.endpoints, self.cert_dir)

    def _etcd_healthy(self) -> bool:
        import asyncio

        from controlplane.store import EtcdStore, StoreSettings

        p = etcd_client_paths(self.cert_dir)

        async def check() -> bool:
            store = EtcdStore(
                StoreSettings(
                    self.etcd.endpoints,
                    str(p.ca),
                    str(p.cert),
                    str(p.key),
                    request_timeout_s=2.0,
                    retry_deadline_s=2.0,
                )
            )
            try:
                await store.revision()
                return True
            finally:
                await store.close()

        return asyncio.run(check())

    def replica_argv(self, name: str, address: str) -> list[str]:
        s = self.spec
        return [
            sys.executable,
            "-m",
            "controlplane.main",
            f"--name={name}",
            f"--listen={address}",
            f"--cert-dir={self.bundle('replica', name)}",
            f"--etcd-endpoints={','.join(self.etcd.endpoints)}",
            f"--election-ttl={s.election_ttl_s}",
            f"--renew-deadline={s.renew_deadline_s}",
            f"--retry-period={s.retry_period_s}",
            f"--node-lease-ttl={s.node_lease_ttl_s}",
            *self.metrics_flag(name),
            f"--profile-dir={self.profile_dir}",
            f"--log-format={s.log_format}",
            *s.replica_args,
        ]

    def start_replicas(self, timeout: float = 60.0) -> None:
        ports = list(self.spec.replica_ports) or [free_port() for _ in range(self.spec.replicas)]
        for i in range(self.spec.replicas):
            name = f"replica-{i + 1}"
            addr = f"127.0.0.1:{ports[i]}"
            self.replica_addrs[name] = addr
            proc = self._replica_process(name, addr)
            proc.start()
            self.replicas[name] = proc
        self.save()
        for name in self.replicas:
            wait_for(lambda n=name: self.replica_serving(n), timeout, f"replica {name} to serve")

    def restart_replica(self, name: str) -> None:
        proc = self._replica_process(name, self.replica_addrs[name])
        proc.start()
        self.replicas[name] = proc
        self.save()

    def _replica_process(self, name: str, address: str) -> ManagedProcess:
        argv = self.replica_argv(name, address)
        if self.spec.supervise_replicas:
            argv = [sys.executable, "-m", "devcluster.supervise", "--restart-sec=1", "--", *argv]
        return ManagedProcess(
            name,
            argv,
            self.base / "replicas" / f"{name}.log",
            env=dict(self.spec.replica_env.get(name, {})),
        )

    def agent_argv(self, config: Path, node: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            "node_agent.main",
            f"--config={config}",
            f"--endpoints={','.join(self.endpoints)}",
            f"--cert-dir={self.bundle('agent', node)}",
            f"--state-dir={self.base / 'agents' / node}",
            *self.metrics_flag(f"agent-{node}"),
            f"--profile-dir={self.profile_dir}",
            f"--log-format={self.spec.log_format}",
            *self.spec.agent_args,
        ]

    def start_agent(self, config: Path, node: str) -> ManagedProcess:
        proc = ManagedProcess(
            f"agent-{node}", self.agent_argv(config, node), self.base / "agents" / node / "agent.log"
        )
        proc.start()
        self.agents[node] = proc
        self.save()
        return proc

    def start_agents(self, timeout: float = 60.0) -> None:
        for cfg, node in zip(self.spec.node_configs, self.node_names(), strict=True):
            self.start_agent(cfg, node)
        for node in self.agents:
            wait_for(lambda n=node: self.node_ready(n), timeout, f"node {node} to register")
        # a node registered again over its earlier record (`make demo` after `make down`) is Ready
        # before its devices are: wait for those too, so that what is printed next is current
        for node in self.agents:
            wait_for(lambda n=node: self.devices_available(n), timeout, f"node {node}'s devices")

    def gateway_argv(self, name: str, address: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            "gateway.main",
            f"--name={name}",
            f"--listen={address}",
            f"--endpoints={','.join(self.endpoints)}",
            f"--cert-dir={self.bundle('gateway', name)}",
            *self.metrics_flag(name),
            f"--profile-dir={self.profile_dir}",
            f"--log-format={self.spec.log_format}",
            *self.https_flags(name),
            *self.spec.gateway_args,
        ]

    def https_flags(self, name: str) -> list[str]:
        """`--tls-cert/--tls-key/--require-api-key` when the gateways serve HTTPS: the gateway's own
        certificate (server usage, the host's names) doubles as its HTTPS certificate."""
        if not self.spec.gateway_https:
            return []
        own = self.bundle("gateway", name) / "gateway"
        return [f"--tls-cert={own / f'{name}.crt'}", f"--tls-key={own / f'{name}.key'}", "--require-api-key"]

    def gateway_url(self, name: str) -> str:
        """The gateway's base URL (https:// when it serves HTTPS: trust `ca.crt`)."""
        return f"{'https' if self.spec.gateway_https else 'http'}://{self.gateway_addrs[name]}"

    def start_gateways(self, timeout: float = 30.0) -> None:
        for i in range(self.spec.gateways):
            name, addr = f"gateway-{i + 1}", f"127.0.0.1:{free_port()}"
            self.gateway_addrs[name] = addr
            proc = ManagedProcess(name, self.gateway_argv(name, addr), self.base / "gateways" / f"{name}.log")
            proc.start()
            self.gateways[name] = proc
        self.save()
        for name in self.gateways:
            wait_for(lambda n=name: self.gateway_serving(n), timeout, f"gateway {name} to serve")

    def gateway_serving(self, name: str) -> bool:
        import ssl
        import urllib.request

        ctx = (
            ssl.create_default_context(cafile=str(self.cert_dir / "ca.crt"))
            if self.spec.gateway_https
            else None
        )
        try:
            with urllib.request.urlopen(f"{self.gateway_url(name)}/health", timeout=2, context=ctx) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def start(self) -> None:
        self.base.mkdir(parents=True, exist_ok=True)
        self.make_certs()
        self.start_etcd()
        self.start_replicas()
        self.start_agents()
        if self.spec.gateways:
            self.start_gateways()

    def reload_certs(self) -> None:
        """Hand every process its (rotated) certificate again and send it SIGHUP, as an operator
        does after `kunlun-cli certs rotate`; etcd members re-read theirs on each handshake."""
        import signal

        for m in self.etcd.members:
            bundle(self.cert_dir, m.data_dir.parent / "certs", "etcd", m.name)
        for role, procs in (("replica", self.replicas), ("agent", self.agents), ("gateway", self.gateways)):
            for name, proc in procs.items():
                self.bundle(role, name)
                if proc.alive():
                    proc.signal(signal.SIGHUP)

    def distribute_crl(self) -> None:
        """Copy certs/crl/etcd.crl (rewritten by `kunlun-cli certs revoke --dir`) into every etcd
        member's folder, as an operator copies it to the etcd hosts; etcd reads it on each new
        client connection, so no restart is needed."""
        for m in self.etcd.members:
            bundle(self.cert_dir, m.data_dir.parent / "certs", "etcd", m.name)

    # ---------------------------------------------------------------- probes
    def channel(self, address: str, role: str = "operator", name: str = "admin") -> grpc.Channel:
        creds = channel_credentials(load_tls(paths_for(self.cert_dir, role, name)))
        return grpc.secure_channel(address, creds)

    def replica_serving(self, name: str) -> bool:
        with self.channel(self.replica_addrs[name]) as ch:
            try:
                r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2.0)
                return bool(r.status == health_pb2.HealthCheckResponse.SERVING)
            except grpc.RpcError:
                return False

    def call_any(self, method: str, request: object, timeout: float = 5.0) -> object:
        """Call a ClusterService method on the first replica that answers (as operator)."""
        last: Exception | None = None
        for name, addr in self.replica_addrs.items():
            if not self.replicas[name].alive():
                continue
            with self.channel(addr) as ch:
                try:
                    return getattr(cluster_pb2_grpc.ClusterServiceStub(ch), method)(request, timeout=timeout)
                except grpc.RpcError as e:
                    last = e
        raise RuntimeError(f"no replica answered {method}: {last}")

    def devices(self) -> list[types_pb2.Device]:
        resp = self.call_any("ListDevices", cluster_pb2.ListDevicesRequest())
        assert isinstance(resp, cluster_pb2.ListDevicesResponse)
        return list(resp.devices)

    def node_ready(self, node: str) -> bool:
        resp = self.call_any("ListNodes", cluster_pb2.ListNodesRequest())
        assert isinstance(resp, cluster_pb2.ListNodesResponse)
        return any(n.name == node and n.ready for n in resp.nodes)

    def devices_available(self, node: str) -> bool:
        """Whether `node` is Ready and, on every running replica, none of its devices is Unavailable.

        Asked with ListDevices (what `kunlun-cli device list` shows) of each replica in turn: each
        answers from its own watch of etcd, and the demo prints from whichever the CLI reaches."""
        resp = self.call_any("ListNodes", cluster_pb2.ListNodesRequest())
        assert isinstance(resp, cluster_pb2.ListNodesResponse)
        if not any(n.name == node and n.ready for n in resp.nodes):
            return False
        for name, addr in self.replica_addrs.items():
            if not self.replicas[name].alive():
                continue
            with self.channel(addr) as ch:
                try:
                    devs = cluster_pb2_grpc.ClusterServiceStub(ch).ListDevices(
                        cluster_pb2.ListDevicesRequest(node=node), timeout=5.0
                    )
                except grpc.RpcError:
                    return False
            mine = [d for d in devs.devices if d.node == node]
            if not mine or any(d.status == types_pb2.DEVICE_STATUS_UNAVAILABLE for d in mine):
                return False
        return True

    def leader(self) -> str:
        resp = self.call_any("ClusterStatus", cluster_pb2.ClusterStatusRequest())
        assert isinstance(resp, cluster_pb2.ClusterStatusResponse)
        return resp.leader

    # ---------------------------------------------------------------- state
    def all_procs(self) -> list[ManagedProcess]:
        return [
            *self.gateways.values(),
            *self.agents.values(),
            *self.replicas.values(),
            *(m.proc for m in self.etcd.members),
        ]

    def save(self) -> None:
        data = {
            "pids": {p.name: p.pid for p in self.all_procs() if p.pid},
            "replicas": self.replica_addrs,
            "gateways": self.gateway_addrs,
            "metrics": self.metrics_addrs,
            "etcd": list(self.etcd.endpoints),
            # the ports to start on again over this state (etcd's members keep their peer URLs)
            "etcd_ports": [[m.client_port, m.peer_port] for m in self.etcd.members],
            "replica_ports": [int(a.rsplit(":", 1)[1]) for a in self.replica_addrs.values()],
        }
        (self.base / "cluster.json").write_text(json.dumps(data, indent=2))

    def stop(self) -> None:
        stop_all([*self.gateways.values(), *self.agents.values()])
        stop_all([*self.replicas.values()])
        stop_all([m.proc for m in self.etcd.members])


def kept_ports(base: Path) -> tuple[tuple[tuple[int, int], ...], tuple[int, ...]] | None:
    """The (etcd (client, peer), replica) ports recorded in base/cluster.json when etcd data is kept
    there (replica ports: empty when none had started); None when there is no such state (or it
    predates the recorded ports)."""
    path = base / "cluster.json"
    if not path.exists() or not any((base / "etcd").glob("*/data/member")):
        return None
    data = json.loads(path.read_text())
    etcd, replicas = data.get("etcd_ports"), data.get("replica_ports")
    if not etcd:
        return None
    return tuple((int(c), int(p)) for c, p in etcd), tuple(int(r) for r in replicas or ())


def stop_from_state(base: Path, timeout: float = 15.0) -> list[str]:
    """`make down`: stop every process recorded in base/cluster.json; return what was stopped."""
    path = base / "cluster.json"
    if not path.exists():
        return []
    pids: dict[str, int] = json.loads(path.read_text()).get("pids", {})
    order = sorted(
        pids.items(),
        key=lambda kv: (
            0 if kv[0].startswith(("agent", "gateway")) else 1 if kv[0].startswith("replica") else 2
        ),
    )
    procs = []
    for name, pid in order:
        if pid_alive(pid) and _is_ours(pid):
            p = ManagedProcess(name, [], base / "unused.log")
            p.pid = pid
            procs.append(p)
    stop_all(procs, timeout)
    # anything else started for this cluster (engine supervisors, plugin hosts) names its folder
    leftovers = []
    for pid in _pids_mentioning(str(base)):
        p = ManagedProcess(f"pid-{pid}", [], base / "unused.log")
        p.pid = pid
        leftovers.append(p)
    stop_all(leftovers, timeout)
    return [p.name for p in procs] + [p.name for p in leftovers]


def _ancestors() -> set[int]:
    pids = set()
    pid = os.getpid()
    while pid > 1:
        pids.add(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return pids


def _pids_mentioning(text: str) -> list[int]:
    """Our own processes (python modules of this project, etcd, engines) whose command line names
    the cluster folder — never a shell or the caller that merely mentions it."""
    mine = _ancestors()
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) in mine:
            continue
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        cmd = b" ".join(argv).decode(errors="replace")
        exe = os.path.basename(argv[0].decode(errors="replace")) if argv and argv[0] else ""
        ours = exe.startswith(("python", "etcd", "kunlun")) and any(
            m in cmd for m in ("node_agent.", "controlplane.", "etcd", "kunlun-")
        )
        if ours and text in cmd and pid_alive(int(d.name)):
            out.append(int(d.name))
    return out


def _is_ours(pid: int) -> bool:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    return any(s in cmd for s in ("etcd", "controlplane.main", "gateway", "node_agent.main", "kunlun"))
