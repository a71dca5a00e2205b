"""The sandboxed command: environment allowlist, device nodes, and real PID/mount namespaces (root)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kunlun_common.errors import ConfigError
from node_agent.executor.cgroups import CgroupLayout
from node_agent.executor.sandbox import (
    SETUP_FAILED_EXIT,
    Protections,
    SandboxRequest,
    SandboxSettings,
    build_env,
    build_sandboxed_command,
    detect_protections,
    require_protections,
    resolve_device_nodes,
)

PARENT_ENV = {
    "PATH": "/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "HOME": "/root",
    "TZ": "UTC",
    "LD_LIBRARY_PATH": "/opt/vendor/lib",
    "HIP_PATH": "/opt/rocm",
    "HTTPS_PROXY": "http://proxy:3128",
    "no_proxy": "localhost",
    "AWS_SECRET_ACCESS_KEY": "s3cr3t",
    "KUNLUN_AGENT_TOKEN": "t0ken",
}


def test_env_allowlist_plugin_and_spec() -> None:
    env = build_env(
        PARENT_ENV,
        plugin_env={"ASCEND_RT_VISIBLE_DEVICES": "0,1", "SHARED": "plugin"},
        spec_env={"HF_HUB_OFFLINE": "1", "SHARED": "spec", "LD_LIBRARY_PATH": "/opt/engine/lib"},
        settings=SandboxSettings(),
    )
    assert env == {
        "PATH": "/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "HOME": "/root",
        "TZ": "UTC",
        "ASCEND_RT_VISIBLE_DEVICES": "0,1",
        "SHARED": "plugin",
        "HF_HUB_OFFLINE": "1",
        "LD_LIBRARY_PATH": "/opt/engine/lib",  # asked for explicitly by the spec: allowed
    }


def test_env_defaults_path_and_user_home() -> None:
    env = build_env({}, {}, {}, SandboxSettings(), user=None)
    assert env == {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}


def test_device_nodes_resolved_and_simulated_ones_skipped() -> None:
    nodes, skipped = resolve_device_nodes(["/dev/null", "/dev/kunlun-simulated0", "/dev/null", "/dev/shm"])
    assert [(n.path, n.kind, n.major, n.minor) for n in nodes] == [("/dev/null", "c", 1, 3)]
    assert nodes[0].mode == 0o666
    assert skipped == ("/dev/kunlun-simulated0", "/dev/shm")
    for bad in ("/etc/passwd", "/dev/../etc/passwd", "dev/null"):
        with pytest.raises(ConfigError):
            resolve_device_nodes([bad])


def test_unsandboxed_settings_run_the_bare_command(tmp_path: Path) -> None:
    settings = SandboxSettings(
        pid_namespace=False, mount_namespace=False, private_dev=False, private_tmp=False
    )
    cmd = build_sandboxed_command(
        SandboxRequest(("engine", "--x"), tmp_path), settings, parent_env=PARENT_ENV
    )
    assert cmd.argv == ("engine", "--x") and not cmd.namespaced and cmd.cwd == tmp_path
    assert "LD_LIBRARY_PATH" not in cmd.env
    with pytest.raises(ConfigError, match="mount_namespace"):
        build_sandboxed_command(SandboxRequest(("e",), tmp_path), SandboxSettings(mount_namespace=False))
    with pytest.raises(ConfigError, match="empty"):
        build_sandboxed_command(SandboxRequest((), tmp_path), settings)


def test_protection_policy() -> None:
    none = Protections(False, False, False, False, False, False, True, ("no cgroups", "no unshare"))
    assert not none.isolating()
    with pytest.raises(ConfigError, match="--allow-unsandboxed"):
        require_protections(none, allow_unsandboxed=False)
    require_protections(none, allow_unsandboxed=True)
    some = Protections(True, False, False, False, False, False)
    require_protections(some, allow_unsandboxed=False)
    restricted = SandboxSettings().restricted_to(Protections(True, True, True, True, True, False))
    assert restricted.pid_namespace and restricted.mount_namespace
    assert not restricted.private_dev and not restricted.private_tmp
    assert some.as_dict()["cgroup_memory"] is True


def test_detect_protections_without_unshare() -> None:
    p = detect_protections(
        SandboxSettings(unshare="/nonexistent/unshare"), layout=CgroupLayout(None, None, None)
    )
    assert not p.isolating()
    assert any("not found" in n for n in p.notes)


# --- real namespaces -------------------------------------------------------------------------

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and util-linux unshare"
)

PROBE = """
import json, os, sys
print(json.dumps({
    "pid": os.getpid(),
    "procs": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()),
    "dev": sorted(os.listdir("/dev")),
    "env": dict(os.environ),
    "cwd": os.getcwd(),
    "tmp": sorted(os.listdir("/tmp")),
    "uid": os.getuid(),
    "null_ok": open("/dev/null", "w").write("x") == 1,
}))
"""


class Sandboxed:
    """A sandboxed process started with a status pipe, as the supervisor does."""

    def __init__(self, tmp_path: Path, argv: tuple[str, ...], **kw: Any) -> None:
        workdir = tmp_path / "work"
        workdir.mkdir(exist_ok=True)
        self.status_r, w = os.pipe()
        self.cmd = build_sandboxed_command(
            SandboxRequest(argv, workdir, **kw), SandboxSettings(), status_fd=w
        )

    def start(self, cwd: Path | None = None) -> subprocess.Popen[bytes]:
        w = json.loads(self.cmd.argv[self.cmd.argv.index("--init") + 1])["status_fd"]
        try:
            return subprocess.Popen(
                self.cmd.argv,
                env=dict(self.cmd.env),
                cwd=cwd or self.cmd.cwd,
                pass_fds=(w,),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
        finally:
            os.close(w)

    def events(self) -> list[Any]:
        with os.fdopen(self.status_r) as f:
            return [json.loads(line) for line in f.read().splitlines()]

    def run(self, cwd: Path | None = None) -> tuple[int, str, list[Any]]:
        proc = self.start(cwd)
        out, _ = proc.communicate(timeout=30)
        return proc.returncode, out.decode(), self.events()


@needs_root
def test_detect_protections_here() -> None:
    p = detect_protections()
    assert p.pid_namespace and p.mount_namespace and p.private_dev and p.env_allowlist, p.notes


@needs_root
def test_engine_is_isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUNLUN_PARENT_SECRET", "must-not-leak")
    monkeypatch.setenv("LD_LIBRARY_PATH", "/opt/leak")
    marker = Path("/tmp") / f"kunlun-host-marker-{os.getpid()}"
    marker.touch()
    host_mounts = Path("/proc/self/mountinfo").read_text()
    try:
        box = Sandboxed(
            tmp_path,
            (sys.executable, "-c", PROBE),
            plugin_env={"ASCEND_RT_VISIBLE_DEVICES": "0"},
            spec_env={"SPEC_VAR": "yes"},
            device_nodes=("/dev/loop0", "/dev/kunlun-simulated0"),
        )
        code, out, events = box.run()
    finally:
        marker.unlink()
    assert code == 0, out
    view = json.loads(out.splitlines()[-1])
    assert view["pid"] == 2  # the sandbox init is pid 1
    assert set(view["procs"]) <= {1, 2, 3}, view["procs"]
    expected_dev = {
        "fd",
        "full",
        "null",
        "random",
        "shm",
        "stderr",
        "stdin",
        "stdout",
        "tty",
        "urandom",
        "zero",
    }
    if Path("/dev/loop0").exists():
        expected_dev.add("loop0")
    assert set(view["dev"]) == expected_dev  # no /dev/loop1, /dev/vda, /dev/kvm...
    assert box.cmd.skipped_devices == ("/dev/kunlun-simulated0",)
    assert view["null_ok"]
    env = view["env"]
    assert "KUNLUN_PARENT_SECRET" not in env and "LD_LIBRARY_PATH" not in env
    assert env["ASCEND_RT_VISIBLE_DEVICES"] == "0" and env["SPEC_VAR"] == "yes"
    assert view["cwd"] == str(tmp_path / "work")
    assert marker.name not in view["tmp"]
    assert events == [{"event": "started", "ns_pid": 2}, {"event": "exited", "exit_code": 0, "signal": None}]
    assert Path("/proc/self/mountinfo").read_text() == host_mounts  # nothing propagated to the host


@needs_root
def test_engine_runs_as_unprivileged_user(tmp_path: Path) -> None:
    box = Sandboxed(tmp_path, ("sh", "-c", "id -u; id -g; echo $HOME; touch ./owned"), user="nobody")
    os.chown(box.cmd.cwd, 65534, 65534)
    code, out, _ = box.run()
    assert code == 0, out
    assert out.split()[:2] == ["65534", "65534"]
    assert (box.cmd.cwd / "owned").stat().st_uid == 65534


@needs_root
def test_init_reports_signal_deaths(tmp_path: Path) -> None:
    code, _, events = Sandboxed(tmp_path, ("sh", "-c", "kill -KILL $$")).run()
    assert events[-1] == {"event": "exited", "exit_code": None, "signal": 9}
    assert code != 0  # unshare's own status is not trustworthy here: the status pipe is


@needs_root
def test_init_forwards_sigterm_to_the_engine(tmp_path: Path) -> None:
    handler = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(7))\n"
        "print('ready', flush=True)\n"
        "time.sleep(30)\n"
    )
    box = Sandboxed(tmp_path, (sys.executable, "-c", handler))
    proc = box.start()
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        init_pid = _children(proc.pid)[0]
        os.kill(init_pid, signal.SIGTERM)  # pid 1 of the namespace forwards it to the engine
        assert proc.wait(timeout=10) == 7
    finally:
        proc.kill()
        proc.wait()
    assert box.events()[-1] == {"event": "exited", "exit_code": 7, "signal": None}


def _children(pid: int) -> list[int]:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        if kids:
            return [int(k) for k in kids]
        time.sleep(0.01)
    raise AssertionError(f"{pid} has no children")


@needs_root
def test_setup_failure_is_reported(tmp_path: Path) -> None:
    box = Sandboxed(tmp_path, ("true",))
    shutil.rmtree(box.cmd.cwd)
    code, out, events = box.run(cwd=tmp_path)
    assert code == SETUP_FAILED_EXIT
    assert events[0]["event"] == "error" and "setup failed" in events[0]["message"]
    assert "kunlun-sandbox: setup failed" in out
