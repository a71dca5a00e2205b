"""The executor's reconciler with real supervisors, sandboxes and cgroups (root), without a cluster.

Assignments are fed to `ExecutorManager.assign` directly; the plugin is a stand-in nvidia one.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import pytest

from kunlun_common.api import agent_pb2, types_pb2, workload_pb2
from node_agent.executor.cgroups import InstanceCgroup, detect_layout, remove_parent_if_empty
from node_agent.executor.instance import describe_exit
from node_agent.executor.logfiles import LogFollower, RotatingLineLog, read_lines
from node_agent.executor.manager import ExecutorManager, fingerprint, stop_all_instances
from node_agent.executor.prepare import NodeContext
from node_agent.executor.sandbox import SandboxSettings
from node_agent.executor.supervisor_api import ExitRecord, process_start_ticks
from node_agent.plugins.contract import AllocateResult, DevicePlugin, allocation_for
from node_agent.settings import ExecutorSettings

LAYOUT = detect_layout()
needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None or LAYOUT.memory is None,
    reason="needs root, util-linux unshare and a memory cgroup controller",
)
NODE = "node-t"


class StandInPlugin(DevicePlugin):
    name = "nvidia"
    device_type = "nvidia"

    async def list_and_watch(self) -> AsyncIterator[list[types_pb2.Device]]:  # pragma: no cover
        yield []

    async def preferred_allocation(
        self, available: Sequence[str], must_include: Sequence[str], size: int, require_p2p: bool
    ) -> list[str]:  # pragma: no cover
        return list(available)[:size]

    async def allocate(self, devices: Sequence[str]) -> AllocateResult:
        return allocation_for("nvidia", [int(d.rsplit(":", 1)[1]) for d in devices])


def device(i: int) -> types_pb2.Device:
    return types_pb2.Device(
        name=f"{NODE}/nvidia:{i}", node=NODE, device_type="nvidia", index=i, model="A100", hbm_memory_mb=40960
    )


class Harness:
    def __init__(self, tmp: Path, contact: list[float], **settings: object) -> None:
        self.parent = f"kunlun-test-{uuid.uuid4().hex[:8]}"
        defaults: dict[str, object] = {
            "probe_interval_s": 0.1,
            "restart_backoff_s": 0.2,
            "restart_backoff_max_s": 1.0,
            "stop_grace_s": 2.0,
            "disconnect_stop_s": 1.0,
            "test_engine_fallback": True,
            "engine_python": str(tmp / "no-python-here"),
            "cgroup_parent": self.parent,
        }
        defaults.update(settings)
        self.settings = ExecutorSettings(**defaults)  # type: ignore[arg-type]
        self.ctx = NodeContext(
            node=NODE,
            address="127.0.0.1",
            instances_dir=tmp / "instances",
            cache_root=None,
            settings=self.settings,
            sandbox=SandboxSettings(),
            cgroups=True,
            devices=lambda: [device(0), device(1)],
            plugin=lambda t: StandInPlugin() if t == "nvidia" else None,
        )
        self.contact = contact

    def manager(self) -> ExecutorManager:
        return ExecutorManager(self.ctx, ["cgroup-memory"], self._since_contact)

    def _since_contact(self) -> float:
        """0 (connected) unless a test set the time of the last contact."""
        return time.monotonic() - self.contact[0] if self.contact[0] else 0.0

    def cleanup(self) -> None:
        stop_all_instances(self.ctx.instances_dir, grace_s=1.0)
        remove_parent_if_empty(LAYOUT, f"{self.parent}/{NODE}")
        remove_parent_if_empty(LAYOUT, self.parent)


@pytest.fixture
def contact() -> list[float]:
    return [0.0]


@pytest.fixture
def harness(tmp_path: Path, contact: list[float]) -> Iterator[Harness]:
    h = Harness(tmp_path, contact)
    yield h
    h.cleanup()


def assignment(iid: str, dev: int = 0, generation: int = 1, **spec: object) -> agent_pb2.Assignment:
    fields: dict[str, object] = {"name": iid, "model": "m", "devices_per_instance": 1, "replicas": 1}
    fields.update(spec)
    return agent_pb2.Assignment(
        instance_id=iid,
        workload_id="w-" + iid,
        spec=workload_pb2.WorkloadSpec(**fields),  # type: ignore[arg-type]
        devices=[f"{NODE}/nvidia:{dev}"],
        generation=generation,
    )


def assignments(*items: agent_pb2.Assignment, revision: int = 1) -> agent_pb2.Assignments:
    return agent_pb2.Assignments(items=list(items), revision=revision)


async def until(predicate: Callable[[], object], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.05)


def status(m: ExecutorManager, iid: str) -> agent_pb2.InstanceStatus | None:
    return next((s for s in m.report().instances if s.instance_id == iid), None)


def phase(m: ExecutorManager, iid: str) -> str:
    st = status(m, iid)
    return st.phase if st is not None else ""


def alive(pid: int) -> bool:
    return pid > 0 and process_start_ticks(pid) is not None


# ------------------------------------------------------------------------------------ pure parts


def test_fingerprint_ignores_replicas_only() -> None:
    a = assignment("i1")
    assert fingerprint(a) == fingerprint(assignment("i1", replicas=5))
    assert fingerprint(a) != fingerprint(assignment("i1", generation=2))
    assert fingerprint(a) != fingerprint(assignment("i1", dev=1))
    assert fingerprint(a) != fingerprint(assignment("i1", engine_args=["--x"]))


def test_exit_records_in_words() -> None:
    def rec(cause: str, code: int | None, sig: int | None, oom: bool | None) -> ExitRecord:
        return ExitRecord(cause, code, sig, oom, 1 if oom else 0, "msg", 0.0, 5.0)

    oom = describe_exit(rec("oom_killed", None, 9, True))
    assert oom.reason == "OOMKilled" and oom.oom_killed and oom.exit_code == 137 and oom.ran_s == 5.0
    assert describe_exit(rec("exited", 3, None, False)).reason == "engine exited with code 3"
    assert describe_exit(rec("signaled", None, 9, False)).reason == "engine was killed by SIGKILL"
    assert describe_exit(rec("failed", 125, None, None)).reason == "engine could not start: msg"
    assert "vanished" in describe_exit(None).reason


async def test_follower_reads_across_rotations_without_loss_or_duplicates(tmp_path: Path) -> None:
    path = tmp_path / "engine.log"
    out = RotatingLineLog(path, max_bytes=300, backup_count=50)
    n = 0

    def write(k: int) -> None:
        nonlocal n
        out.write_lines(b"".join(b"line %05d\n" % i for i in range(n, n + k)))
        n += k

    write(50)
    follower = LogFollower(path, poll_s=0.01)
    got = follower.snapshot()
    assert got[-5:] == read_lines(path, tail=5) and read_lines(path) == got
    stream = follower.follow()
    for _ in range(20):
        write(7)
        while len(got) < n:
            got.extend(await asyncio.wait_for(anext(stream), 5))
    await stream.aclose()  # type: ignore[attr-defined]
    follower.close()
    out.close()
    assert got == [f"line {i:05d}" for i in range(n)]


# ------------------------------------------------------------------------------------ with engines


@needs_root
async def test_reconcile_start_keep_restart_and_remove(harness: Harness) -> None:
    m = harness.manager()
    await m.start()
    try:
        a = assignment("i1")
        m.assign(assignments(a))
        await until(lambda: phase(m, "i1") == "Running", 20, "i1 Running")
        st = status(m, "i1")
        assert st is not None and alive(st.pid) and st.endpoint.startswith("127.0.0.1:")
        assert "kunlun-test-engine" in st.reason and "CUDA_VISIBLE_DEVICES" in st.env_names
        assert InstanceCgroup(LAYOUT, "i1", f"{harness.parent}/{NODE}").exists()
        pid = st.pid
        m.assign(assignments(assignment("i1", replicas=3), revision=2))  # scaling: nothing restarts
        await asyncio.sleep(0.5)
        st = status(m, "i1")
        assert st is not None and st.pid == pid and st.phase == "Running"
        m.assign(assignments(assignment("i1", generation=2), revision=3))  # new spec: a new engine
        await until(lambda: phase(m, "i1") == "Running" and status(m, "i1").pid != pid, 20, "i1 restarted")  # type: ignore[union-attr]
        assert not alive(pid)
        m.assign(assignments(revision=4))
        await until(lambda: not m.report().instances and not m.retiring, 20, "i1 removed")
        assert not (harness.ctx.instances_dir / "i1").exists()
        assert not InstanceCgroup(LAYOUT, "i1", f"{harness.parent}/{NODE}").exists()
    finally:
        await m.close()


@needs_root
async def test_template_engine_failing_liveness_is_restarted_with_back_off(harness: Harness) -> None:
    harness.ctx = replace(
        harness.ctx,
        settings=replace(harness.settings, probe_timeout_s=0.3, probe_failure_threshold=2, stop_grace_s=0.5),
    )
    m = harness.manager()
    await m.start()
    try:
        template = f"{sys.executable} -m node_agent.testengine --host {{host}} --port {{port}} --served-model-name {{name}}"
        m.assign(assignments(assignment("tpl", engine="template", command_template=template)))
        await until(lambda: phase(m, "tpl") == "Running", 20, "tpl Running")
        st = status(m, "tpl")
        assert st is not None and st.command[0] == sys.executable and "--tp-size" not in st.command
        os.kill(st.pid, signal.SIGSTOP)  # alive but not answering
        seen: set[str] = set()

        def restarted() -> bool:
            cur = status(m, "tpl")
            assert cur is not None
            seen.add(cur.phase)
            return cur.phase == "Running" and cur.pid != st.pid and cur.restarts == 1

        await until(restarted, 20, "tpl restarted after failing its liveness probe")
        assert "CrashLoopBackOff" in seen and not alive(st.pid)
    finally:
        await m.close()


@needs_root
async def test_sglang_missing_without_fallback_fails_with_the_fix(harness: Harness) -> None:
    harness.ctx = replace(harness.ctx, settings=replace(harness.settings, test_engine_fallback=False))
    m = harness.manager()
    await m.start()
    try:
        m.assign(assignments(assignment("i2")))
        await until(lambda: phase(m, "i2") == "Failed", 20, "i2 Failed")
        st = status(m, "i2")
        assert st is not None and f"SGLang is not installed on {NODE}" in st.reason
        assert "--test-engine-fallback" in st.reason
    finally:
        await m.close()


@needs_root
async def test_new_manager_adopts_engines_and_removes_unassigned_ones(harness: Harness) -> None:
    m1 = harness.manager()
    await m1.start()
    m1.assign(assignments(assignment("keep"), assignment("drop", dev=1)))
    await until(lambda: phase(m1, "keep") == "Running" and phase(m1, "drop") == "Running", 20, "both Running")
    keep, drop = status(m1, "keep"), status(m1, "drop")
    assert keep is not None and drop is not None
    await m1.close()  # the agent goes away: the engines stay
    assert alive(keep.pid) and alive(drop.pid)
    m2 = harness.manager()
    await m2.start()
    try:
        assert not m2.report().instances and alive(drop.pid), "nothing is decided before the assignments"
        m2.assign(assignments(assignment("keep")))
        await until(lambda: phase(m2, "keep") == "Running", 20, "keep adopted")
        st = status(m2, "keep")
        assert st is not None and st.pid == keep.pid and st.ready_at_unix_ms == keep.ready_at_unix_ms
        await until(lambda: not alive(drop.pid) and not m2.retiring, 20, "drop stopped")
        assert not (harness.ctx.instances_dir / "drop").exists()
    finally:
        await m2.close()


@needs_root
async def test_stop_everything_stops_engines_for_good(harness: Harness) -> None:
    m = harness.manager()
    await m.start()
    try:
        m.assign(assignments(assignment("i4")))
        await until(lambda: phase(m, "i4") == "Running", 20, "i4 Running")
        st = status(m, "i4")
        assert st is not None
        await m.stop_everything("the agent exited")
        assert not alive(st.pid) and phase(m, "i4") == "Stopped"
        await asyncio.sleep(0.3)
        assert phase(m, "i4") == "Stopped", "nothing starts again"
    finally:
        await m.close()


@needs_root
async def test_engines_stop_when_no_replica_is_reachable_and_start_again(
    harness: Harness, contact: list[float]
) -> None:
    m = harness.manager()
    await m.start()
    try:
        m.assign(assignments(assignment("i3")))
        await until(lambda: phase(m, "i3") == "Running", 20, "i3 Running")
        st = status(m, "i3")
        assert st is not None
        contact[0] = time.monotonic() - 60  # no replica for a minute
        await until(lambda: phase(m, "i3") == "Stopped" and not alive(st.pid), 10, "i3 stopped")
        report = m.report()
        assert "no replica reachable" in report.note and "1 engine(s) stopped" in report.note
        await asyncio.sleep(0.3)
        assert phase(m, "i3") == "Stopped", "nothing restarts before fresh assignments"
        contact[0] = 0.0
        m.assign(assignments(assignment("i3"), revision=2))
        await until(lambda: phase(m, "i3") == "Running", 20, "i3 Running again")
        assert "no replica reachable" in m.report().note
    finally:
        await m.close()


def test_agent_flags() -> None:
    from kunlun_common.errors import ConfigError
    from node_agent.main import build_settings

    base = ["--config", "c.yaml", "--endpoints", "127.0.0.1:1", "--cert-dir", "certs"]
    s = build_settings(
        [
            *base,
            "--allow-unsandboxed",
            "--test-engine-fallback",
            "--disconnect-stop",
            "7",
            "--probe-interval=0.5",
        ]
    )
    e = s.executor
    assert (
        e.allow_unsandboxed
        and e.test_engine_fallback
        and e.disconnect_stop_s == 7
        and e.probe_interval_s == 0.5
    )
    d = build_settings(base).executor
    assert (
        not d.allow_unsandboxed
        and not d.test_engine_fallback
        and d.disconnect_stop_s == 5
        and d.stop_grace_s == 3
    )
    with pytest.raises(ConfigError, match="--disconnect-stop"):
        build_settings([*base, "--disconnect-stop", "0"])


def test_agent_refuses_a_deadline_shorter_than_a_failover() -> None:
    """The frozen-replica case of tests/test_cp_faults.py, as a start-up check: an agent whose disconnect deadline
    leaves no time to reach another replica after the ack timeout is refused, with the numbers."""
    from kunlun_common.errors import ConfigError
    from node_agent.agent import check_fencing
    from node_agent.main import build_settings

    base = ["--config=node.yaml", "--endpoints=127.0.0.1:1", "--cert-dir=/nonexistent"]
    with pytest.raises(ConfigError) as err:
        check_fencing(build_settings([*base, "--disconnect-stop=3"]))
    assert (
        "--ack-timeout 3s + --heartbeat-interval 1s + failover to another replica 1s = 5s is more than "
        "--disconnect-stop 3s: one frozen replica would stop every engine" in str(err.value)
    )
    check_fencing(
        build_settings([*base, "--disconnect-stop=3", "--ack-timeout=1.5", "--heartbeat-interval=0.5"])
    )
    check_fencing(build_settings(base))  # the defaults: 3 + 1 + 1 = --disconnect-stop 5
