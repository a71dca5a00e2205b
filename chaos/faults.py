"""Faults and their heal steps, and the seeded schedule that orders them.

Every fault picks its target with the schedule's random generator, so a seed reproduces the same
sequence of kinds, targets and durations (the cluster's own timing still varies run to run).
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from chaos.clients import SERVE_WORKLOAD
from chaos.netcluster import ETCD, NetCluster
from chaos.netns import namespace_pids
from devcluster.procs import ManagedProcess
from kunlun_common.api import cluster_pb2

# kind -> (seconds the fault lasts before its heal, what it does)
KINDS: dict[str, tuple[float, str]] = {
    "replica-leader-kill": (3.0, "kill -9 the leader replica, restart it"),
    "replica-leader-pause": (8.0, "SIGSTOP the leader replica past the election TTL, SIGCONT"),
    "replica-follower-pause": (8.0, "SIGSTOP a follower replica, SIGCONT"),
    "agent-kill": (3.0, "kill -9 an agent, restart it"),
    "agent-pause": (12.0, "SIGSTOP an agent past the node lease TTL, SIGCONT"),
    "gateway-kill": (4.0, "kill -9 a gateway, restart it"),
    "gateway-pause": (6.0, "SIGSTOP a gateway, SIGCONT"),
    "etcd-kill": (4.0, "kill -9 one etcd member, restart it"),
    "etcd-leader-pause": (6.0, "SIGSTOP etcd's raft leader, SIGCONT"),
    "etcd-follower-pause": (6.0, "SIGSTOP a minority of etcd (one follower of three), SIGCONT"),
    "isolate-host": (8.0, "drop every packet to and from one replica or etcd host, then heal"),
    "partition": (8.0, "cut a minority (1 etcd member, 1 replica) from the majority, then heal"),
    "agent-replica-cut": (8.0, "cut only the link between an agent and one replica, then heal"),
    "one-way-drop": (8.0, "drop packets one way (output rule in the sender's namespace), then heal"),
    "etcd-disk-full": (6.0, "fill the small tmpfs under one etcd member's data, then free it"),
    "engines-kill": (3.0, "kill -9 every engine of one agent at once"),
    "backend-kill": (3.0, "kill -9 one engine of the serving workload (its other instance serves)"),
}


@dataclass
class Injected:
    """A fault in effect: what it hit and how to heal it."""

    kind: str
    target: str
    detail: str
    heal: Callable[[], None]


def _signal(proc: ManagedProcess, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, sig)


def etcd_leader(cluster: NetCluster) -> str:
    """The etcd member that is raft leader now, as the control plane reports it ("" when unknown)."""
    try:
        resp = cluster.call_any("ClusterStatus", cluster_pb2.ClusterStatusRequest(), timeout=3.0)
    except RuntimeError:
        return ""
    assert isinstance(resp, cluster_pb2.ClusterStatusResponse)
    by_endpoint = {m.endpoint: m.name for m in cluster.etcd.members}
    for m in resp.etcd_members:
        if m.leader:
            return by_endpoint.get(m.endpoint, m.name if m.name in ETCD else "")
    return ""


def fill_disk(path: Path) -> int:
    """Write `path` until the file system is full; return the bytes written."""
    chunk = b"\0" * (1 << 20)
    n = 0
    with path.open("wb") as f:
        try:
            while n < (8 << 30):
                f.write(chunk)
                f.flush()
                n += len(chunk)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
    return n


class Injector:
    """Applies one fault of a given kind to a running NetCluster."""

    def __init__(self, cluster: NetCluster, rng: random.Random) -> None:
        self.c = cluster
        self.rng = rng

    def leader(self) -> str:
        try:
            return self.c.leader()
        except Exception:
            return ""

    def inject(self, kind: str) -> Injected:
        return getattr(self, "_" + kind.replace("-", "_"))(kind)  # type: ignore[no-any-return]

    # ------------------------------------------------------------------ processes
    def _kill_restart(
        self, kind: str, proc: ManagedProcess, restart: Callable[[], None], what: str
    ) -> Injected:
        proc.kill()
        return Injected(kind, proc.name, f"kill -9 {what} pid {proc.pid}", restart)

    def _pause(self, kind: str, proc: ManagedProcess, what: str) -> Injected:
        _signal(proc, signal.SIGSTOP)
        return Injected(
            kind, proc.name, f"SIGSTOP {what} pid {proc.pid}", lambda: _signal(proc, signal.SIGCONT)
        )

    def _replica_leader_kill(self, kind: str) -> Injected:
        name = self.leader() or self.rng.choice(sorted(self.c.replicas))
        return self._kill_restart(kind, self.c.replicas[name], lambda: self.c.restart_replica(name), "leader")

    def _replica_leader_pause(self, kind: str) -> Injected:
        name = self.leader() or self.rng.choice(sorted(self.c.replicas))
        return self._pause(kind, self.c.replicas[name], "leader replica")

    def _replica_follower_pause(self, kind: str) -> Injected:
        lead = self.leader()
        name = self.rng.choice(sorted(n for n in self.c.replicas if n != lead))
        return self._pause(kind, self.c.replicas[name], "follower replica")

    def _agent_kill(self, kind: str) -> Injected:
        node = self.rng.choice(sorted(self.c.agents))
        return self._kill_restart(
            kind, self.c.agents[node], lambda: self._restart_agent(node), f"agent of {node}"
        )

    def _restart_agent(self, node: str) -> None:
        cfg = next(c for c, n in zip(self.c.spec.node_configs, self.c.node_names(), strict=True) if n == node)
        self.c.start_agent(cfg, node)

    def _agent_pause(self, kind: str) -> Injected:
        node = self.rng.choice(sorted(self.c.agents))
        return self._pause(kind, self.c.agents[node], f"agent of {node}")

    def _gateway_kill(self, kind: str) -> Injected:
        name = self.rng.choice(sorted(self.c.gateways))
        return self._kill_restart(kind, self.c.gateways[name], lambda: self.c.start_gateway(name), "gateway")

    def _gateway_pause(self, kind: str) -> Injected:
        name = self.rng.choice(sorted(self.c.gateways))
        return self._pause(kind, self.c.gateways[name], "gateway")

    def _etcd_kill(self, kind: str) -> Injected:
        name = self.rng.choice(ETCD)
        m = self.c.etcd.member(name)
        return self._kill_restart(kind, m.proc, lambda: self.c.restart_etcd(name), "etcd member")

    def _etcd_leader_pause(self, kind: str) -> Injected:
        name = etcd_leader(self.c) or self.rng.choice(ETCD)
        return self._pause(kind, self.c.etcd.member(name).proc, "etcd raft leader")

    def engines(self, node: str, serving: str = "") -> list[int]:
        """Pids of the engine processes on `node` (test engines or SGLang); of workload `serving` only
        when given."""
        out = []
        for pid in namespace_pids(self.c.net.hosts[node].ns):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            argv = cmd.split(b"\0")
            modules = [argv[i + 1] for i in range(len(argv) - 1) if argv[i] == b"-m"]
            if any(m.startswith((b"node_agent.testengine", b"sglang.launch_server")) for m in modules) or (
                argv and argv[0].endswith(b"kunlun-test-engine")
            ):
                if not serving or serving.encode() in argv:
                    out.append(pid)
        return out

    def _etcd_follower_pause(self, kind: str) -> Injected:
        lead = etcd_leader(self.c)
        name = self.rng.choice([n for n in ETCD if n != lead])
        return self._pause(kind, self.c.etcd.member(name).proc, "etcd follower")

    def _engines_kill(self, kind: str) -> Injected:
        nodes = sorted(self.c.agents)
        with_engines = [n for n in nodes if self.engines(n)]
        node = self.rng.choice(with_engines or nodes)
        killed = self.engines(node)
        for pid in killed:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return Injected(kind, node, f"kill -9 {len(killed)} engines {killed}", lambda: None)

    def _backend_kill(self, kind: str) -> Injected:
        engines = [(n, pid) for n in sorted(self.c.agents) for pid in self.engines(n, SERVE_WORKLOAD)]
        if not engines:
            return Injected(kind, "-", f"no engine of {SERVE_WORKLOAD} found", lambda: None)
        node, pid = self.rng.choice(engines)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        return Injected(kind, node, f"kill -9 engine pid {pid} of {SERVE_WORKLOAD}", lambda: None)

    # ------------------------------------------------------------------ network
    def _isolate_host(self, kind: str) -> Injected:
        host = self.rng.choice([*ETCD, *sorted(self.c.replicas)])
        self.c.net.isolate(host)
        return Injected(kind, host, "every packet to and from it dropped", lambda: self.c.net.heal(host))

    def _partition(self, kind: str) -> Injected:
        side = [self.rng.choice(ETCD), self.rng.choice(sorted(self.c.replicas))]
        if self.rng.random() < 0.5:
            side.append(self.rng.choice(sorted(self.c.agents)))
        self.c.net.partition(side)
        return Injected(kind, "+".join(side), "minority cut from the majority", lambda: self.c.net.heal())

    def _agent_replica_cut(self, kind: str) -> Injected:
        node = self.rng.choice(sorted(self.c.agents))
        rep = self.rng.choice(sorted(self.c.replicas))
        self.c.net.drop(node, [rep])
        self.c.net.drop(rep, [node])
        return Injected(kind, f"{node}<->{rep}", "link cut both ways", lambda: self.c.net.heal())

    def _one_way_drop(self, kind: str) -> Injected:
        pairs = [(r, e) for r in sorted(self.c.replicas) for e in ETCD] + [
            (a, r) for a in sorted(self.c.agents) for r in sorted(self.c.replicas)
        ]
        sender, receiver = self.rng.choice(pairs)
        self.c.net.drop(sender, [receiver], incoming=False)
        return Injected(
            kind,
            f"{sender}->{receiver}",
            f"output to {receiver} dropped in {sender}",
            lambda: self.c.net.heal(),
        )

    # ------------------------------------------------------------------ disk
    def _etcd_disk_full(self, kind: str) -> Injected:
        name = ETCD[0]
        filler = self.c.base / "etcd" / name / "data" / "filler"
        if not self.c.etcd_tmpfs_mb:
            return Injected(kind, name, "skipped: no tmpfs under this member", lambda: None)
        n = fill_disk(filler)

        def heal() -> None:
            filler.unlink(missing_ok=True)
            if not self.c.etcd.member(name).proc.alive():
                self.c.restart_etcd(name)

        return Injected(kind, name, f"tmpfs filled ({n >> 20} MiB written)", heal)


def schedule(rng: random.Random, count: int, kinds: list[str] | None = None) -> list[str]:
    """`count` fault kinds: every kind once per round (shuffled), so a short run covers many kinds."""
    pool = list(kinds or KINDS)
    out: list[str] = []
    while len(out) < count:
        rnd = pool[:]
        rng.shuffle(rnd)
        out.extend(rnd)
    return out[:count]
