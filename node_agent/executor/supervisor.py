"""Per-instance supervisor process (in the spirit of containerd's shim and conmon).

Run as `python -m node_agent.executor.supervisor --spec FILE [--daemonize]`. It detaches into its
own session, so the agent dying or its pipes closing never kills the engine. It:

* creates the instance cgroup and starts the engine in the sandbox (`sandbox.py`), joined to
  the cgroup before exec; the engine never outlives a killed supervisor (PR_SET_PDEATHSIG);
* owns the engine's stdout/stderr and writes them, whole lines only, to a size-rotated log in
  the instance dir (`engine.log`, `engine.log.1`...): no line lost, none duplicated;
* writes `state.json` atomically (supervisor pid, engine pid, process start times, started_at,
  status starting/running/stopping/exited/failed);
* on engine exit writes `exit.json`: exit_code, signal, and oom_killed from the cgroup's own OOM
  kill counter (never guessed from exit code 137; None where no memory cgroup is used);
* on SIGTERM (or SIGINT) stops the engine (SIGTERM, then SIGKILL after the grace), then kills
  what is left in the cgroup and removes it.

The agent side uses `launch`, `adopt`, `stop` and `read_exit`. `launch` and `stop` block (poll
files with a deadline); call them from a worker thread in async code.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import structlog

from kunlun_common.errors import ConfigError, KunlunError, PermanentError, TemporaryError
from node_agent.executor.cgroups import CgroupLimits, InstanceCgroup, detect_layout
from node_agent.executor.sandbox import SandboxRequest, SandboxSettings, build_sandboxed_command

log = structlog.get_logger(__name__)

MODULE = "node_agent.executor.supervisor"
SPEC_FILE, STATE_FILE, EXIT_FILE, STOP_FILE = "spec.json", "state.json", "exit.json", "stop.json"
SUPERVISOR_LOG = "supervisor.log"
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]
_LIBC = ctypes.CDLL(None, use_errno=True)
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class LogSettings:
    """Engine log rotation."""

    file_name: str = "engine.log"
    """Log file name inside the instance dir; rotated copies get .1, .2... (1 is the newest)."""
    max_bytes: int = 10 * 1024 * 1024
    """Rotate before a write would make the file larger than this (a longer single line is kept whole)."""
    backup_count: int = 5
    """Rotated files kept; older lines are dropped deliberately."""
    max_line_bytes: int = 1024 * 1024
    """A line longer than this without a newline is written in pieces (bounds the supervisor's memory)."""


@dataclass(frozen=True)
class SupervisorSpec:
    """What one supervisor runs; written to `spec.json` in the instance dir."""

    instance_id: str
    """Instance id; names the cgroup."""
    instance_dir: Path
    """Directory holding spec, state, exit record and logs."""
    argv: tuple[str, ...]
    """Engine command line (`LaunchPlan.argv`)."""
    plugin_env: Mapping[str, str] = field(default_factory=dict)
    """Environment from the launch plan / device plugin."""
    spec_env: Mapping[str, str] = field(default_factory=dict)
    """Environment the workload spec asks for explicitly."""
    device_nodes: tuple[str, ...] = ()
    """Allocated device nodes for the private /dev."""
    workdir: Path | None = None
    """Engine working directory; default `<instance_dir>/work`."""
    user: str | None = None
    """Unprivileged user for the engine; None keeps the agent's user."""
    limits: CgroupLimits | None = None
    """Cgroup limits; None runs without a cgroup (and without OOM accounting)."""
    cgroup_parent: str = "kunlun"
    """Parent of the instance cgroups in each hierarchy."""
    sandbox: SandboxSettings = field(default_factory=SandboxSettings)
    """Namespaces, private /tmp and /dev, environment allowlist."""
    logs: LogSettings = field(default_factory=LogSettings)
    """Engine log rotation."""
    stop_grace_s: float = 30.0
    """Default time between SIGTERM and SIGKILL when stopping."""

    def effective_workdir(self) -> Path:
        """The engine's working directory."""
        return self.workdir or self.instance_dir / "work"

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict (paths as strings)."""
        data: dict[str, Any] = json.loads(json.dumps(asdict(self), default=str))
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SupervisorSpec:
        """Parse `to_json` output; raise ConfigError naming the bad field."""
        try:
            kw = _plain(cls, data)
            kw["instance_dir"] = Path(kw["instance_dir"])
            kw["workdir"] = Path(kw["workdir"]) if kw.get("workdir") else None
            kw["limits"] = CgroupLimits(**_plain(CgroupLimits, kw["limits"])) if kw.get("limits") else None
            kw["sandbox"] = SandboxSettings(**_plain(SandboxSettings, kw.get("sandbox") or {}))
            kw["logs"] = LogSettings(**_plain(LogSettings, kw.get("logs") or {}))
            return cls(**kw)
        except (TypeError, KeyError, ValueError) as exc:
            raise ConfigError(f"invalid supervisor spec: {exc}") from exc


def _plain(cls: type, data: Mapping[str, Any]) -> dict[str, Any]:
    names = {f.name for f in fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise ValueError(f"unknown {cls.__name__} fields {sorted(unknown)}")
    return {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}


@dataclass(frozen=True)
class SupervisorHandle:
    """A running supervisor, as the agent knows it."""

    instance_id: str
    """Instance id."""
    instance_dir: Path
    """Instance dir."""
    supervisor_pid: int
    """Supervisor pid (host namespace)."""
    supervisor_start: int
    """Supervisor start time in clock ticks since boot (guards against pid reuse)."""
    engine_pid: int | None
    """Engine pid (host namespace); None while starting."""
    started_at: float
    """Wall-clock start time (epoch seconds)."""


@dataclass(frozen=True)
class ExitRecord:
    """How the engine ended (`exit.json`)."""

    cause: str
    """exited, signaled, oom_killed, stopped or failed (could not start)."""
    exit_code: int | None
    """Exit status when the engine exited normally."""
    signal: int | None
    """Signal that killed the engine, when known."""
    oom_killed: bool | None
    """From the cgroup OOM kill counter; None when no memory cgroup accounted the engine."""
    oom_kill_count: int | None
    """The counter itself."""
    message: str
    """Human-readable detail."""
    started_at: float
    """When the supervisor started (epoch seconds)."""
    finished_at: float
    """When the engine ended (epoch seconds)."""


def atomic_write_json(path: Path, data: Mapping[str, Any], mode: int = 0o644) -> None:
    """Write JSON to a temp file, fsync it and rename it over `path`."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data: dict[str, Any] = json.loads(path.read_text())
        return data
    except (OSError, ValueError):
        return None


def process_start_ticks(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot; None if it is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = stat[stat.rindex(")") + 2 :].split()
    return None if rest[0] in ("Z", "X") else int(rest[19])


def _children(pid: int) -> list[int]:
    """Child pids of `pid` (from /proc/PID/task/PID/children, else by scanning /proc)."""
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        pass
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text() if entry.name.isdigit() else ""
        except OSError:
            continue
        if stat and int(stat[stat.rindex(")") + 2 :].split()[1]) == pid:
            found.append(int(entry.name))
    return sorted(found)


class LineSplitter:
    """Cuts a byte stream into whole lines (each ending with a newline)."""

    def __init__(self, max_line_bytes: int) -> None:
        self.max_line_bytes = max_line_bytes
        self.partial = b""

    def feed(self, chunk: bytes) -> bytes:
        """Return the complete lines now available; keep the unfinished tail."""
        data = self.partial + chunk
        cut = data.rfind(b"\n") + 1
        self.partial = data[cut:]
        out = data[:cut]
        while len(self.partial) > self.max_line_bytes:
            out += self.partial[: self.max_line_bytes] + b"\n"
            self.partial = self.partial[self.max_line_bytes :]
        return out

    def flush(self) -> bytes:
        """At end of stream: the unfinished last line, newline-terminated."""
        out, self.partial = (self.partial + b"\n" if self.partial else b""), b""
        return out


class RotatingLineLog:
    """Append-only log that rotates by size between lines, never inside one."""

    def __init__(self, path: Path, max_bytes: int, backup_count: int) -> None:
        self.path, self.max_bytes, self.backup_count = path, max_bytes, backup_count
        self._open()

    def _open(self) -> None:
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o640)
        self.size = os.fstat(self.fd).st_size

    def _copy(self, i: int) -> Path:
        return self.path.with_name(f"{self.path.name}.{i}")

    def _rotate(self) -> None:
        os.close(self.fd)
        if self.backup_count > 0:
            rotated = 0  # existing copies .1 .. .n (contiguous), shifted up by one, the oldest dropped
            while rotated < self.backup_count and self._copy(rotated + 1).exists():
                rotated += 1
            for i in range(min(rotated, self.backup_count - 1), 0, -1):
                os.replace(self._copy(i), self._copy(i + 1))
            os.replace(self.path, self._copy(1))
        else:
            self.path.unlink(missing_ok=True)
        self._open()

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view) :]
        self.size += len(data)

    def write_lines(self, data: bytes) -> None:
        """Write whole lines (`data` ends with a newline), rotating between lines as needed."""
        while data:
            room = self.max_bytes - self.size
            cut = len(data) if len(data) <= room else data.rfind(b"\n", 0, max(room, 0)) + 1
            if cut == 0:
                if self.size > 0:
                    self._rotate()
                    continue
                cut = data.index(b"\n") + 1  # a single line longer than max_bytes: kept whole
            self._write(data[:cut])
            data = data[cut:]

    def close(self) -> None:
        """Close the file."""
        os.close(self.fd)


class _Supervisor:
    """The supervisor process's main object (single-threaded: the engine is forked with preexec_fn)."""

    def __init__(self, spec: SupervisorSpec) -> None:
        self.spec = spec
        self.dir = spec.instance_dir
        self.started_at = time.time()
        self.state: dict[str, Any] = {
            "instance_id": spec.instance_id,
            "supervisor_pid": os.getpid(),
            "supervisor_start": process_start_ticks(os.getpid()),
            "engine_pid": None,
            "engine_start": None,
            "started_at": self.started_at,
        }
        self.cgroup: InstanceCgroup | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.namespaced = False
        self.init_pid: int | None = None
        self.events: dict[str, dict[str, Any]] = {}
        self.stop_requested = False
        self.stopping_since: float | None = None
        self.killed = False
        self.grace_s = spec.stop_grace_s

    def write_state(self, status: str, **extra: Any) -> None:
        self.state.update(extra, status=status, updated_at=time.time())
        atomic_write_json(self.dir / STATE_FILE, self.state)

    def start(self) -> int | None:
        """Create the cgroup and start the engine; return the read end of the status pipe, if any."""
        spec = self.spec
        workdir = spec.effective_workdir()
        workdir.mkdir(parents=True, exist_ok=True)
        if spec.limits is not None:
            self.cgroup = InstanceCgroup(detect_layout(), spec.instance_id, spec.cgroup_parent)
            self.cgroup.create(spec.limits)
        status_r, status_w = os.pipe() if spec.sandbox.uses_namespaces() else (None, None)
        request = SandboxRequest(
            spec.argv, workdir, spec.plugin_env, spec.spec_env, spec.device_nodes, spec.user
        )
        cmd = build_sandboxed_command(request, spec.sandbox, status_w)
        if cmd.user is not None:
            os.chown(workdir, cmd.user.uid, cmd.user.gid)
        procs_files = self.cgroup.procs_files() if self.cgroup else ()
        switch_user = None if cmd.namespaced else cmd.user

        def preexec() -> None:  # in the child, before exec
            for procs in procs_files:
                with open(procs, "w") as f:
                    f.write(str(os.getpid()))
            _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if switch_user is not None:
                os.setgroups(list(switch_user.groups))
                os.setgid(switch_user.gid)
                os.setuid(switch_user.uid)

        try:
            self.proc = subprocess.Popen(
                cmd.argv,
                env=dict(cmd.env),
                cwd=cmd.cwd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(status_w,) if status_w is not None else (),
                preexec_fn=preexec,
                start_new_session=not cmd.namespaced,
            )
        finally:
            if status_w is not None:
                os.close(status_w)
        self.namespaced = cmd.namespaced
        log.info("supervisor.engine_started", pid=self.proc.pid, argv=list(cmd.argv[-len(spec.argv) :]))
        if not self.namespaced:
            self._set_engine(self.proc.pid)
        return status_r

    def _set_engine(self, pid: int) -> None:
        self.write_state("running", engine_pid=pid, engine_start=process_start_ticks(pid))

    def _on_status(self, line: bytes) -> None:
        event = json.loads(line)
        self.events[event["event"]] = event
        if event["event"] == "started" and self.proc is not None:
            inits = _children(self.proc.pid)
            self.init_pid = inits[0] if inits else None
            engines = _children(self.init_pid) if self.init_pid else []
            self._set_engine(engines[0] if engines else self.proc.pid)

    def _signal_engine(self, sig: int) -> None:
        assert self.proc is not None
        try:
            if not self.namespaced:
                os.killpg(self.proc.pid, sig)
            elif self.init_pid is not None and sig != signal.SIGKILL:
                os.kill(self.init_pid, sig)  # the init forwards it to the engine
            else:
                for pid in (self.init_pid, self.proc.pid):  # the init's death ends the namespace
                    if pid is not None:
                        os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _check_stop(self) -> None:
        now = time.monotonic()
        if self.stop_requested and self.stopping_since is None:
            request = _read_json(self.dir / STOP_FILE) or {}
            self.grace_s = float(request.get("grace_s", self.grace_s))
            self.stopping_since = now
            self.write_state("stopping")
            log.info("supervisor.stopping", grace_s=self.grace_s)
            self._signal_engine(signal.SIGTERM)
        elif self.stopping_since is not None and not self.killed and now - self.stopping_since > self.grace_s:
            log.warning("supervisor.grace_expired", grace_s=self.grace_s)
            self.killed = True
            self._signal_engine(signal.SIGKILL)
            if self.cgroup is not None:
                self.cgroup.kill_all(timeout_s=1.0)

    def pump(self, status_fd: int | None, wakeup_fd: int) -> None:
        """Copy engine output to the log until the engine has exited and its pipes are drained."""
        assert self.proc is not None and self.proc.stdout is not None and self.proc.stderr is not None
        logs = self.spec.logs
        out = RotatingLineLog(self.dir / logs.file_name, logs.max_bytes, logs.backup_count)
        pipes = {f.fileno(): f for f in (self.proc.stdout, self.proc.stderr)}
        splitters = {fd: LineSplitter(logs.max_line_bytes) for fd in pipes}
        status = LineSplitter(1 << 20)
        sel = selectors.DefaultSelector()
        for fd in (*splitters, wakeup_fd, *([status_fd] if status_fd is not None else [])):
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        open_streams, status_open = len(pipes), status_fd is not None
        exited_at: float | None = None
        while True:
            self._check_stop()
            if self.proc.poll() is not None:
                exited_at = exited_at or time.monotonic()
                drained = open_streams == 0 and not status_open
                if drained or time.monotonic() - exited_at > 2.0:
                    break
            for key, _ in sel.select(0.2):
                fd = int(key.fd)
                try:
                    chunk = os.read(fd, 1 << 16)
                except BlockingIOError:
                    continue
                if fd == wakeup_fd:
                    continue
                if fd == status_fd:
                    for line in status.feed(chunk).splitlines():
                        self._on_status(line)
                elif chunk:
                    out.write_lines(splitters[fd].feed(chunk))
                if chunk:
                    continue
                sel.unregister(fd)
                if fd == status_fd:
                    os.close(fd)
                    status_open = False
                else:
                    pipes[fd].close()
                    out.write_lines(splitters[fd].flush())
                    open_streams -= 1
        for splitter in splitters.values():  # streams still held open by an escaped grandchild
            out.write_lines(splitter.flush())
        for pipe in pipes.values():
            pipe.close()
        if status_open and status_fd is not None:
            os.close(status_fd)
        out.close()
        sel.close()

    def finish(self, message: str = "") -> ExitRecord:
        """Record how the engine ended, then clean the cgroup."""
        code = self.proc.wait() if self.proc is not None else None
        exited = self.events.get("exited")
        oom_count = self.cgroup.oom_kill_count() if self.cgroup is not None else None
        exit_code: int | None
        sig: int | None
        if not self.namespaced and code is not None:
            exit_code, sig = (code, None) if code >= 0 else (None, -code)
        elif exited is not None:
            exit_code, sig = exited.get("exit_code"), exited.get("signal")
        elif "started" not in self.events:
            exit_code, sig = code, None
            message = (
                message or f"the sandbox did not start the engine (unshare exited {code}); see engine log"
            )
        else:  # the sandbox init itself died (our SIGKILL, a v2 OOM group kill): unshare says nothing
            exit_code, sig = None, (signal.SIGKILL if self.killed or oom_count else None)
            message = message or "the sandbox init was killed with the engine"
        if "error" in self.events:
            message = self.events["error"].get("message", message)
        if self.proc is None or "error" in self.events or ("started" not in self.events and self.namespaced):
            cause = "failed"
        elif oom_count:
            cause = "oom_killed"
        elif self.stopping_since is not None:
            cause = "stopped"
        elif sig is not None:
            cause = "signaled"
        else:
            cause = "exited"
        record = ExitRecord(
            cause,
            exit_code,
            sig,
            None if oom_count is None else oom_count > 0,
            oom_count,
            message,
            self.started_at,
            time.time(),
        )
        atomic_write_json(self.dir / EXIT_FILE, asdict(record))
        log.info("supervisor.engine_exited", **asdict(record))
        if self.cgroup is not None:
            try:
                self.cgroup.remove()
            except KunlunError as exc:
                log.error("supervisor.cgroup_cleanup_failed", error=str(exc))
        self.write_state("failed" if cause == "failed" else "exited")
        return record


def run_supervisor(spec: SupervisorSpec) -> int:
    """Supervise one engine until it exits; the body of the supervisor process."""
    sup = _Supervisor(spec)
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)

    def on_stop(_sig: int, _frame: object) -> None:
        sup.stop_requested = True

    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGINT, on_stop)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGCHLD, lambda _s, _f: None)  # wakes the select loop through the wakeup fd
    sup.write_state("starting")
    try:
        status_fd = sup.start()
    except (KunlunError, OSError, subprocess.SubprocessError) as exc:
        log.error("supervisor.start_failed", error=str(exc))
        sup.finish(f"engine could not start: {exc}")
        return 1
    sup.pump(status_fd, wake_r)
    sup.finish()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Command line entry point."""
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True, type=Path, help="supervisor spec JSON file")
    parser.add_argument("--daemonize", action="store_true", help="fork and let the parent exit at once")
    args = parser.parse_args(argv)
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.JSONRenderer(),
        ],
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )
    spec = SupervisorSpec.from_json(json.loads(args.spec.read_text()))
    if args.daemonize and os.fork() > 0:
        os._exit(0)
    return run_supervisor(spec)


# --- Agent side -------------------------------------------------------------------------------


def _wait_until(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval_s)
    return True


def read_state(instance_dir: Path) -> dict[str, Any] | None:
    """The supervisor's `state.json`, or None."""
    return _read_json(instance_dir / STATE_FILE)


def read_exit(instance_dir: Path) -> ExitRecord | None:
    """The engine's `exit.json`, or None while it runs (or if it was never recorded)."""
    data = _read_json(instance_dir / EXIT_FILE)
    return ExitRecord(**data) if data is not None else None


def _is_our_supervisor(pid: int, start: int, spec_path: Path) -> bool:
    if process_start_ticks(pid) != start:
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return MODULE.encode() in cmdline and str(spec_path).encode() in cmdline


def adopt(instance_dir: Path) -> SupervisorHandle | None:
    """Find the live supervisor of `instance_dir` (e.g. after an agent restart), verified via /proc."""
    instance_dir = instance_dir.resolve()
    state = read_state(instance_dir)
    if state is None or state.get("status") in ("exited", "failed"):
        return None
    pid, start = int(state["supervisor_pid"]), state.get("supervisor_start")
    if start is None or not _is_our_supervisor(pid, int(start), instance_dir / SPEC_FILE):
        return None
    return SupervisorHandle(
        str(state["instance_id"]), instance_dir, pid, int(start), state.get("engine_pid"), state["started_at"]
    )


def launch(spec: SupervisorSpec, timeout_s: float = 30.0) -> SupervisorHandle:
    """Start a detached supervisor for `spec` and wait until its engine runs (or has ended)."""
    spec = SupervisorSpec.from_json({**spec.to_json(), "instance_dir": str(spec.instance_dir.resolve())})
    d = spec.instance_dir
    d.mkdir(parents=True, exist_ok=True)
    if adopt(d) is not None:
        raise PermanentError(f"instance {spec.instance_id} already has a live supervisor in {d}")
    for name in (STATE_FILE, EXIT_FILE, STOP_FILE):
        (d / name).unlink(missing_ok=True)
    atomic_write_json(d / SPEC_FILE, spec.to_json(), mode=0o600)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_PACKAGE_ROOT), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", MODULE, "--spec", str(d / SPEC_FILE), "--daemonize"]
    with open(d / SUPERVISOR_LOG, "ab") as logf:
        intermediate = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, cwd=d, env=env, start_new_session=True
        )
    if intermediate.wait(timeout=timeout_s) != 0:
        raise PermanentError(f"supervisor for {spec.instance_id} failed to start; see {d / SUPERVISOR_LOG}")

    def settled() -> bool:
        state = read_state(d) or {}
        if state.get("status") in ("exited", "failed", "stopping") or state.get("engine_pid") is not None:
            return True
        pid, start = state.get("supervisor_pid"), state.get("supervisor_start")
        return pid is not None and process_start_ticks(int(pid)) != start  # died while starting

    if not _wait_until(settled, timeout_s):
        raise TemporaryError(f"supervisor for {spec.instance_id} did not report a running engine in time")
    state = read_state(d) or {}
    if state.get("status") == "starting":
        raise PermanentError(
            f"supervisor for {spec.instance_id} died while starting; see {d / SUPERVISOR_LOG}"
        )
    if state.get("status") == "failed":
        record = read_exit(d)
        raise PermanentError(
            f"engine {spec.instance_id} failed to start: {record.message if record else '?'}"
        )
    return SupervisorHandle(
        spec.instance_id,
        d,
        int(state["supervisor_pid"]),
        int(state["supervisor_start"]),
        state.get("engine_pid"),
        float(state["started_at"]),
    )


def _alive(handle: SupervisorHandle) -> bool:
    return process_start_ticks(handle.supervisor_pid) == handle.supervisor_start


def stop(
    handle: SupervisorHandle, grace_s: float = 30.0, timeout_s: float | None = None
) -> ExitRecord | None:
    """Stop the engine (SIGTERM, SIGKILL after `grace_s`) and its supervisor; return the exit record."""
    d = handle.instance_dir
    if _alive(handle):
        atomic_write_json(d / STOP_FILE, {"grace_s": grace_s})
        os.kill(handle.supervisor_pid, signal.SIGTERM)
        if not _wait_until(lambda: not _alive(handle), timeout_s if timeout_s is not None else grace_s + 15):
            log.error("supervisor.unresponsive", instance=handle.instance_id, pid=handle.supervisor_pid)
            os.kill(handle.supervisor_pid, signal.SIGKILL)  # PR_SET_PDEATHSIG takes the engine down
    if read_exit(d) is None:
        _clean_up_after_lost_supervisor(handle)
    return read_exit(d)


def _clean_up_after_lost_supervisor(handle: SupervisorHandle) -> None:
    """The supervisor died without recording an exit: kill leftovers, remove the cgroup, record it."""
    raw = _read_json(handle.instance_dir / SPEC_FILE)
    spec = SupervisorSpec.from_json(raw) if raw else None
    if spec is not None and spec.limits is not None:
        InstanceCgroup(detect_layout(), spec.instance_id, spec.cgroup_parent).remove()
    state = read_state(handle.instance_dir) or {}
    engine, engine_start = state.get("engine_pid"), state.get("engine_start")
    if engine and engine_start and process_start_ticks(int(engine)) == engine_start:
        os.kill(int(engine), signal.SIGKILL)
    now = time.time()
    record = ExitRecord("stopped", None, None, None, None, "supervisor lost; engine killed", now, now)
    atomic_write_json(handle.instance_dir / EXIT_FILE, asdict(record))
    atomic_write_json(handle.instance_dir / STATE_FILE, {**state, "status": "exited", "updated_at": now})


if __name__ == "__main__":
    sys.exit(main())
