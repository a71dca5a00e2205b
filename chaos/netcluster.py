"""A whole cluster on a network-namespace topology: every etcd member, replica, agent and gateway on
its own host (namespace, address), certificates carrying each host's address. The command lines are
devcluster's; only where they run and the addresses they use differ.

Run it from the topology's `client` namespace (the chaos driver does), so probes reach the hosts.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml

from chaos.netns import Topology, TopologySettings
from controlplane.store.admin import enable_etcd_auth
from devcluster.cluster import ClusterSpec, LocalCluster
from devcluster.etcd_cluster import build_etcd_cluster
from devcluster.procs import ManagedProcess, wait_for
from kunlun_common.pki import ETCD_ADMIN, ETCD_CLIENT, ETCD_USER, create_ca, issue

ETCD = ("etcd-1", "etcd-2", "etcd-3")
REPLICA_PORT = 50051
GATEWAY_PORT = 8080
ETCD_PORTS = (2379, 2380)


def host_names(
    replicas: int = 3, nodes: tuple[str, ...] = ("node-a", "node-b"), gateways: int = 3
) -> tuple[str, ...]:
    return (
        *ETCD,
        *(f"replica-{i + 1}" for i in range(replicas)),
        *nodes,
        *(f"gateway-{i + 1}" for i in range(gateways)),
    )


@dataclass
class NetCluster(LocalCluster):
    """LocalCluster whose processes run on the hosts of `topo`."""

    topo: Topology | None = None
    etcd_tmpfs_mb: int = 0
    """When > 0: etcd-1's data dir is a tmpfs of this size (for the disk-full fault). The mount
    lives in the mount namespace of the process that starts the cluster, so it goes with it."""

    @property
    def net(self) -> Topology:
        assert self.topo is not None, "NetCluster needs a topology"
        return self.topo

    def make_certs(self) -> None:
        create_ca(self.cert_dir)
        for h in self.net.hosts.values():
            role = (
                "etcd"
                if h.name.startswith("etcd")
                else "replica"
                if h.name.startswith("replica")
                else "gateway"
                if h.name.startswith("gateway")
                else None
                if h.name == "client"
                else "agent"
            )
            if role:
                # the host's own address only: clients verify it, nothing relies on 127.0.0.1/localhost
                issue(self.cert_dir, role, h.name, hosts=(h.addr,))
        for role, name in (("operator", "admin"), ("viewer", "viewer")):
            issue(self.cert_dir, role, name, hosts=(self.net.addr("client"),))
        for user in (ETCD_USER, ETCD_ADMIN):  # etcd's own users: replicas, and maintenance
            issue(self.cert_dir, ETCD_CLIENT, user)

    def start_etcd(self, timeout: float = 90.0) -> None:
        if self.etcd_tmpfs_mb:
            mnt = self.base / "etcd" / ETCD[0] / "data"
            mnt.mkdir(parents=True, exist_ok=True)
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={self.etcd_tmpfs_mb}m", "tmpfs", str(mnt)],
                check=True,
                timeout=30,
            )
        self.etcd = build_etcd_cluster(
            self.base / "etcd",
            self.cert_dir,
            names=ETCD,
            ports=[ETCD_PORTS] * len(ETCD),
            hosts=[self.net.addr(n) for n in ETCD],
            wrap=self.net.exec_argv,
            compaction_retention="0",
            quota_bytes=256 * 1024**2,
        )
        self.etcd.start()
        self.save()
        wait_for(self._etcd_healthy, timeout, "etcd members to form a cluster", interval=0.5)
        enable_etcd_auth(self.etcd.endpoints, self.cert_dir)

    def _proc(self, host: str, argv: list[str], log: Path) -> ManagedProcess:
        return ManagedProcess(host, self.net.exec_argv(host, argv), log)

    def start_replicas(self, timeout: float = 90.0) -> None:
        for i in range(self.spec.replicas):
            name = f"replica-{i + 1}"
            self.replica_addrs[name] = f"{self.net.addr(name)}:{REPLICA_PORT}"
        for name in self.replica_addrs:
            self.restart_replica(name)
        for name in self.replicas:
            wait_for(
                lambda n=name: self.replica_serving(n), timeout, f"replica {name} to serve", interval=0.5
            )

    def restart_replica(self, name: str) -> None:
        argv = self.replica_argv(name, self.replica_addrs[name])
        proc = self._proc(name, argv, self.base / "replicas" / f"{name}.log")
        proc.start()
        self.replicas[name] = proc
        self.save()

    def node_config(self, node: str) -> Path:
        for cfg in self.spec.node_configs:
            data = yaml.safe_load(cfg.read_text())
            if data["node"]["name"] == node:
                data["node"]["address"] = self.net.addr(node)
                out = self.base / "nodes" / f"{node}.yaml"
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(yaml.safe_dump(data))
                return out
        raise KeyError(node)

    def start_agent(self, config: Path, node: str) -> ManagedProcess:
        argv = self.agent_argv(self.node_config(node), node)
        proc = self._proc(node, argv, self.base / "agents" / node / "agent.log")
        proc.start()
        self.agents[node] = proc
        self.save()
        return proc

    def start_agents(self, timeout: float = 90.0) -> None:
        for cfg, node in zip(self.spec.node_configs, self.node_names(), strict=True):
            self.start_agent(cfg, node)
        for node in self.agents:
            wait_for(lambda n=node: self.node_ready(n), timeout, f"node {node} to register", interval=0.5)

    def start_gateway(self, name: str) -> None:
        proc = self._proc(
            name,
            # plain HTTP without keys on the test's own namespace network (nothing else reaches it)
            [*self.gateway_argv(name, self.gateway_addrs[name]), "--allow-insecure-listen"],
            self.base / "gateways" / f"{name}.log",
        )
        proc.start()
        self.gateways[name] = proc
        self.save()

    def start_gateways(self, timeout: float = 60.0) -> None:
        for i in range(self.spec.gateways):
            name = f"gateway-{i + 1}"
            self.gateway_addrs[name] = f"{self.net.addr(name)}:{GATEWAY_PORT}"
            self.start_gateway(name)
        for name in self.gateways:
            wait_for(
                lambda n=name: self.gateway_serving(n), timeout, f"gateway {name} to serve", interval=0.5
            )

    def restart_etcd(self, name: str) -> None:
        m = self.etcd.member(name)
        m.proc = ManagedProcess(name, m.proc.argv, m.proc.log_path, env=m.proc.env)
        m.proc.start()

    def ledger_files(self) -> list[Path]:
        return sorted((self.base / "agents").glob("*/ledger/engines.jsonl"))

    def stop(self) -> None:
        super().stop()
        if self.etcd_tmpfs_mb:
            subprocess.run(
                ["umount", "-l", str(self.base / "etcd" / ETCD[0] / "data")], check=False, timeout=30
            )


def net_cluster(base: Path, run_id: str, subnet: str = "10.213.0", etcd_tmpfs_mb: int = 0) -> NetCluster:
    """Describe (not start) the standard chaos cluster and its topology (not built either)."""
    topo = Topology(TopologySettings(run_id, host_names(), subnet))
    spec = ClusterSpec(base_dir=base)
    return NetCluster(spec, topo=topo, etcd_tmpfs_mb=etcd_tmpfs_mb)


def in_namespace(topo: Topology, host: str = "client") -> bool:
    """Whether this process runs in `host`'s network namespace."""
    try:
        mine = os.stat("/proc/self/ns/net").st_ino
        theirs = os.stat(f"/run/netns/{topo.hosts[host].ns}").st_ino
    except OSError:
        return False
    return mine == theirs
