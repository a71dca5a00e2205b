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
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from chaos.netns import Topology

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
