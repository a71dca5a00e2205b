"""Hosts as network namespaces: every host gets its own namespace and address on one bridge.

Nothing is added to the machine's own (root) network namespace: the bridge lives in a namespace of
its own (`<prefix>net`), each host's veth pair is created there with one end moved into the host's
namespace as `eth0`. Addresses come from a private /24 (default 10.213.0.0/24) that exists only
inside these namespaces, so it is never routed anywhere.

Network faults are nftables rules in the affected host's own namespace (table `inet kunlun_chaos`):
dropping output to an address is a one-way cut; dropping output to and input from it is a cut link;
doing it for a set of addresses is a partition. `heal` deletes the table.

Every namespace name starts with PREFIX, so `remove_all()` (used by `kunlun-chaos down` and after a
failure) finds and removes them — killing the processes inside by pid first.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kunlun_common.errors import ConfigError

PREFIX = "kunlun-chaos-"
TABLE = "kunlun_chaos"
_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,30}$")


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and p.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed ({p.returncode}): {p.stderr.strip()}")
    return p


def available() -> str:
    """ "" when namespaces, veth, bridges and nftables work here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "nft"):
        if _run(["sh", "-c", f"command -v {tool}"], check=False).returncode != 0:
            return f"`{tool}` is missing; run `make install` (installs iproute2 and nftables)"
    return ""


@dataclass(frozen=True)
class Host:
    """One host of the topology."""

    name: str
    """Host name (also the name in certificates and logs)."""
    ns: str
    """Its network namespace."""
    addr: str
    """Its address on the bridge."""


@dataclass(frozen=True)
class TopologySettings:
    """What to build."""

    run_id: str
    """Short id of this run ([a-z0-9]); part of every namespace name."""
    hosts: tuple[str, ...]
    """Host names, one namespace each (the client host is added as `client`)."""
    subnet: str = "10.213.0"
    """First three octets of the private /24 used inside the namespaces only."""


@dataclass
class Topology:
    """The namespaces, bridge and links of one run (see the module docstring)."""

    settings: TopologySettings
    hosts: dict[str, Host] = field(default_factory=dict)
    blocked: dict[str, set[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        s = self.settings
        if not re.fullmatch(r"[a-z0-9]{1,8}", s.run_id):
            raise ConfigError(f"run_id {s.run_id!r}: expected 1-8 lowercase letters or digits")
        if not re.fullmatch(r"10\.\d{1,3}\.\d{1,3}", s.subnet):
            raise ConfigError(f"subnet {s.subnet!r}: expected the first three octets of a 10.x.y.0/24")
        names = ("client", *s.hosts)
        if len(names) > 200:
            raise ConfigError(f"hosts: at most 199, found {len(s.hosts)}")
        for i, name in enumerate(names):
            if not _NAME.match(name):
                raise ConfigError(f"host name {name!r}: expected lowercase letters, digits and '-'")
            self.hosts[name] = Host(name, f"{self.prefix}{name}", f"{s.subnet}.{10 + i}")

    @property
    def prefix(self) -> str:
        return f"{PREFIX}{self.settings.run_id}-"

    @property
    def bridge_ns(self) -> str:
        return f"{self.prefix}net"

    def addr(self, host: str) -> str:
        return self.hosts[host].addr

    def namespaces(self) -> list[str]:
        return [self.bridge_ns, *(h.ns for h in self.hosts.values())]

    # ------------------------------------------------------------------ build / remove
    def up(self) -> None:
        """Create everything; on any failure remove what was made and raise."""
        try:
            _run(["ip", "netns", "add", self.bridge_ns])
            _run(["ip", "-n", self.bridge_ns, "link", "add", "br0", "type", "bridge"])
            _run(["ip", "-n", self.bridge_ns, "link", "set", "br0", "up"])
            for i, h in enumerate(self.hosts.values()):
                _run(["ip", "netns", "add", h.ns])
                peer = f"v{i}"
                _run(
                    [
                        "ip",
                        "-n",
                        self.bridge_ns,
                        "link",
                        "add",
                        peer,
                        "type",
                        "veth",
                        "peer",
                        "name",
                        "eth0",
                        "netns",
                        h.ns,
                    ]
                )
                _run(["ip", "-n", self.bridge_ns, "link", "set", peer, "master", "br0", "up"])
                _run(["ip", "-n", h.ns, "addr", "add", f"{h.addr}/24", "dev", "eth0"])
                _run(["ip", "-n", h.ns, "link", "set", "eth0", "up"])
                _run(["ip", "-n", h.ns, "link", "set", "lo", "up"])
        except Exception:
            self.down()
            raise

    def down(self) -> list[str]:
        """Kill every process in this topology's namespaces and remove them; return what was removed."""
        return remove_namespaces([n for n in list_namespaces() if n.startswith(self.prefix)])

    def exec_argv(self, host: str, argv: Sequence[str]) -> list[str]:
        """The command line that runs `argv` on `host` (inside its namespace)."""
        return ["ip", "netns", "exec", self.hosts[host].ns, *argv]

    # ------------------------------------------------------------------ network faults
    def _ensure_table(self, host: str) -> None:
        ns = self.hosts[host].ns
        if host in self.blocked:
            return
        _run(["ip", "netns", "exec", ns, "nft", "add", "table", "inet", TABLE])
        for chain, hook in (("out", "output"), ("in", "input")):
            _run(
                [
                    "ip",
                    "netns",
                    "exec",
                    ns,
                    "nft",
                    "add",
                    "chain",
                    "inet",
                    TABLE,
                    chain,
                    "{",
                    "type",
                    "filter",
                    "hook",
                    hook,
                    "priority",
                    "0",
                    ";",
                    "policy",
                    "accept",
                    ";",
                    "}",
                ]
            )
        self.blocked[host] = set()

    def drop(self, host: str, peers: Iterable[str], *, outgoing: bool = True, incoming: bool = True) -> None:
        """On `host`, drop packets to (`outgoing`) and/or from (`incoming`) each of `peers`."""
        self._ensure_table(host)
        ns = self.hosts[host].ns
        for p in peers:
            a = self.addr(p)
            if outgoing:
                _run(
                    [
                        "ip",
                        "netns",
                        "exec",
                        ns,
                        "nft",
                        "add",
                        "rule",
                        "inet",
                        TABLE,
                        "out",
                        "ip",
                        "daddr",
                        a,
                        "drop",
                    ]
                )
            if incoming:
                _run(
                    [
                        "ip",
                        "netns",
                        "exec",
                        ns,
                        "nft",
                        "add",
                        "rule",
                        "inet",
                        TABLE,
                        "in",
                        "ip",
                        "saddr",
                        a,
                        "drop",
                    ]
                )
            self.blocked[host].add(p)

    def isolate(self, host: str) -> None:
        """Cut `host` from every other host (the link stays up; packets vanish)."""
        self.drop(host, [h for h in self.hosts if h != host])

    def partition(self, side: Iterable[str]) -> None:
        """Cut the hosts of `side` from all other server hosts (the client still reaches both sides)."""
        inside = set(side)
        outside = [h for h in self.hosts if h not in inside and h != "client"]
        for h in inside:
            self.drop(h, outside)

    def heal(self, host: str | None = None) -> None:
        """Remove the network faults of one host (all hosts when None)."""
        for h in [host] if host else list(self.blocked):
            if h in self.blocked:
                _run(
                    ["ip", "netns", "exec", self.hosts[h].ns, "nft", "delete", "table", "inet", TABLE],
                    check=False,
                )
                del self.blocked[h]


def list_namespaces() -> list[str]:
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def namespace_pids(ns: str) -> list[int]:
    out = _run(["ip", "netns", "pids", ns], check=False).stdout
    return [int(x) for x in out.split() if x.isdigit()]


def remove_namespaces(names: Sequence[str], timeout: float = 10.0) -> list[str]:
    """SIGKILL every process in each namespace (by pid), wait for them, delete the namespaces."""
    for ns in names:
        for pid in namespace_pids(ns):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
    end = time.monotonic() + timeout
    while time.monotonic() < end and any(namespace_pids(ns) for ns in names):
        time.sleep(0.1)
    removed = []
    for ns in names:
        if _run(["ip", "netns", "del", ns], check=False).returncode == 0:
            removed.append(ns)
    return removed


def remove_all() -> list[str]:
    """Remove every namespace any chaos run made (by name prefix), with its processes and links."""
    return remove_namespaces([n for n in list_namespaces() if n.startswith(PREFIX)])
