"""`kunlun-installer run`: start a host's installed services where no systemd runs.

Each service is started with exactly its unit's ExecStart (EnvironmentFile, ${VAR} expansion,
User, WorkingDirectory), restarted after RestartSec when it exits (Restart=always), stopped with
SIGTERM then SIGKILL after TimeoutStopSec. KillMode=process is honoured: only the main process is
signalled, so an agent restart leaves its engine supervisors running. SIGHUP (what `upgrade
--restart` and `rollback --restart` send) re-reads the units and restarts, one at a time, only the
services whose unit text or resolved executable changed: the release's services after `current` was
switched, never etcd (the host's own binary), as `systemctl daemon-reload` then `try-restart` of the
changed units would. SIGTERM/SIGINT stops them all and exits.
"""

from __future__ import annotations

import os
import pwd
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from kunlun_installer.errors import InstallError
from kunlun_installer.host import Paths, load_state, say
from kunlun_installer.units import ROLES, ServiceSpec, command_line, parse_unit


@dataclass
class Running:
    spec: ServiceSpec
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    identity: tuple[str, str] = ("", "")
    """What the running process was started from: the unit's text and its executable's real path
    (through the `current` link)."""


def _identity(path: Path, spec: ServiceSpec) -> tuple[str, str]:
    try:
        text = path.read_text()
    except OSError:
        text = ""
    return text, os.path.realpath(spec.exec_start[0]) if spec.exec_start else ""


def _start(paths: Paths, r: Running) -> None:
    argv, extra = command_line(r.spec)
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", **extra}
    log = paths.data / "log" / f"{r.spec.unit.removesuffix('.service')}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    uid: int | None = None
    gid: int | None = None
    if r.spec.user != "root" and os.geteuid() == 0:
        pw = pwd.getpwnam(r.spec.user)
        uid, gid = pw.pw_uid, pw.pw_gid
        env["HOME"] = str(paths.data)
    r.starts += 1
    with log.open("ab") as out:
        try:
            r.proc = subprocess.Popen(
                argv,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=r.spec.working_dir or None,
                start_new_session=True,
                user=uid,
                group=gid,
                extra_groups=[] if uid is not None else None,
            )
        except OSError as e:  # what systemd reports as 203/EXEC: retried after RestartSec
            r.proc = None
            say(
                "run", f"{r.spec.unit} could not start ({e}); `kunlun-installer verify` names what is missing"
            )
            return
    say("run", f"{r.spec.unit} started (pid {r.proc.pid}, start #{r.starts}): {' '.join(argv)}")


def _stop(r: Running) -> None:
    p = r.proc
    if p is None or p.poll() is not None:
        return
    target = p.pid if r.spec.kill_mode == "process" else -p.pid
    try:
        os.kill(target, signal.SIGTERM) if target > 0 else os.killpg(p.pid, signal.SIGTERM)
        p.wait(timeout=r.spec.stop_timeout_s)
    except subprocess.TimeoutExpired:
        (os.kill(p.pid, signal.SIGKILL) if target > 0 else os.killpg(p.pid, signal.SIGKILL))
        p.wait()
    except ProcessLookupError:
        pass
    say("run", f"{r.spec.unit} stopped (exit {p.returncode})")


def run(paths: Paths, roles: list[str] | None = None) -> int:
    state = load_state(paths)
    installed = state.get("roles") or {}
    assert isinstance(installed, dict)
    chosen = roles or sorted(installed, key=lambda x: list(ROLES).index(x))
    unit_paths = [paths.unit_dir / ROLES[role][0] for role in chosen]
    services = [Running(parse_unit(u)) for u in unit_paths]
    pid_file = paths.data / "run" / "runner.pid"
    pid_file.parent.mkdir(parents=True, exist_ok=True)
    pid_file.write_text(f"{os.getpid()}\n")
    stop = threading.Event()
    restart_all = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGHUP, lambda *_: restart_all.set())
    for u, r in zip(unit_paths, services, strict=True):
        r.identity = _identity(u, r.spec)
        _start(paths, r)
    next_start: dict[str, float] = {}
    try:
        while not stop.is_set():
            if restart_all.is_set():
                restart_all.clear()
                _restart_changed(paths, unit_paths, services, stop)
            for r in services:
                if r.proc is None or r.proc.poll() is not None:
                    due = next_start.setdefault(r.spec.unit, time.monotonic() + r.spec.restart_s)
                    if time.monotonic() >= due:
                        code = "did not start" if r.proc is None else f"exited ({r.proc.returncode})"
                        say("run", f"{r.spec.unit} {code}; restarting")
                        next_start.pop(r.spec.unit, None)
                        _start(paths, r)
            stop.wait(0.2)
    finally:
        for r in reversed(services):
            _stop(r)
        pid_file.unlink(missing_ok=True)
    return 0


def _restart_changed(
    paths: Paths, unit_paths: list[Path], services: list[Running], stop: threading.Event
) -> None:
    """One at a time (the others keep serving meanwhile), only what changed since it started."""
    for u, r in zip(unit_paths, services, strict=True):
        try:
            spec = parse_unit(u)
        except InstallError as e:  # a broken unit: keep what runs, say how to fix it
            say("run", f"{r.spec.unit}: {e}; left running")
            continue
        ident = _identity(u, spec)
        if ident == r.identity and r.proc is not None and r.proc.poll() is None:
            say("run", f"{r.spec.unit} unchanged ({ident[1]}); left running")
            continue
        _stop(r)
        r.spec, r.identity = spec, ident
        _start(paths, r)
        stop.wait(r.spec.restart_s)


def signal_runner(paths: Paths) -> bool:
    """Ask a running `run` to restart its services (after an upgrade or rollback)."""
    pid_file = paths.data / "run" / "runner.pid"
    try:
        pid = int(pid_file.read_text())
        os.kill(pid, signal.SIGHUP)
        return True
    except (FileNotFoundError, ValueError, ProcessLookupError):
        return False


def restart_services(paths: Paths) -> str:
    if Path("/run/systemd/system").is_dir():
        state = load_state(paths)
        roles = state.get("roles") or {}
        assert isinstance(roles, dict)
        units = [ROLES[r][0] for r in roles]
        subprocess.run(["systemctl", "daemon-reload"], check=False)
        for u in units:
            subprocess.run(["systemctl", "restart", u], check=False)
        return f"systemctl restart {' '.join(units)}"
    if signal_runner(paths):
        return "asked the running `kunlun-installer run` to restart its services"
    return "no systemd and no runner: start the services (kunlun-installer run)"
