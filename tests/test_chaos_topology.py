"""The chaos topology: hosts in their own network namespaces reach each other over the bridge, the
nftables faults cut what they say (one way or both) and heal, and tear-down leaves nothing behind —
also when building fails half-way, and `kunlun-chaos down` after a crashed run."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from chaos.netns import PREFIX, Topology, TopologySettings, available, list_namespaces, namespace_pids

WHY = available()
pytestmark = pytest.mark.skipif(bool(WHY), reason=f"network namespaces unavailable: {WHY}")

SERVER = "import http.server,sys; http.server.HTTPServer((sys.argv[1], 8000), http.server.SimpleHTTPRequestHandler).serve_forever()"


def run_id() -> str:
    return format((os.getpid() * 31 + time.monotonic_ns()) % 0xFFFFFF, "x")


@pytest.fixture
def topo() -> Iterator[Topology]:
    t = Topology(TopologySettings(run_id(), ("alpha", "beta"), "10.213.7"))
    t.up()
    try:
        yield t
    finally:
        t.down()


def reaches(t: Topology, src: str, dst: str) -> bool:
    """A TCP connection from src to dst's server completes within 1.5 s."""
    probe = f"exec 3<>/dev/tcp/{t.addr(dst)}/8000 && echo ok"
    p = subprocess.run(
        t.exec_argv(src, ["timeout", "1.5", "bash", "-c", probe]), capture_output=True, text=True, timeout=20
    )
    return p.stdout.strip() == "ok"


def test_hosts_reach_each_other_faults_cut_and_heal_and_nothing_is_left(topo: Topology) -> None:
    servers = [
        subprocess.Popen(topo.exec_argv(h, [sys.executable, "-c", SERVER, topo.addr(h)]))
        for h in ("alpha", "beta")
    ]
    deadline = time.monotonic() + 30
    while not (reaches(topo, "beta", "alpha") and reaches(topo, "alpha", "beta")):
        assert time.monotonic() < deadline, "hosts never reached each other"
        time.sleep(0.2)
    assert reaches(topo, "client", "alpha")
    # one way: beta's output to alpha is dropped (so TCP either way between them stalls: the
    # replies vanish too), while beta still talks to everyone else
    topo.drop("beta", ["alpha"], incoming=False)
    assert not reaches(topo, "beta", "alpha")
    assert reaches(topo, "client", "beta") and reaches(topo, "client", "alpha")
    topo.heal("beta")
    assert reaches(topo, "beta", "alpha")
    # isolate alpha: nobody reaches it, it reaches nobody
    topo.isolate("alpha")
    assert not reaches(topo, "client", "alpha") and not reaches(topo, "alpha", "beta")
    topo.heal()
    assert reaches(topo, "client", "alpha")
    pids = [s.pid for s in servers]
    assert set(pids) <= set(namespace_pids(topo.hosts["alpha"].ns)) | set(
        namespace_pids(topo.hosts["beta"].ns)
    )
    removed = topo.down()
    assert sorted(removed) == sorted(topo.namespaces())
    assert not [n for n in list_namespaces() if n.startswith(topo.prefix)]
    for s in servers:
        assert s.wait(10) is not None  # killed by the tear-down
    # no link of ours is left in the machine's own namespace either
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    assert topo.prefix not in links and "br0" not in links


def test_a_failed_build_removes_what_it_made() -> None:
    t = Topology(TopologySettings(run_id(), ("alpha", "beta"), "10.213.8"))
    subprocess.run(["ip", "netns", "add", t.hosts["beta"].ns], check=True)  # makes `up` fail half-way
    with pytest.raises(RuntimeError, match="netns add"):
        t.up()
    assert not [n for n in list_namespaces() if n.startswith(t.prefix)]


def test_kunlun_chaos_down_removes_a_crashed_runs_namespaces_and_processes() -> None:
    t = Topology(TopologySettings(run_id(), ("alpha",), "10.213.9"))
    t.up()
    orphan = subprocess.Popen(t.exec_argv("alpha", ["sleep", "300"]))
    other = Topology(TopologySettings(run_id(), ("alpha",), "10.213.10"))
    other.up()  # another run's topology: `down --run-id` leaves it alone
    try:
        out = subprocess.run(
            [sys.executable, "-m", "chaos.main", "down", f"--run-id={t.settings.run_id}"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        assert "removed 3 namespaces" in out
        assert not [n for n in list_namespaces() if n.startswith(t.prefix)]
        assert set(other.namespaces()) <= set(list_namespaces())
    finally:
        other.down()
    assert not [n for n in list_namespaces() if n.startswith(PREFIX) and n.startswith(other.prefix)]
    assert orphan.wait(10) == -9


def test_bad_settings_are_refused_with_the_field() -> None:
    with pytest.raises(Exception, match="run_id"):
        Topology(TopologySettings("Bad_ID", ("a",)))
    with pytest.raises(Exception, match="subnet"):
        Topology(TopologySettings("ok", ("a",), "192.168.1"))
    with pytest.raises(Exception, match="host name"):
        Topology(TopologySettings("ok", ("Has Space",)))
