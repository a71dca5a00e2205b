"""Engines run unprivileged: own user, no capabilities, no_new_privs, a seccomp allowlist, a
read-only host file system with the agent's folders hidden. Real sandboxed processes (root only),
each running a small Python payload as the engine command that reports what it could do."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kunlun_common.errors import ConfigError
from node_agent.executor.hardening import plan_hardening, protect_key_folder
from node_agent.executor.sandbox import (
    Protections,
    SandboxRequest,
    SandboxSettings,
    build_sandboxed_command,
)
from node_agent.executor.supervisor import SupervisorSpec, adopt, launch, read_state, stop
from node_agent.settings import ExecutorSettings

ENGINE_USER = "kunlun-engine"
ROOT = Path(__file__).resolve().parents[1]
needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and util-linux unshare"
)

# The engine payload: argv[1] is a JSON task list; prints one JSON line of results.
PAYLOAD = r"""
import ctypes, errno, json, os, signal, subprocess, sys
tasks = json.loads(sys.argv[1])
out = {"status": {}, "read": {}, "write": {}, "syscall": {}, "run": {}}
for line in open("/proc/self/status"):
    key, _, value = line.partition(":")
    if key in ("Uid", "NoNewPrivs", "Seccomp", "CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        out["status"][key] = value.split()
def outcome(fn):
    try:
        fn()
        return "ok"
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno))
for path in tasks.get("read", []):
    out["read"][path] = outcome(lambda: open(path, "rb").read())
for path in tasks.get("write", []):
    def write(path=path):
        with open(path, "w") as f:
            f.write("x")
    out["write"][path] = outcome(write)
libc = ctypes.CDLL(None, use_errno=True)
for name, call in tasks.get("syscall", {}).items():
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        buf = ctypes.create_string_buffer(256)
        args = [ctypes.c_long(a) if isinstance(a, int) else (buf if a == "buf" else ctypes.c_char_p(a.encode()))
                for a in call[1:]]
        rc = libc.syscall(ctypes.c_long(call[0]), *args)
        err = ctypes.get_errno()
        os.write(w, json.dumps(["ok", rc] if rc >= 0 else ["errno", errno.errorcode.get(err, str(err))]).encode())
        os._exit(0)
    os.close(w)
    reply = os.read(r, 4096)
    _, status = os.waitpid(pid, 0)
    sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
    out["syscall"][name] = ["signal", signal.Signals(sig).name] if sig else json.loads(reply)
for name, argv in tasks.get("run", {}).items():
    p = subprocess.run(argv, capture_output=True, text=True)
    out["run"][name] = [p.returncode, p.stdout.strip(), p.stderr.strip()[-200:]]
print(json.dumps(out), flush=True)
"""


def syscall_numbers(*names: str) -> dict[str, int]:
    import pyseccomp

    return {n: pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, n) for n in names}


def run_engine(
    workdir: Path,
    tasks: dict[str, Any],
    settings: SandboxSettings,
    user: str | None = ENGINE_USER,
    **kw: Any,
) -> dict[str, Any]:
    """Run PAYLOAD sandboxed as the supervisor would; return its report."""
    workdir.mkdir(parents=True, exist_ok=True)
    status_r, status_w = os.pipe()
    request = SandboxRequest((sys.executable, "-c", PAYLOAD, json.dumps(tasks)), workdir, user=user, **kw)
    cmd = build_sandboxed_command(request, settings, status_fd=status_w)
    if cmd.user is not None:
        for folder in [str(workdir), *request.writable_paths]:
            os.chown(folder, cmd.user.uid, cmd.user.gid)
    try:
        proc = subprocess.run(
            cmd.argv,
            env=dict(cmd.env),
            cwd=cmd.cwd,
            pass_fds=(status_w,),
            capture_output=True,
            timeout=60,
        )
    finally:
        os.close(status_w)
        os.close(status_r)
    lines = proc.stdout.decode().splitlines()
    assert lines, f"engine printed nothing (exit {proc.returncode}): {proc.stderr.decode()[-2000:]}"
    report: dict[str, Any] = json.loads(lines[-1])
    return report


@pytest.fixture
def host_dir() -> Iterator[Path]:
    """A folder on the host's real file system (not under /tmp or /dev/shm, which engines get
    private copies of), so the read-only view and the hidden folders are what stops the engine."""
    d = Path(tempfile.mkdtemp(prefix="kunlun-confine-", dir="/var/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def host_layout(tmp_path: Path) -> dict[str, Path]:
    """An agent's folders as on a node: certificates, state with an instance, a model, an outside folder."""
    certs = tmp_path / "certs"
    (certs / "agent").mkdir(parents=True)
    key = certs / "agent" / "node-a.key"
    key.write_text("-----BEGIN PRIVATE KEY-----\nsecret\n")
    key.chmod(0o644)  # the worst case: only the mount view protects it
    state = tmp_path / "state"
    instance = state / "instances" / "i-1"
    cache = state / "cache" / "k1"
    model = state / "packages" / "m1"
    for d in (instance, cache, model):
        d.mkdir(parents=True)
    (instance / "spec.json").write_text("{}")
    (model / "weights.bin").write_text("w")
    outside = tmp_path / "outside"
    outside.mkdir()
    for d in (tmp_path, state, state / "instances", instance, outside, model):
        d.chmod(0o777)  # only the read-only view stops writes
    return {
        "certs": certs,
        "key": key,
        "state": state,
        "instance": instance,
        "work": instance / "work",
        "cache": cache,
        "model": model,
        "outside": outside,
    }


def confined(paths: dict[str, Path]) -> SandboxSettings:
    return SandboxSettings(hidden_paths=(str(paths["certs"]), str(paths["state"])))


@needs_root
def test_engine_cannot_read_the_agent_key_nor_its_state(host_dir: Path) -> None:
    tmp_path = host_dir
    paths = host_layout(tmp_path)
    report = run_engine(
        paths["work"],
        {
            "read": [
                str(paths["key"]),
                str(paths["instance"] / "spec.json"),
                str(paths["model"] / "weights.bin"),
            ]
        },
        confined(paths),
        writable_paths=(str(paths["cache"]),),
        readable_paths=(str(paths["model"]),),
    )
    assert report["read"] == {
        str(paths["key"]): "ENOENT",  # the certificate folder is an empty tmpfs in the engine's view
        str(paths["instance"] / "spec.json"): "ENOENT",  # so is the agent's state, but for its own folders
        str(paths["model"] / "weights.bin"): "ok",
    }
    assert paths["key"].read_text().endswith("secret\n")  # the host still has it


@needs_root
def test_engine_cannot_write_outside_its_folders(host_dir: Path) -> None:
    tmp_path = host_dir
    paths = host_layout(tmp_path)
    targets = {
        "work": paths["work"] / "ok",
        "cache": paths["cache"] / "ok",
        "tmp": Path("/tmp/kunlun-engine-private-ok"),
        "shm": Path("/dev/shm/ok"),
        "outside": paths["outside"] / "escaped",
        "model": paths["model"] / "escaped",
        "instance": paths["instance"] / "exit.json",
        "etc": Path("/etc/kunlun-escaped"),
        "var-tmp": Path("/var/tmp/kunlun-escaped"),
        "repo": ROOT / "kunlun-escaped",
    }
    report = run_engine(
        paths["work"],
        {"write": [str(t) for t in targets.values()]},
        confined(paths),
        writable_paths=(str(paths["cache"]),),
        readable_paths=(str(paths["model"]),),
    )
    got = {name: report["write"][str(t)] for name, t in targets.items()}
    allowed = {"work", "cache", "tmp", "shm"}
    assert {n for n, r in got.items() if r == "ok"} == allowed, got
    for name in set(targets) - allowed:
        assert got[name] in ("EROFS", "EACCES", "ENOENT"), (name, got[name])
        assert not targets[name].exists(), name
    assert (paths["work"] / "ok").read_text() == "x" and (paths["cache"] / "ok").read_text() == "x"
    assert not Path("/tmp/kunlun-engine-private-ok").exists()  # private /tmp


@needs_root
def test_engine_cannot_gain_privileges(host_dir: Path) -> None:
    tmp_path = host_dir
    paths = host_layout(tmp_path)
    suid = tmp_path / "bin"
    suid.mkdir()
    shutil.copy2("/usr/bin/id", suid / "suid-id")
    os.chown(suid / "suid-id", 0, 0)
    (suid / "suid-id").chmod(0o4755)  # a setuid-root binary the engine can run
    secret = suid / "root-only"
    secret.write_text("s")
    secret.chmod(0o600)
    tasks = {"run": {"suid": [str(suid / "suid-id"), "-u"]}, "read": [str(secret)]}
    report = run_engine(paths["work"], tasks, confined(paths), readable_paths=(str(suid),))
    uid = pwd.getpwnam(ENGINE_USER).pw_uid
    st = report["status"]
    assert st["Uid"] == [str(uid)] * 4
    assert st["NoNewPrivs"] == ["1"]
    for caps in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(st[caps][0], 16) == 0, (caps, st[caps])
    assert report["run"]["suid"][:2] == [0, str(uid)]  # the setuid bit grants nothing
    assert report["read"][str(secret)] == "EACCES"
    # even an engine left as root (--engine-user '') has no capability: root-only files stay closed
    os.chown(secret, 65534, 65534)
    report = run_engine(tmp_path / "work-root", {"read": [str(secret)]}, confined(paths), user=None)
    assert report["status"]["Uid"] == ["0"] * 4 and report["status"]["NoNewPrivs"] == ["1"]
    assert int(report["status"]["CapEff"][0], 16) == 0 and int(report["status"]["CapBnd"][0], 16) == 0
    assert report["read"][str(secret)] == "EACCES"


@needs_root
def test_syscalls_outside_the_allowlist_are_refused(host_dir: Path) -> None:
    tmp_path = host_dir
    paths = host_layout(tmp_path)
    nr = syscall_numbers("ptrace", "mount", "unshare", "io_uring_setup", "keyctl", "bpf", "getpid", "socket")
    clone_newuser = 0x10000000
    calls = {
        "ptrace": [nr["ptrace"], 0, 0, 0, 0],  # PTRACE_TRACEME
        "mount": [nr["mount"], "none", "/tmp", "tmpfs", 0, 0],
        "bpf": [nr["bpf"], 0, "buf", 72],
        "unshare": [nr["unshare"], clone_newuser],  # a new user namespace: allowed to anyone by many kernels
        "io_uring_setup": [nr["io_uring_setup"], 4, "buf"],
        "keyctl": [nr["keyctl"], 0, -3, 0],  # KEYCTL_GET_KEYRING_ID of the session keyring
        "getpid": [nr["getpid"]],
        "socket": [nr["socket"], socket.AF_INET, socket.SOCK_STREAM, 0],
    }
    report = run_engine(paths["work"], {"syscall": calls}, confined(paths))
    assert report["status"]["Seccomp"] == ["2"]  # a filter is loaded
    got = report["syscall"]
    for killed in ("ptrace", "mount", "bpf"):
        assert got[killed] == ["signal", "SIGSYS"], (killed, got[killed])
    for refused in ("unshare", "io_uring_setup", "keyctl"):
        assert got[refused] == ["errno", "EPERM"], (refused, got[refused])
    assert got["getpid"][0] == "ok" and got["socket"][0] == "ok"
    # without the filter, the same calls get through to the kernel (the test can tell the difference)
    off = run_engine(tmp_path / "w2", {"syscall": calls}, SandboxSettings(seccomp=False))
    assert off["status"]["Seccomp"] == ["0"]
    assert off["syscall"]["ptrace"][0] == "ok" and off["syscall"]["keyctl"][0] == "ok"


@needs_root
def test_confined_test_engine_serves(host_dir: Path) -> None:
    tmp_path = host_dir
    paths = host_layout(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spec = SupervisorSpec(
        instance_id="i-serve",
        instance_dir=paths["instance"],
        argv=(sys.executable, "-m", "node_agent.testengine", "--host", "127.0.0.1", "--port", str(port)),
        spec_env={"PYTHONPATH": str(ROOT)},
        user=ENGINE_USER,
        writable_paths=(str(paths["cache"]),),
        sandbox=confined(paths),
        stop_grace_s=5.0,
    )
    launch(spec, timeout_s=30)
    try:
        deadline = time.monotonic() + 60
        code = 0
        while time.monotonic() < deadline and code != 200:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    code = r.status
            except OSError:
                time.sleep(0.1)
        assert code == 200, "the confined test engine never answered /health"
        state = read_state(paths["instance"])
        assert state is not None and state["engine_pid"]
        status = Path(f"/proc/{state['engine_pid']}/status").read_text()
        fields = dict(line.split(":", 1) for line in status.splitlines())
        assert fields["Uid"].split()[0] == str(pwd.getpwnam(ENGINE_USER).pw_uid)
        assert fields["NoNewPrivs"].strip() == "1" and fields["Seccomp"].strip() == "2"
        assert int(fields["CapEff"], 16) == 0
    finally:
        h = adopt(paths["instance"])
        if h is not None:
            stop(h, grace_s=2, timeout_s=15)


def _protections(**kw: bool) -> Protections:
    base = dict(
        cgroup_memory=True,
        cgroup_pids=True,
        cgroup_cpu=True,
        pid_namespace=True,
        mount_namespace=True,
        private_dev=True,
        read_only_root=True,
        seccomp=True,
    )
    base.update(kw)
    return Protections(**base)  # type: ignore[arg-type]


def test_hardening_is_on_by_default_and_every_gap_is_named() -> None:
    ex = ExecutorSettings(engine_user="nobody")
    on = plan_hardening(ex, _protections(), ("/etc/kunlun/certs",), euid=0)
    assert on.engine_user == "nobody" and on.sandbox.seccomp and on.sandbox.read_only_root
    assert on.sandbox.hidden_paths == ("/etc/kunlun/certs",)
    assert not [n for n in on.names if n.startswith("off:")]
    assert {"engine-user:nobody", "no-capabilities", "no-new-privs", "seccomp", "read-only-root"} <= set(
        on.names
    )
    assert ExecutorSettings().engine_user == ENGINE_USER
    turned_off = plan_hardening(
        ExecutorSettings(engine_user=None, engine_seccomp=False, engine_read_only_root=False),
        _protections(),
        (),
        euid=0,
    )
    assert not turned_off.sandbox.seccomp and not turned_off.sandbox.read_only_root
    assert {n for n in turned_off.names if n.startswith("off:")} == {
        "off:engine-user (--engine-user '': engines run as root)",
        "off:seccomp (--no-engine-seccomp)",
        "off:read-only-root (--no-engine-read-only-root)",
        "off:hidden-agent-folders (no private mount namespace)",
    }
    lacking = plan_hardening(ex, _protections(seccomp=False, read_only_root=False), ("/c",), euid=0)
    assert "off:seccomp (unavailable on this host)" in lacking.names
    assert "off:read-only-root (unavailable on this host)" in lacking.names
    with pytest.raises(ConfigError, match=r"does not exist.*make install"):
        plan_hardening(ExecutorSettings(engine_user="kunlun-no-such-user"), _protections(), (), euid=0)
    unprivileged_agent = plan_hardening(ExecutorSettings(), _protections(), (), euid=1000)
    assert unprivileged_agent.engine_user is None and "engine-user:uid-1000 (the agent's own, not root)" in (
        unprivileged_agent.names
    )


@needs_root
def test_agent_takes_others_off_its_key(tmp_path: Path) -> None:
    certs = tmp_path / "certs"
    (certs / "agent").mkdir(parents=True)
    key = certs / "agent" / "n.key"
    key.write_text("k")
    key.chmod(0o644)
    certs.chmod(0o755)
    changed = protect_key_folder(str(certs), key.parent, key)
    assert len(changed) == 3
    assert certs.stat().st_mode & 0o777 == 0o750 and key.stat().st_mode & 0o777 == 0o640
    assert protect_key_folder(str(certs), key.parent, key) == []
