"""Per-instance supervisor process (in the spirit of containerd's shim and conmon).

Run as `python -m node_agent.executor.supervisor --spec FILE [--daemonize]`. It detaches into its
own session, so the agent dying or its pipes closing never kills the engine. It:

* creates the instance cgroup and starts the engine in the sandbox (`sandbox.py`), joined to
  the cgroup before exec; the engine never outlives a killed supervisor (PR_SET_PDEATHSIG);
* owns the engine's stdout/stderr and writes them, whole lines only, to a size-rotated log in
  the instance dir (`engine.log`, `engine.log.1`...; `logfiles.py`): no line lost, none duplicated;
* writes `state.json` atomically (supervisor pid, engine pid, process start times, started_at,
  status starting/running/stopping/exited/failed);
* on engine exit writes `exit.json`: exit_code, signal, and oom_killed from the cgroup's own OOM
  kill counter (never guessed from exit code 137; None where no memory cgroup is used);
* on SIGTERM (or SIGINT) stops the engine (SIGTERM, then SIGKILL after the grace), then kills
  what is left in the cgroup and removes it.

The agent side (`launch`, `adopt`, `stop`, `read_exit`...) lives in `supervisor_api.py` and is
re-exported here.
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
from dataclasses import asdict
from pathlib import Path
from typing import Any

import structlog

from kunlun_common.errors import KunlunError
from kunlun_common.secrets import redact_args
from kunlun_common.states import ExitCause, SupervisorStatus
from node_agent.executor import devlock, fence, ledger
from node_agent.executor.cgroups import InstanceCgroup, detect_layout
from node_agent.executor.confine import drop_privileges
from node_agent.executor.logfiles import LineSplitter, LogSettings, RotatingLineLog
from node_agent.executor.sandbox import SandboxRequest, build_sandboxed_command
from node_agent.executor.supervisor_api import (
    EXIT_FILE,
    MODULE,
    SPEC_FILE,
    STATE_FILE,
    STOP_FILE,
    STOP_REASON_MAX,
    SUPERVISOR_LOG,
    ExitRecord,
    SupervisorHandle,
    SupervisorSpec,
    _read_json,
    adopt,
    alive,
    atomic_write_json,
    launch,
    process_start_ticks,
    read_exit,
    read_state,
    stop,
)

__all__ = [
    "EXIT_FILE",
    "MODULE",
    "SPEC_FILE",
    "STATE_FILE",
    "STOP_FILE",
    "SUPERVISOR_LOG",
    "ExitRecord",
    "LineSplitter",
    "LogSettings",
    "RotatingLineLog",
    "SupervisorHandle",
    "SupervisorSpec",
    "adopt",
    "alive",
    "atomic_write_json",
    "launch",
    "main",
    "process_start_ticks",
    "read_exit",
    "read_state",
    "run_supervisor",
    "stop",
]

log = structlog.get_logger(__name__)

_LIBC = ctypes.CDLL(None, use_errno=True)
_PR_SET_PDEATHSIG = 1


def _give(folder: Path, uid: int, gid: int) -> None:
    """Hand `folder` and what it holds to the engine user (a cache seeded by the agent is root's)."""
    if not folder.is_dir():
        return
    os.chown(folder, uid, gid)
    for root, dirs, files in os.walk(folder):
        for name in (*dirs, *files):
            path = os.path.join(root, name)
            if os.lstat(path).st_uid != uid:
                os.chown(path, uid, gid, follow_symlinks=False)


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
        self.stop_cause = ""
        self.lock_fds: list[int] = []
        self.started_mono = time.monotonic()
        self.fence_checked = 0.0
        state = Path(spec.agent_state_dir) if spec.agent_state_dir else None
        self.ledger = ledger.ledger_path(state) if state else None
        self.fence_file = state / fence.FENCE_FILE if state and spec.fence_deadline_s > 0 else None
        self.lock_dir = state / devlock.LOCK_DIR if state else None

    def fence_expired(self) -> str | None:
        """Why the engine must not run (the agent's fence lease expired), or None."""
        if self.fence_file is None:
            return None
        lease = fence.read(self.fence_file)
        now = time.monotonic()
        if lease is None:
            if now - self.started_mono < self.spec.fence_deadline_s + fence.FENCE_SLACK_S:
                return None
            return f"fenced: no fence lease from the agent for {self.spec.fence_deadline_s:g}s"
        if not lease.expired(now):
            return None
        return (
            f"fenced: the agent confirmed no control-plane contact for {now - lease.renewed_mono:.1f}s "
            f"(disconnect deadline {self.spec.fence_deadline_s:g}s)"
        )

    def lock_devices(self) -> None:
        if self.lock_dir is not None and self.spec.devices:
            self.lock_fds = devlock.acquire(
                self.lock_dir, self.spec.devices, self.spec.instance_id, self.spec.device_wait_s
            )

    def record(self, kind: str, pid: int, cause: str, mono_ns: int | None = None) -> None:
        if self.ledger is None:
            return
        entry = ledger.event(
            kind, self.spec.node, self.spec.instance_id, self.spec.devices, pid, cause, mono_ns
        )
        try:
            ledger.append(self.ledger, entry)
        except (OSError, ValueError) as exc:
            log.error("supervisor.ledger_write_failed", error=str(exc))

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
            spec.argv,
            workdir,
            spec.plugin_env,
            spec.spec_env,
            spec.device_nodes,
            spec.user,
            spec.writable_paths,
            spec.readable_paths,
        )
        cmd = build_sandboxed_command(request, spec.sandbox, status_w)
        if cmd.user is not None:
            for folder in [workdir, *map(Path, spec.writable_paths)]:
                _give(folder, cmd.user.uid, cmd.user.gid)
        procs_files = self.cgroup.procs_files() if self.cgroup else ()
        unboxed_user = None if cmd.namespaced else cmd.user
        confine_here = not cmd.namespaced  # else the sandbox init confines the engine
        seccomp = spec.sandbox.seccomp

        def preexec() -> None:  # in the child, before exec
            for procs in procs_files:
                with open(procs, "w") as f:
                    f.write(str(os.getpid()))
            _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if confine_here:
                user = asdict(unboxed_user) if unboxed_user is not None else None
                drop_privileges(user, seccomp)

        spawned_ns = time.monotonic_ns()  # stamped before the spawn: the ledger interval covers it
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
        self.state["ledger_pid"] = self.proc.pid
        self.record("start", self.proc.pid, "assigned", spawned_ns)
        log.info(
            "supervisor.engine_started",
            pid=self.proc.pid,
            argv=redact_args(list(cmd.argv[-len(spec.argv) :])),
        )
        if not self.namespaced:
            self._set_engine(self.proc.pid)
        return status_r

    def _set_engine(self, pid: int) -> None:
        self.write_state(SupervisorStatus.RUNNING, engine_pid=pid, engine_start=process_start_ticks(pid))

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

    def _check_fence(self) -> None:
        now = time.monotonic()
        if self.stop_requested or now - self.fence_checked < fence.FENCE_CHECK_S:
            return
        self.fence_checked = now
        why = self.fence_expired()
        if why:
            log.warning("supervisor.fenced", reason=why)
            self.stop_cause = why
            self.stop_requested = True

    def _check_stop(self) -> None:
        self._check_fence()
        now = time.monotonic()
        if self.stop_requested and self.stopping_since is None:
            request = _read_json(self.dir / STOP_FILE) or {}
            self.grace_s = float(request.get("grace_s", self.grace_s))
            if not self.stop_cause:  # a fence found first stays the cause
                self.stop_cause = str(request.get("reason") or "")[:STOP_REASON_MAX].removeprefix("stopped: ")
            self.stopping_since = now
            self.write_state(SupervisorStatus.STOPPING)
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
            cause = ExitCause.FAILED
        elif oom_count:
            cause = ExitCause.OOM_KILLED
        elif self.stopping_since is not None:
            cause = ExitCause.STOPPED
            # why we stopped it comes first (a fence, a stop request); how it ended, after
            message = (
                f"{self.stop_cause}; {message}" if message and self.stop_cause else message or self.stop_cause
            )
        elif sig is not None:
            cause = ExitCause.SIGNALED
        else:
            cause = ExitCause.EXITED
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
        if self.proc is not None:  # stamped after the engine and its cgroup are gone
            self.record("stop", self.proc.pid, f"{cause}: {message}" if message else str(cause))
        devlock.release(self.lock_fds)
        self.lock_fds = []
        self.write_state(SupervisorStatus.FAILED if cause == ExitCause.FAILED else SupervisorStatus.EXITED)
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
    sup.write_state(SupervisorStatus.STARTING)
    why = sup.fence_expired()
    if why:
        log.error("supervisor.fenced_before_start", reason=why)
        sup.finish(f"engine not started: {why}")
        return 1
    try:
        sup.lock_devices()
        status_fd = sup.start()
    except TimeoutError as exc:
        log.error("supervisor.devices_busy", error=str(exc))
        sup.finish(f"engine not started: {exc}")
        return 1
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


if __name__ == "__main__":
    sys.exit(main())
