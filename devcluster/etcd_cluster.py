"""Start a real N-member etcd cluster with TLS everywhere (client-cert auth on clients and peers).

Members trust only the etcd CA (kunlun_common.pki), on the client and the peer port, so no
agent, gateway, operator or viewer certificate reaches etcd; each member gets a certificate
folder of its own holding only its certificate and the etcd CA certificate. `start()` followed by
`controlplane.store.admin.enable_etcd_auth` also turns on etcd's RBAC (users from the client CN).

Auto-compaction (periodic) and a backend space quota are always configured, so history cannot
grow without bound; watch progress notifications every few seconds let our supervised watches
notice a silent stream.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from devcluster.procs import ManagedProcess, free_port
from kunlun_common.errors import ConfigError
from kunlun_common.pki import ETCD_CA, ETCD_CRL, ETCD_PEER_NAME, bundle, paths_for


@dataclass
class EtcdMember:
    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    proc: ManagedProcess
    host: str = "127.0.0.1"

    @property
    def endpoint(self) -> str:
        return f"https://{self.host}:{self.client_port}"


@dataclass
class EtcdCluster:
    members: list[EtcdMember] = field(default_factory=list)

    @property
    def endpoints(self) -> tuple[str, ...]:
        return tuple(m.endpoint for m in self.members)

    def start(self) -> None:
        for m in self.members:
            m.proc.start()

    def stop(self) -> None:
        for m in self.members:
            m.proc.stop()

    def member(self, name: str) -> EtcdMember:
        return next(m for m in self.members if m.name == name)


def etcd_binary() -> str:
    found = shutil.which("etcd") or next(
        (p for p in ("/usr/bin/etcd", "/usr/local/bin/etcd") if Path(p).exists()), None
    )
    if not found:
        raise ConfigError(
            "no `etcd` binary on PATH; install it (Debian/Ubuntu: apt-get install etcd-server) or run `make install`"
        )
    return found


def etcd_version() -> str:
    out = subprocess.run([etcd_binary(), "--version"], capture_output=True, text=True, timeout=10).stdout
    return out.splitlines()[0].split(":", 1)[-1].strip() if out else "unknown"


def member_argv(
    name: str,
    host: str,
    ports: tuple[int, int],
    data_dir: Path,
    cert_dir: Path,
    initial_cluster: str,
    state: str = "new",
    token: str = "kunlun-local",
    quota_bytes: int = 2 * 1024**3,
    compaction_retention: str = "1h",
    heartbeat_ms: int = 100,
    election_ms: int = 1000,
) -> list[str]:
    """The command line of one TLS etcd member (`state` "existing" for a member joining a running
    cluster after `cluster etcd member add`). `cert_dir`: the member's own certificate folder."""
    cp, pp = ports
    certs = paths_for(cert_dir, "etcd", name)
    ca = cert_dir / ETCD_CA
    return [
        etcd_binary(),
        f"--name={name}",
        f"--data-dir={data_dir}",
        f"--listen-client-urls=https://{host}:{cp}",
        f"--advertise-client-urls=https://{host}:{cp}",
        f"--listen-peer-urls=https://{host}:{pp}",
        f"--initial-advertise-peer-urls=https://{host}:{pp}",
        f"--initial-cluster={initial_cluster}",
        f"--initial-cluster-state={state}",
        f"--initial-cluster-token={token}",
        f"--cert-file={certs.cert}",
        f"--key-file={certs.key}",
        f"--trusted-ca-file={ca}",
        "--client-cert-auth",
        f"--peer-cert-file={certs.cert}",
        f"--peer-key-file={certs.key}",
        f"--peer-trusted-ca-file={ca}",
        "--peer-client-cert-auth",
        f"--peer-cert-allowed-hostname={ETCD_PEER_NAME}",
        "--auto-compaction-mode=periodic",
        f"--auto-compaction-retention={compaction_retention}",
        f"--quota-backend-bytes={quota_bytes}",
        "--experimental-watch-progress-notify-interval=5s",
        f"--heartbeat-interval={heartbeat_ms}",
        f"--election-timeout={election_ms}",
        *([f"--client-crl-file={cert_dir / ETCD_CRL}"] if (cert_dir / ETCD_CRL).exists() else []),
        "--logger=zap",
        "--log-level=warn",
    ]


def build_etcd_cluster(
    base_dir: Path,
    cert_dir: Path,
    names: tuple[str, ...] = ("etcd-1", "etcd-2", "etcd-3"),
    ports: list[tuple[int, int]] | None = None,
    quota_bytes: int = 2 * 1024**3,
    compaction_retention: str = "1h",
    heartbeat_ms: int = 100,
    election_ms: int = 1000,
    hosts: list[str] | None = None,
    wrap: Callable[[str, list[str]], list[str]] | None = None,
    token: str = "kunlun-local",
) -> EtcdCluster:
    """Describe (not start) a TLS etcd cluster; ports are picked free unless given.

    `hosts`: each member's address (default 127.0.0.1 for all); `wrap(name, argv)` returns the
    command line that runs a member's argv where it should run (the chaos suite: in its namespace).
    `compaction_retention="0"` turns auto-compaction off (the chaos suite reads the whole history).
    `token`: the cluster token; with the same names and ports it decides the etcd cluster id.
    """
    ports = ports or [(free_port(), free_port()) for _ in names]
    hosts = hosts or ["127.0.0.1"] * len(names)
    initial = ",".join(f"{n}=https://{h}:{pp}" for n, h, (_, pp) in zip(names, hosts, ports, strict=True))
    cluster = EtcdCluster()
    for name, host, (cp, pp) in zip(names, hosts, ports, strict=True):
        own = bundle(cert_dir, base_dir / name / "certs", "etcd", name)
        data_dir = base_dir / name / "data"
        data_dir.mkdir(parents=True, exist_ok=True)
        argv = member_argv(
            name,
            host,
            (cp, pp),
            data_dir,
            own,
            initial,
            token=token,
            quota_bytes=quota_bytes,
            compaction_retention=compaction_retention,
            heartbeat_ms=heartbeat_ms,
            election_ms=election_ms,
        )
        if wrap is not None:
            argv = wrap(name, argv)
        proc = ManagedProcess(name, argv, base_dir / name / "etcd.log", env={"ETCD_UNSUPPORTED_ARCH": ""})
        cluster.members.append(EtcdMember(name, cp, pp, data_dir, proc, host))
    return cluster
