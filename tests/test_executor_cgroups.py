"""Instance cgroups: detection from mountinfo, v2 against a cgroupfs-shaped tree, real host cgroups.

The v2 path runs against a directory tree in tmp_path shaped like cgroupfs (development hosts
have a hybrid layout with no v2 memory controller); the real-host tests use whatever the host
has (v1 memory/pids/cpu here) and need root.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kunlun_common.errors import ConfigError
from node_agent.executor.cgroups import (
    CgroupLayout,
    CgroupLimits,
    InstanceCgroup,
    detect_layout,
    layout_summary,
    remove_parent_if_empty,
)

HYBRID_MOUNTINFO = """\
22 27 0:21 / /proc rw,relatime - proc proc rw
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
35 31 0:30 / /sys/fs/cgroup/memory rw,relatime shared:9 - cgroup cgroup rw,memory
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / {unified} rw,relatime - cgroup2 cgroup2 rw
"""


def write_mountinfo(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "mountinfo"
    path.write_text(text)
    return path


def fake_v2_tree(tmp_path: Path, controllers: str = "cpuset cpu io memory hugetlb pids") -> Path:
    root = tmp_path / "cgroup2 root"  # a space: mountinfo escapes it as \040
    root.mkdir()
    (root / "cgroup.controllers").write_text(controllers + "\n")
    (root / "cgroup.subtree_control").write_text("")
    mountinfo = f"29 1 0:26 / {str(root).replace(' ', chr(92) + '040')} rw - cgroup2 cgroup2 rw,nsdelegate\n"
    write_mountinfo(tmp_path, mountinfo)
    return root


def test_detect_hybrid_layout(tmp_path: Path) -> None:
    unified = tmp_path / "unified"
    unified.mkdir()
    (unified / "cgroup.controllers").write_text("hugetlb\n")
    layout = detect_layout(write_mountinfo(tmp_path, HYBRID_MOUNTINFO.format(unified=unified)))
    assert layout_summary(layout) == {
        "memory": "v1:/sys/fs/cgroup/memory",
        "pids": "v1:/sys/fs/cgroup/pids",
        "cpu": "v1:/sys/fs/cgroup/cpu,cpuacct",
    }
    assert layout.unified == unified
    # CPU accounting rides on the co-mounted cpu hierarchy: no extra directory
    assert layout.cpuacct is not None and layout.cpuacct.mount_point == Path("/sys/fs/cgroup/cpu,cpuacct")
    cg = InstanceCgroup(layout, "i", "kunlun/n")
    assert Path("/sys/fs/cgroup/cpu,cpuacct/kunlun/n/i") in cg.unique_dirs() and len(cg.unique_dirs()) == 3


def test_detect_pure_v2_and_partial_v2(tmp_path: Path) -> None:
    root = fake_v2_tree(tmp_path)
    layout = detect_layout(tmp_path / "mountinfo")
    assert layout.available() == ("memory", "pids", "cpu")
    assert {layout.get(c).version for c in ("memory", "pids", "cpu")} == {2}  # type: ignore[union-attr]
    assert layout.memory is not None and layout.memory.mount_point == root

    # A v2 tree without cpu: cpu falls back to its v1 hierarchy, the others stay on v2.
    (root / "cgroup.controllers").write_text("memory pids\n")
    with open(tmp_path / "mountinfo", "a") as f:
        f.write("32 31 0:29 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n")
    layout = detect_layout(tmp_path / "mountinfo")
    assert layout_summary(layout) == {
        "memory": f"v2:{root}",
        "pids": f"v2:{root}",
        "cpu": "v1:/sys/fs/cgroup/cpu",
    }


def test_detect_nothing(tmp_path: Path) -> None:
    layout = detect_layout(write_mountinfo(tmp_path, "22 27 0:21 / /proc rw - proc proc rw\n"))
    assert layout.available() == ()
    assert detect_layout(tmp_path / "missing").available() == ()


def test_v2_instance_in_cgroupfs_shaped_tree(tmp_path: Path) -> None:
    root = fake_v2_tree(tmp_path)
    layout = detect_layout(tmp_path / "mountinfo")
    cg = InstanceCgroup(layout, "inst-1", parent="kunlun/prod")
    inst = root / "kunlun" / "prod" / "inst-1"
    assert cg.unique_dirs() == (inst,)
    inst.mkdir(parents=True)  # the kernel creates these optional files with the directory
    (inst / "memory.swap.max").write_text("max\n")
    (inst / "memory.oom.group").write_text("0\n")

    cg.create(CgroupLimits(memory_bytes=512 << 20, pids_max=64, cpu_cores=1.5))

    for level in (root, root / "kunlun", root / "kunlun" / "prod"):
        assert (level / "cgroup.subtree_control").read_text() == "+memory +pids +cpu"
    assert (inst / "memory.max").read_text() == str(512 << 20)
    assert (inst / "memory.swap.max").read_text() == "0"
    assert (inst / "memory.oom.group").read_text() == "1"
    assert (inst / "pids.max").read_text() == "64"
    assert (inst / "cpu.max").read_text() == "150000 100000"
    assert cg.procs_files() == (inst / "cgroup.procs",)

    (inst / "memory.events").write_text("low 0\nhigh 0\nmax 7\noom 2\noom_kill 2\noom_group_kill 1\n")
    assert cg.oom_kill_count() == 2
    (inst / "cgroup.procs").write_text("4242\n4243\n")
    assert cg.pids() == {4242, 4243}
    assert cg.memory_bytes() is None and cg.cpu_seconds() is None  # not accounted (files absent)
    (inst / "memory.current").write_text("123456789\n")
    (inst / "cpu.stat").write_text("usage_usec 2500000\nuser_usec 2000000\nsystem_usec 500000\n")
    assert cg.memory_bytes() == 123456789 and cg.cpu_seconds() == 2.5
    (inst / "cgroup.procs").write_text("")  # never SIGKILL made-up pids

    cg.remove()
    assert not inst.exists()
    remove_parent_if_empty(layout, "kunlun/prod")
    assert not (root / "kunlun" / "prod").exists()


def test_v1_usage_with_a_separate_cpuacct_hierarchy(tmp_path: Path) -> None:
    """Hybrid hosts like this one mount cpu and cpuacct apart: the instance also gets a cpuacct
    directory (and joins it), so its CPU is accounted; memory comes from the memory hierarchy."""
    mounts = {c: tmp_path / c for c in ("memory", "pids", "cpu", "cpuacct")}
    lines = [f"3{i} 31 0:3{i} / {m} rw - cgroup cgroup rw,{c}" for i, (c, m) in enumerate(mounts.items())]
    layout = detect_layout(write_mountinfo(tmp_path, "\n".join(lines) + "\n"))
    assert layout.cpuacct is not None and layout.cpuacct.mount_point == mounts["cpuacct"]
    cg = InstanceCgroup(layout, "inst-3", "kunlun/node-a")
    cg.create(CgroupLimits())
    acct = mounts["cpuacct"] / "kunlun" / "node-a" / "inst-3"
    assert acct.is_dir() and acct / "cgroup.procs" in cg.procs_files()
    assert cg.memory_bytes() is None and cg.cpu_seconds() is None
    (mounts["memory"] / "kunlun" / "node-a" / "inst-3" / "memory.usage_in_bytes").write_text("4096\n")
    (acct / "cpuacct.usage").write_text("1500000000\n")
    assert cg.memory_bytes() == 4096 and cg.cpu_seconds() == 1.5
    (acct / "cpuacct.usage").write_text("garbage\n")
    assert cg.cpu_seconds() is None  # never a made-up figure
    cg.remove()
    remove_parent_if_empty(layout, "kunlun/node-a")
    assert not any((m / "kunlun" / "node-a").exists() for m in mounts.values())


def test_v2_without_limits_writes_only_delegation(tmp_path: Path) -> None:
    root = fake_v2_tree(tmp_path, controllers="memory pids")
    cg = InstanceCgroup(detect_layout(tmp_path / "mountinfo"), "inst-2")
    cg.create(CgroupLimits())
    inst = root / "kunlun" / "inst-2"
    assert sorted(p.name for p in inst.iterdir()) == []
    assert (root / "cgroup.subtree_control").read_text() == "+memory +pids"
    assert cg.oom_kill_count() is None  # memory.events absent: not accounted


@pytest.mark.parametrize("name", ["", "../escape", "a/b", ".hidden", "x" * 200])
def test_invalid_instance_ids(name: str) -> None:
    with pytest.raises(ConfigError):
        InstanceCgroup(CgroupLayout(None, None, None), name)


@pytest.mark.parametrize("parent", ["", "/abs", "a/../b", "a//b", "a/.b"])
def test_invalid_parents(parent: str) -> None:
    with pytest.raises(ConfigError):
        InstanceCgroup(CgroupLayout(None, None, None), "ok", parent=parent)


# --- real host cgroups ---------------------------------------------------------------------------

HOST = detect_layout()
needs_host_cgroups = pytest.mark.skipif(
    os.geteuid() != 0 or HOST.memory is None or HOST.pids is None or HOST.cpu is None,
    reason="needs root and memory/pids/cpu cgroup controllers",
)


@pytest.fixture
def parent() -> Iterator[str]:
    """A unique cgroup parent, emptied and removed whatever the test did."""
    name = f"kunlun-test-{uuid.uuid4().hex[:8]}"
    yield name
    for mount in {m.mount_point for m in (HOST.memory, HOST.pids, HOST.cpu) if m is not None}:
        base = mount / name
        if base.is_dir():
            for child in base.iterdir():
                if child.is_dir():
                    InstanceCgroup(HOST, child.name, name).remove()
    remove_parent_if_empty(HOST, name)


def _spawn_in(cg: InstanceCgroup, code: str) -> subprocess.Popen[bytes]:
    files = cg.procs_files()

    def join() -> None:
        for f in files:
            f.write_text(str(os.getpid()))

    return subprocess.Popen([sys.executable, "-c", code], preexec_fn=join, stdout=subprocess.DEVNULL)


@needs_host_cgroups
def test_host_cgroup_limits_pids_kill_remove(parent: str) -> None:
    cg = InstanceCgroup(HOST, "limits", parent)
    cg.create(CgroupLimits(memory_bytes=256 << 20, pids_max=50, cpu_cores=0.5))
    for ctrl, d in cg.dirs.items():
        assert d.is_dir(), ctrl
    mem, pids, cpu = cg.dirs["memory"], cg.dirs["pids"], cg.dirs["cpu"]
    if HOST.memory is not None and HOST.memory.version == 1:
        assert int((mem / "memory.limit_in_bytes").read_text()) == 256 << 20
        assert int((cpu / "cpu.cfs_quota_us").read_text()) == 50_000
    else:
        assert int((mem / "memory.max").read_text()) == 256 << 20
        assert (cpu / "cpu.max").read_text().split() == ["50000", "100000"]
    assert (pids / "pids.max").read_text().strip() == "50"

    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        cg.add_pid(sleeper.pid)
        assert cg.pids() == {sleeper.pid}
        assert cg.oom_kill_count() == 0
        assert cg.kill_all(timeout_s=5)
        assert sleeper.wait(timeout=5) == -signal.SIGKILL
    finally:
        sleeper.kill()
        sleeper.wait()
    cg.remove()
    assert not cg.exists()


@needs_host_cgroups
def test_host_cgroup_counts_oom_kills(parent: str) -> None:
    cg = InstanceCgroup(HOST, "oom", parent)
    cg.create(CgroupLimits(memory_bytes=48 << 20))
    hog = _spawn_in(cg, "chunks = [bytes([1]) * (1 << 20) for _ in range(400)]")
    try:
        assert hog.wait(timeout=30) == -signal.SIGKILL
    finally:
        hog.kill()
        hog.wait()
    assert cg.oom_kill_count() == 1
    cg.remove()
    assert not cg.exists()


@needs_host_cgroups
def test_host_cgroup_accounts_memory_and_cpu_and_the_agent_exports_them(parent: str) -> None:
    """A real engine-like process in a real instance cgroup: its memory and CPU are read from the
    cgroup and exported by the agent's collector, `promtool check metrics` clean."""
    from prometheus_client import generate_latest

    from kunlun_common.api import agent_pb2
    from node_agent.metrics import AgentMetrics, cgroup_usage, instance_rows
    from tests.prom_helpers import promtool

    cg = InstanceCgroup(HOST, "usage", parent)
    cg.create(CgroupLimits(memory_bytes=512 << 20))
    code = (
        "import sys, time\n"
        "hold = bytearray(96 << 20)\n"
        "for i in range(0, len(hold), 4096): hold[i] = 1\n"
        "end = time.process_time() + 0.4\n"
        "while time.process_time() < end: pass\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    files = cg.procs_files()

    def join() -> None:
        for f in files:
            f.write_text(str(os.getpid()))

    proc = subprocess.Popen([sys.executable, "-c", code], preexec_fn=join, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        mem, cpu = cg.memory_bytes(), cg.cpu_seconds()
        assert mem is not None and mem >= 96 << 20, mem
        assert cpu is not None and cpu >= 0.4, cpu
        status = agent_pb2.InstanceStatus(instance_id="usage", workload_id="wl-1", phase="Running")
        metrics = AgentMetrics(
            "node-t",
            lambda: [],
            lambda: [status],
            process_collector=False,
            usage=cgroup_usage(HOST, parent),
        )
        metrics.collector.instances = instance_rows("node-t", [status])
        body = generate_latest(metrics.registry)
        labels = '{instance="usage",node="node-t",workload="wl-1"}'  # as the client library sorts them
        got = {
            line.split(" ")[0]: float(line.split(" ")[1])
            for line in body.decode().splitlines()
            if line.startswith(("kunlun_instance_memory_bytes{", "kunlun_instance_cpu_seconds_total{"))
        }
        assert got.get(f"kunlun_instance_memory_bytes{labels}", 0) >= 96 << 20, body.decode()
        assert got[f"kunlun_instance_cpu_seconds_total{labels}"] >= 0.4
        r = promtool("check", "metrics", stdin=body)
        assert r.returncode == 0, r.stdout.decode() + r.stderr.decode()
    finally:
        proc.kill()
        proc.wait()
    cg.remove()
