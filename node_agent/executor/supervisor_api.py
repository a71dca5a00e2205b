"""The agent's side of the per-instance supervisor: its spec and files, and launch/adopt/stop.

The supervisor process itself is `node_agent.executor.supervisor` (see its docstring). Files in the
instance dir: `spec.json` (what to run), `state.json` (supervisor and engine pids with their start
times, status starting/running/stopping/exited/failed), `exit.json` (how the engine ended),
`stop.json` (a stop request's grace), `supervisor.log`, and the engine logs (`logfiles.py`).

`launch` and `stop` block (they poll files with a deadline); call them from a worker thread in async
code. `adopt` finds a live supervisor again after an agent restart, verified through /proc (pid,
start time and command line), so a reused pid is never mistaken for it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import structlog

from kunlun_common.errors import ConfigError, PermanentError, TemporaryError
from kunlun_common.states import SUPERVISOR_DONE, ExitCause, SupervisorStatus
from node_agent.executor.cgroups import CgroupLimits, InstanceCgroup, detect_layout
from node_agent.executor.logfiles import LogSettings
from node_agent.executor.sandbox import SandboxSettings

log = structlog.get_logger(__name__)

MODULE = "node_agent.executor.supervisor"
SPEC_FILE, STATE_FILE, EXIT_FILE, STOP_FILE = "spec.json", "state.json", "exit.json", "stop.json"
SUPERVISOR_LOG = "supervisor.log"
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]


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
    writable_paths: tuple[str, ...] = ()
    """Folders besides the working folder the engine may write (its cache); given to the engine user."""
    readable_paths: tuple[str, ...] = ()
    """Folders the engine must see even under a hidden folder (its model package)."""
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
    node: str = ""
    """Node name (for the engine ledger)."""
    devices: tuple[str, ...] = ()
    """`<node>/<type>:<index>` of the devices the engine holds: locked for its whole life."""
    agent_state_dir: str = ""
    """The agent's state dir: fence lease (`fence.json`), device locks and engine ledger live there;
    empty: none of them (a supervisor started outside an agent, as in unit tests)."""
    fence_deadline_s: float = 0.0
    """Self-fencing: stop the engine once the agent's fence lease has expired (0: off). Used as
    the deadline from the supervisor's own start while no lease file exists yet."""
    device_wait_s: float = 10.0
    """How long to wait for the device locks before giving up (the agent waits before launching)."""

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
    if state is None or state.get("status") in SUPERVISOR_DONE:
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
        if (
            state.get("status") in (*SUPERVISOR_DONE, SupervisorStatus.STOPPING)
            or state.get("engine_pid") is not None
        ):
            return True
        pid, start = state.get("supervisor_pid"), state.get("supervisor_start")
        return pid is not None and process_start_ticks(int(pid)) != start  # died while starting

    if not _wait_until(settled, timeout_s):
        raise TemporaryError(f"supervisor for {spec.instance_id} did not report a running engine in time")
    state = read_state(d) or {}
    if state.get("status") == SupervisorStatus.STARTING:
        raise PermanentError(
            f"supervisor for {spec.instance_id} died while starting; see {d / SUPERVISOR_LOG}"
        )
    if state.get("status") == SupervisorStatus.FAILED:
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


def alive(handle: SupervisorHandle) -> bool:
    """Whether the supervisor of `handle` still runs (same pid and start time)."""
    return process_start_ticks(handle.supervisor_pid) == handle.supervisor_start


STOP_REASON_MAX = 300
"""Longest stop reason passed to a supervisor (a ledger line stays short)."""


def stop(
    handle: SupervisorHandle, grace_s: float = 30.0, timeout_s: float | None = None, reason: str = ""
) -> ExitRecord | None:
    """Stop the engine (SIGTERM, SIGKILL after `grace_s`) and its supervisor; return the exit record.
    `reason` (why it is stopped: unassigned, no replica reachable, ...) goes into the exit record and
    the engine ledger's stop cause."""
    d = handle.instance_dir
    if alive(handle):
        atomic_write_json(d / STOP_FILE, {"grace_s": grace_s, "reason": reason[:STOP_REASON_MAX]})
        os.kill(handle.supervisor_pid, signal.SIGTERM)
        if not _wait_until(lambda: not alive(handle), timeout_s if timeout_s is not None else grace_s + 15):
            log.error("supervisor.unresponsive", instance=handle.instance_id, pid=handle.supervisor_pid)
            os.kill(handle.supervisor_pid, signal.SIGKILL)  # PR_SET_PDEATHSIG takes the engine down
    if read_exit(d) is None:
        _clean_up_after_lost_supervisor(handle)
    return read_exit(d)


def reap(instance_dir: Path) -> bool:
    """Clean up after a supervisor that died without recording an exit (killed with SIGKILL): kill
    what is left of its engine, remove its cgroup and record the exit. True when there was one."""
    instance_dir = instance_dir.resolve()
    state = read_state(instance_dir)
    if state is None or read_exit(instance_dir) is not None or state.get("status") in SUPERVISOR_DONE:
        return False
    try:
        handle = SupervisorHandle(
            str(state["instance_id"]),
            instance_dir,
            int(state["supervisor_pid"]),
            int(state.get("supervisor_start") or 0),
            state.get("engine_pid"),
            float(state["started_at"]),
        )
    except (KeyError, TypeError, ValueError):
        return False
    if alive(handle):
        return False
    _clean_up_after_lost_supervisor(handle)
    return True


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
        _wait_until(lambda: process_start_ticks(int(engine)) != engine_start, 5.0)
    pid = state.get("ledger_pid") or engine
    if spec is not None and spec.agent_state_dir and pid:
        from node_agent.executor import ledger

        entry = ledger.event(
            "stop", spec.node, spec.instance_id, spec.devices, int(pid), "supervisor lost; engine killed"
        )
        try:
            ledger.append(ledger.ledger_path(Path(spec.agent_state_dir)), entry)
        except (OSError, ValueError) as exc:
            log.error("ledger write failed", error=str(exc))
    now = time.time()
    record = ExitRecord(ExitCause.STOPPED, None, None, None, None, "supervisor lost; engine killed", now, now)
    atomic_write_json(handle.instance_dir / EXIT_FILE, asdict(record))
    atomic_write_json(
        handle.instance_dir / STATE_FILE, {**state, "status": SupervisorStatus.EXITED, "updated_at": now}
    )
