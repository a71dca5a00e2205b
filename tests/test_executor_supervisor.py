"""The per-instance supervisor with real processes, namespaces and cgroups (root only for most)."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from kunlun_common.errors import PermanentError
from node_agent.executor.cgroups import CgroupLimits, InstanceCgroup, detect_layout, remove_parent_if_empty
from node_agent.executor.sandbox import SandboxSettings
from node_agent.executor.supervisor import (
    ExitRecord,
    LineSplitter,
    LogSettings,
    RotatingLineLog,
    SupervisorHandle,
    SupervisorSpec,
    adopt,
    atomic_write_json,
    launch,
    process_start_ticks,
    read_exit,
    read_state,
    stop,
)

ROOT = Path(__file__).resolve().parents[1]
LAYOUT = detect_layout()
needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None or LAYOUT.memory is None,
    reason="needs root, util-linux unshare and a memory cgroup controller",
)


def wait_for(predicate: Callable[[], object], timeout_s: float, what: str) -> None:
    """Poll `predicate` until it is truthy; fail the test naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.02)


def alive(pid: int | None) -> bool:
    return pid is not None and process_start_ticks(pid) is not None


def log_lines(instance_dir: Path, name: str = "engine.log") -> list[str]:
    """All lines of the engine log and its rotated copies, oldest first."""
    rotated = sorted(instance_dir.glob(f"{name}.*"), key=lambda p: int(p.suffix[1:]), reverse=True)
    lines: list[str] = []
    for path in [*rotated, instance_dir / name]:
        if path.exists():
            lines.extend(path.read_text().splitlines())
    return lines


class Harness:
    """Builds specs under tmp_path with a unique cgroup parent and cleans every trace up."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.parent = f"kunlun-test-{uuid.uuid4().hex[:8]}"
        self.dirs: list[Path] = []

    def spec(self, name: str, argv: tuple[str, ...], **kw: object) -> SupervisorSpec:
        base = SupervisorSpec(
            instance_id=name,
            instance_dir=self.tmp / name,
            argv=argv,
            spec_env={"PYTHONPATH": str(ROOT)},
            limits=CgroupLimits(memory_bytes=512 << 20, pids_max=256, cpu_cores=1.0),
            cgroup_parent=self.parent,
            stop_grace_s=5.0,
        )
        self.dirs.append(base.instance_dir)
        return replace(base, **kw)  # type: ignore[arg-type]

    def cleanup(self) -> None:
        for d in self.dirs:
            handle = adopt(d)
            if handle is not None:
                stop(handle, grace_s=0.2, timeout_s=5)
        for mount in {m.mount_point for m in (LAYOUT.memory, LAYOUT.pids, LAYOUT.cpu) if m is not None}:
            base = mount / self.parent
            if base.is_dir():
                for child in base.iterdir():
                    if child.is_dir():
                        InstanceCgroup(LAYOUT, child.name, self.parent).remove()
        remove_parent_if_empty(LAYOUT, self.parent)


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Harness]:
    h = Harness(tmp_path)
    try:
        yield h
    finally:
        h.cleanup()


def py(code: str) -> tuple[str, ...]:
    return (sys.executable, "-c", code)


def wait_exit(handle: SupervisorHandle, timeout_s: float = 20) -> ExitRecord:
    wait_for(lambda: read_exit(handle.instance_dir) is not None, timeout_s, "exit.json")
    record = read_exit(handle.instance_dir)
    assert record is not None
    wait_for(lambda: not alive(handle.supervisor_pid), 10, "supervisor exit")
    return record


def cgroup_gone(h: Harness, name: str) -> bool:
    return not InstanceCgroup(LAYOUT, name, h.parent).exists()


# --- pure parts ---------------------------------------------------------------------------------


def test_spec_json_round_trip(tmp_path: Path) -> None:
    spec = SupervisorSpec(
        instance_id="i",
        instance_dir=tmp_path,
        argv=("a", "b"),
        plugin_env={"X": "1"},
        device_nodes=("/dev/null",),
        limits=CgroupLimits(memory_bytes=1 << 30, cpu_cores=2.5),
        sandbox=SandboxSettings(private_dev=False),
        logs=LogSettings(max_bytes=1000),
    )
    assert SupervisorSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec
    with pytest.raises(PermanentError, match="unknown"):
        SupervisorSpec.from_json({**spec.to_json(), "surprise": 1})


def test_rotating_log_keeps_lines_whole(tmp_path: Path) -> None:
    rng = random.Random(7)
    expected = [f"line {i:05d} " + "y" * rng.randint(0, 200) for i in range(3000)]
    data = "".join(line + "\n" for line in expected).encode() + b"unterminated tail"
    log = RotatingLineLog(tmp_path / "engine.log", max_bytes=4096, backup_count=10_000)
    splitter = LineSplitter(max_line_bytes=1 << 20)
    pos = 0
    while pos < len(data):
        step = rng.randint(1, 9000)
        log.write_lines(splitter.feed(data[pos : pos + step]))
        pos += step
    log.write_lines(splitter.flush())
    log.close()
    files = list(tmp_path.glob("engine.log*"))
    assert len(files) > 50
    for f in files:
        content = f.read_bytes()
        assert len(content) <= 4096 and content.endswith(b"\n")
    assert log_lines(tmp_path) == [*expected, "unterminated tail"]


def test_rotation_drops_only_whole_old_files_and_keeps_huge_lines(tmp_path: Path) -> None:
    log = RotatingLineLog(tmp_path / "e.log", max_bytes=100, backup_count=2)
    for i in range(50):
        log.write_lines(f"{i:03d} {'z' * 40}\n".encode())
    log.write_lines(b"H" * 500 + b"\n")  # longer than max_bytes: kept whole in its own file
    log.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.log", "e.log.1", "e.log.2"]
    assert (tmp_path / "e.log").read_bytes() == b"H" * 500 + b"\n"
    kept = log_lines(tmp_path, "e.log")[:-1]
    assert [int(x.split()[0]) for x in kept] == list(range(50 - len(kept), 50))
    splitter = LineSplitter(max_line_bytes=10)
    assert splitter.feed(b"a" * 25) == b"a" * 10 + b"\n" + b"a" * 10 + b"\n"
    assert splitter.flush() == b"aaaaa\n"


def test_adopt_rejects_foreign_pids(tmp_path: Path) -> None:
    me = os.getpid()
    atomic_write_json(
        tmp_path / "state.json",
        {
            "instance_id": "x",
            "supervisor_pid": me,
            "supervisor_start": process_start_ticks(me),
            "status": "running",
        },
    )
    assert adopt(tmp_path) is None  # alive, but not a supervisor of this instance
    assert adopt(tmp_path / "missing") is None


# --- real supervisors ----------------------------------------------------------------------------


@needs_root
def test_oom_kill_is_read_from_the_cgroup_counter(harness: Harness) -> None:
    engine = (sys.executable, "-m", "node_agent.testengine", "--port", "0", "--memory-mb", "1024")
    spec = harness.spec("oom", engine, limits=CgroupLimits(memory_bytes=160 << 20))
    record = wait_exit(launch(spec))
    assert record.cause == "oom_killed"
    assert record.oom_killed is True and (record.oom_kill_count or 0) >= 1
    assert record.signal == signal.SIGKILL and record.exit_code is None
    assert cgroup_gone(harness, "oom")
    assert read_state(spec.instance_dir)["status"] == "exited"  # type: ignore[index]


@needs_root
@pytest.mark.parametrize(
    ("code", "cause", "exit_code", "sig"),
    [
        ("import sys; sys.exit(137)", "exited", 137, None),  # 137 is just a number, not an OOM
        ("import os; os.kill(os.getpid(), 9)", "signaled", None, 9),  # SIGKILL, but no OOM kill
    ],
)
def test_exit_status_is_recorded_without_guessing(
    harness: Harness, code: str, cause: str, exit_code: int | None, sig: int | None
) -> None:
    record = wait_exit(launch(harness.spec(f"exit-{cause}", py(code))))
    assert (record.cause, record.exit_code, record.signal) == (cause, exit_code, sig)
    assert record.oom_killed is False and record.oom_kill_count == 0


@needs_root
def test_parent_environment_does_not_leak(harness: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUNLUN_AGENT_SECRET", "must-not-leak")
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy:3128")
    code = "import json, os; print('ENV ' + json.dumps(dict(os.environ)), flush=True)"
    spec = harness.spec("env", py(code), plugin_env={"MLU_VISIBLE_DEVICES": "3"})
    record = wait_exit(launch(spec))
    assert record.cause == "exited" and record.exit_code == 0
    env_line = next(line for line in log_lines(spec.instance_dir) if line.startswith("ENV "))
    env = json.loads(env_line[4:])
    assert "KUNLUN_AGENT_SECRET" not in env and "HTTPS_PROXY" not in env
    assert env["MLU_VISIBLE_DEVICES"] == "3" and env["PYTHONPATH"] == str(ROOT)


AGENT = """
import json, sys, time
from node_agent.executor.supervisor import SupervisorSpec, launch
handle = launch(SupervisorSpec.from_json(json.loads(sys.argv[1])))
print(json.dumps({"engine_pid": handle.engine_pid, "supervisor_pid": handle.supervisor_pid}), flush=True)
time.sleep(120)
"""
TICKER = "import itertools, time\nfor i in itertools.count():\n    print(f'tick {i}', flush=True)\n    time.sleep(0.02)\n"


@needs_root
def test_engine_survives_its_launcher_and_is_adopted_then_stopped(harness: Harness) -> None:
    spec = harness.spec("adopt", py(TICKER))
    agent = subprocess.Popen(
        [sys.executable, "-c", AGENT, json.dumps(spec.to_json())],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert agent.stdout is not None
        launched = json.loads(agent.stdout.readline())
    finally:
        agent.kill()  # kill -9 the "agent" that launched the supervisor
        agent.wait()
    engine_pid = launched["engine_pid"]
    assert alive(engine_pid)
    ticks = len(log_lines(spec.instance_dir))
    wait_for(lambda: len(log_lines(spec.instance_dir)) > ticks + 5, 10, "the engine to keep logging")

    handle = adopt(spec.instance_dir)
    assert handle is not None
    assert (handle.engine_pid, handle.supervisor_pid) == (engine_pid, launched["supervisor_pid"])
    with pytest.raises(PermanentError, match="already has a live supervisor"):
        launch(spec)

    record = stop(handle, grace_s=5)
    assert record is not None and record.cause == "stopped" and record.signal == signal.SIGTERM
    assert not alive(engine_pid) and not alive(handle.supervisor_pid)
    assert cgroup_gone(harness, "adopt")
    assert adopt(spec.instance_dir) is None


@needs_root
def test_stop_escalates_to_sigkill_after_the_grace(harness: Harness) -> None:
    stubborn = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('up', flush=True)\ntime.sleep(60)"
    handle = launch(harness.spec("stubborn", py(stubborn)))
    wait_for(lambda: "up" in log_lines(handle.instance_dir), 10, "engine up")
    started = time.monotonic()
    record = stop(handle, grace_s=0.3)
    assert time.monotonic() - started < 5
    assert record is not None and record.cause == "stopped" and record.signal == signal.SIGKILL
    assert not alive(handle.engine_pid)
    assert cgroup_gone(harness, "stubborn")


WRITER = """
import sys
for i in range(60000):
    sys.stdout.write(f"out {i:06d} " + "x" * 40 + "\\n")
    if i % 3 == 0:
        sys.stderr.write(f"err {i:06d}\\n")
"""


@needs_root
def test_heavy_logging_across_rotation_loses_and_duplicates_nothing(harness: Harness) -> None:
    logs = LogSettings(max_bytes=64 * 1024, backup_count=1000)
    spec = harness.spec("logs", py(WRITER), logs=logs)
    record = wait_exit(launch(spec))
    assert record.cause == "exited" and record.exit_code == 0
    files = list(spec.instance_dir.glob("engine.log*"))
    assert len(files) > 20
    assert all(f.stat().st_size <= logs.max_bytes for f in files)
    lines = log_lines(spec.instance_dir)
    assert [x for x in lines if x.startswith("out ")] == [f"out {i:06d} " + "x" * 40 for i in range(60000)]
    assert [x for x in lines if x.startswith("err ")] == [f"err {i:06d}" for i in range(0, 60000, 3)]
    assert len(lines) == 80000


@needs_root
def test_test_engine_heavy_logging_stopped_mid_stream(harness: Harness) -> None:
    engine = (sys.executable, "-m", "node_agent.testengine", "--port", "0", "--log-lines-per-second", "20000")
    spec = harness.spec("engine-logs", engine, logs=LogSettings(max_bytes=32 * 1024, backup_count=2000))
    handle = launch(spec)
    seq = re.compile(r"log seq=(\d+) ")

    def seen() -> list[int]:
        return [int(m.group(1)) for line in log_lines(spec.instance_dir) if (m := seq.search(line))]

    wait_for(lambda: len(seen()) > 5000, 15, "5000 log lines")
    record = stop(handle, grace_s=5)
    assert record is not None and record.cause == "stopped"
    numbers = seen()
    assert numbers == list(range(len(numbers)))
    assert len(list(spec.instance_dir.glob("engine.log.*"))) > 5


@needs_root
def test_setup_failure_is_reported_by_launch(harness: Harness) -> None:
    spec = harness.spec("bad", py("pass"), cgroup_parent="../escape")
    with pytest.raises(PermanentError, match="failed to start"):
        launch(spec)
    record = read_exit(spec.instance_dir)
    assert record is not None and record.cause == "failed" and "invalid cgroup parent" in record.message


@needs_root
def test_engine_dies_with_a_killed_supervisor_and_stop_cleans_up(harness: Harness) -> None:
    handle = launch(harness.spec("orphan", py(TICKER)))
    engine_pid = handle.engine_pid
    assert alive(engine_pid)
    os.kill(handle.supervisor_pid, signal.SIGKILL)
    wait_for(lambda: not alive(engine_pid), 10, "the engine to follow its supervisor (PR_SET_PDEATHSIG)")
    record = stop(handle, grace_s=1)
    assert record is not None and record.cause == "stopped" and "supervisor lost" in record.message
    assert cgroup_gone(harness, "orphan")
    assert read_state(handle.instance_dir)["status"] == "exited"  # type: ignore[index]


@needs_root
def test_unsandboxed_engine_still_gets_cgroup_and_env_allowlist(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LD_LIBRARY_PATH", "/opt/leak")
    bare = SandboxSettings(pid_namespace=False, mount_namespace=False, private_tmp=False, private_dev=False)
    script = "echo pid $$ ${LD_LIBRARY_PATH:-none}; exec sleep 60"  # sh: nobody cannot run root's python
    spec = harness.spec("bare", ("sh", "-c", script), sandbox=bare, user="nobody")
    handle = launch(spec)
    wait_for(lambda: any(x.startswith("pid ") for x in log_lines(spec.instance_dir)), 10, "engine output")
    line = next(x for x in log_lines(spec.instance_dir) if x.startswith("pid "))
    assert line == f"pid {handle.engine_pid} none"  # host pid namespace, clean environment
    assert Path(f"/proc/{handle.engine_pid}/status").read_text().count("65534") >= 2  # Uid/Gid lines
    assert handle.engine_pid in InstanceCgroup(LAYOUT, "bare", harness.parent).pids()
    record = stop(handle, grace_s=5)
    assert record is not None and record.cause == "stopped" and record.signal == signal.SIGTERM
    assert not alive(handle.engine_pid) and cgroup_gone(harness, "bare")
