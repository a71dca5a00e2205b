"""Per-instance cgroups for engine processes, on cgroup v1, v2 or a hybrid of both.

Each controller the executor uses (memory, pids, cpu) is detected separately from
`/proc/self/mountinfo`: a controller is driven through the unified (v2) tree when that tree
lists it in its `cgroup.controllers`, and through its own v1 hierarchy otherwise. Hybrid hosts
(v1 memory/pids/cpu mounted under `/sys/fs/cgroup/<controller>` plus a v2 tree holding only
some controllers) are therefore handled controller by controller, and so are pure v1 and pure
v2 hosts.

An instance gets `<mount>/<parent>/<instance_id>` in each hierarchy it needs, with:

| limit  | v1 file                                     | v2 file       |
|--------|---------------------------------------------|---------------|
| memory | memory.limit_in_bytes (+ memsw when swap is off) | memory.max (+ memory.swap.max) |
| pids   | pids.max                                    | pids.max      |
| cpu    | cpu.cfs_period_us + cpu.cfs_quota_us        | cpu.max       |

The OOM kill counter is read from the cgroup's own files (v1: `oom_kill` line of
`memory.oom_control`, v2: `oom_kill` line of `memory.events`), never guessed from an exit code.

Testing: the v1 path is exercised against the real hierarchies of the development hosts
(which are hybrid); the v2 path is exercised against a cgroupfs-shaped directory tree built in
a temporary directory (a fake mountinfo pointing at it), since those hosts have no v2 memory
controller. Writing a limit file in such a tree creates it, which is what the tests inspect.
"""

from __future__ import annotations

import errno
import os
import re
import signal
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import structlog

from kunlun_common.errors import ConfigError, PermanentError

log = structlog.get_logger(__name__)

CONTROLLERS = ("memory", "pids", "cpu")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


@dataclass(frozen=True)
class ControllerMount:
    """Where one controller is driven from."""

    controller: str
    """Controller name: "memory", "pids" or "cpu"."""
    version: int
    """1 for a v1 hierarchy, 2 for the unified tree."""
    mount_point: Path
    """Mount point of the hierarchy (the unified tree for v2)."""


@dataclass(frozen=True)
class CgroupLayout:
    """The controllers found on this host; None where a controller is not available."""

    memory: ControllerMount | None
    """The memory controller."""
    pids: ControllerMount | None
    """The pids controller."""
    cpu: ControllerMount | None
    """The cpu controller (CFS bandwidth)."""
    unified: Path | None = None
    """Mount point of the cgroup v2 tree, if one is mounted."""
    cpuacct: ControllerMount | None = None
    """The v1 CPU accounting hierarchy (`cpuacct.usage`), used when no instance directory is in the
    v2 tree (whose `cpu.stat` accounts CPU in every cgroup); often co-mounted with `cpu`."""

    def get(self, controller: str) -> ControllerMount | None:
        """Return the mount for `controller` ("memory", "pids" or "cpu")."""
        mount: ControllerMount | None = getattr(self, controller)
        return mount

    def available(self) -> tuple[str, ...]:
        """Names of the controllers that were found."""
        return tuple(c for c in CONTROLLERS if self.get(c) is not None)


@dataclass(frozen=True)
class CgroupLimits:
    """Resource limits of one instance; None leaves that resource unlimited (but still accounted)."""

    memory_bytes: int | None = None
    """Hard memory limit in bytes; exceeding it invokes the cgroup's OOM killer."""
    pids_max: int | None = None
    """Maximum number of tasks (processes and threads) in the cgroup."""
    cpu_cores: float | None = None
    """CPU bandwidth in cores (2.5 = 250 ms of CPU time per 100 ms period)."""
    cpu_period_us: int = 100_000
    """CFS period in microseconds used to express `cpu_cores`."""
    allow_swap: bool = False
    """When False the memory limit also caps swap, so an over-limit engine is OOM-killed, not swapped."""


def _unescape(field: str) -> str:
    """Undo the octal escapes (\\040 for space...) mountinfo uses in paths."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def detect_layout(mountinfo: Path = Path("/proc/self/mountinfo")) -> CgroupLayout:
    """Find which hierarchy drives each controller, from a mountinfo file (injectable for tests)."""
    v1: dict[str, Path] = {}
    unified: Path | None = None
    try:
        lines = mountinfo.read_text().splitlines()
    except OSError as exc:
        log.warning("cgroup.mountinfo_unreadable", path=str(mountinfo), error=str(exc))
        lines = []
    for line in lines:
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        fstype, mount_point = tail[0], Path(_unescape(fields[4]))
        if fstype == "cgroup2" and unified is None:
            unified = mount_point
        elif fstype == "cgroup":
            for opt in tail[2].split(","):
                if opt in (*CONTROLLERS, "cpuacct") and opt not in v1:
                    v1[opt] = mount_point
    v2_controllers: set[str] = set()
    if unified is not None:
        try:
            v2_controllers = set((unified / "cgroup.controllers").read_text().split())
        except OSError:
            v2_controllers = set()
    mounts: dict[str, ControllerMount | None] = {}
    for ctrl in CONTROLLERS:
        if unified is not None and ctrl in v2_controllers:
            mounts[ctrl] = ControllerMount(ctrl, 2, unified)
        elif ctrl in v1:
            mounts[ctrl] = ControllerMount(ctrl, 1, v1[ctrl])
        else:
            mounts[ctrl] = None
    cpuacct = ControllerMount("cpuacct", 1, v1["cpuacct"]) if "cpuacct" in v1 else None
    return CgroupLayout(mounts["memory"], mounts["pids"], mounts["cpu"], unified, cpuacct)


def _check_name(value: str, what: str, allow_slash: bool = False) -> None:
    parts = value.split("/") if allow_slash else [value]
    if not value or not all(_NAME_RE.match(p) for p in parts):
        raise ConfigError(
            f"invalid cgroup {what} {value!r}: use letters, digits, '_', '.', '-'"
            + (" and '/' between parts" if allow_slash else "")
        )


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _read_counter(path: Path, key: str) -> int | None:
    """Read `key N` from a flat-keyed cgroup file; None when the file or key is missing."""
    try:
        text = path.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == key:
            return int(parts[1])
    return None


def _read_int(path: Path) -> int | None:
    """A cgroup file holding one integer; None when it is missing or holds something else."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


class InstanceCgroup:
    """The cgroup(s) of one instance: `<mount>/<parent>/<instance_id>` in each hierarchy used."""

    def __init__(self, layout: CgroupLayout, instance_id: str, parent: str = "kunlun") -> None:
        _check_name(instance_id, "instance id")
        _check_name(parent, "parent", allow_slash=True)
        self.layout = layout
        self.instance_id = instance_id
        self.parent = parent
        self.dirs: dict[str, Path] = {}
        for ctrl in CONTROLLERS:
            mount = layout.get(ctrl)
            if mount is not None:
                self.dirs[ctrl] = mount.mount_point / parent / instance_id
        self.v2_dir: Path | None = next(
            (self.dirs[c] for c in CONTROLLERS if c in self.dirs and self._version(c) == 2), None
        )
        """The instance's directory in the v2 tree, if any controller is driven from there."""
        if self.v2_dir is None and layout.cpuacct is not None:
            self.dirs["cpuacct"] = layout.cpuacct.mount_point / parent / instance_id  # accounting only

    def unique_dirs(self) -> tuple[Path, ...]:
        """The distinct directories (one for all v2 controllers, one per v1 hierarchy)."""
        return tuple(dict.fromkeys(self.dirs.values()))

    def procs_files(self) -> tuple[Path, ...]:
        """The `cgroup.procs` files a process writes its pid to in order to join this cgroup."""
        return tuple(d / "cgroup.procs" for d in self.unique_dirs())

    def exists(self) -> bool:
        """Whether any of the instance's directories exists."""
        return any(d.is_dir() for d in self.unique_dirs())

    def _version(self, ctrl: str) -> int:
        mount = self.layout.get(ctrl)
        return mount.version if mount else 0

    def _enable_v2_controllers(self) -> None:
        """Delegate our controllers down the v2 tree (mount root -> parent), as v2 requires."""
        if self.layout.unified is None:
            return
        wanted = [c for c in CONTROLLERS if self._version(c) == 2]
        if not wanted:
            return
        level = self.layout.unified
        for part in [None, *self.parent.split("/")]:
            if part is not None:
                level = level / part
                level.mkdir(exist_ok=True)
            ctl = level / "cgroup.subtree_control"
            try:
                enabled = set(ctl.read_text().split()) if ctl.exists() else set()
            except OSError:
                enabled = set()
            missing = [c for c in wanted if c not in enabled]
            if not missing:
                continue
            try:
                _write(ctl, " ".join(f"+{c}" for c in missing))
            except OSError as exc:
                # EBUSY: the level holds processes itself (the v2 "no internal processes" rule).
                log.warning("cgroup.subtree_control_failed", path=str(ctl), error=str(exc))

    def create(self, limits: CgroupLimits) -> None:
        """Create the directories and write the limits; raise PermanentError if the kernel refuses."""
        self._enable_v2_controllers()
        try:
            for d in self.unique_dirs():
                d.mkdir(parents=True, exist_ok=True)
            self._write_limits(limits)
        except OSError as exc:
            raise PermanentError(f"cannot set up cgroup for {self.instance_id}: {exc}") from exc
        log.info("cgroup.created", instance=self.instance_id, dirs=[str(d) for d in self.unique_dirs()])

    def _write_limits(self, limits: CgroupLimits) -> None:
        mem = self.dirs.get("memory")
        if mem is not None and limits.memory_bytes is not None:
            if self._version("memory") == 2:
                _write(mem / "memory.max", str(limits.memory_bytes))
                if not limits.allow_swap and (mem / "memory.swap.max").exists():
                    _write(mem / "memory.swap.max", "0")
                if (mem / "memory.oom.group").exists():
                    _write(mem / "memory.oom.group", "1")
            else:
                _write(mem / "memory.limit_in_bytes", str(limits.memory_bytes))
                if not limits.allow_swap and (mem / "memory.memsw.limit_in_bytes").exists():
                    _write(mem / "memory.memsw.limit_in_bytes", str(limits.memory_bytes))
        pids = self.dirs.get("pids")
        if pids is not None and limits.pids_max is not None:
            _write(pids / "pids.max", str(limits.pids_max))
        cpu = self.dirs.get("cpu")
        if cpu is not None and limits.cpu_cores is not None:
            period = limits.cpu_period_us
            quota = max(1000, int(limits.cpu_cores * period))
            if self._version("cpu") == 2:
                _write(cpu / "cpu.max", f"{quota} {period}")
            else:
                _write(cpu / "cpu.cfs_period_us", str(period))
                _write(cpu / "cpu.cfs_quota_us", str(quota))

    def add_pid(self, pid: int) -> None:
        """Move process `pid` (and the children it forks afterwards) into every hierarchy."""
        for procs in self.procs_files():
            _write(procs, str(pid))

    def pids(self) -> set[int]:
        """All pids currently in any of the instance's hierarchies."""
        found: set[int] = set()
        for procs in self.procs_files():
            try:
                found.update(int(x) for x in procs.read_text().split())
            except (OSError, ValueError):
                continue
        return found

    def oom_kill_count(self) -> int | None:
        """How many processes the OOM killer killed in this cgroup; None if not accounted here."""
        mem = self.dirs.get("memory")
        if mem is None:
            return None
        if self._version("memory") == 2:
            return _read_counter(mem / "memory.events", "oom_kill")
        return _read_counter(mem / "memory.oom_control", "oom_kill")

    def memory_bytes(self) -> int | None:
        """Memory charged to the cgroup now (v2 `memory.current`, v1 `memory.usage_in_bytes`: the
        engine's resident memory plus its page cache and kernel memory); None if not accounted."""
        mem = self.dirs.get("memory")
        if mem is None:
            return None
        name = "memory.current" if self._version("memory") == 2 else "memory.usage_in_bytes"
        return _read_int(mem / name)

    def cpu_seconds(self) -> float | None:
        """CPU time used by every process that ever ran in the cgroup (v2 `cpu.stat` usage_usec,
        v1 `cpuacct.usage` in nanoseconds); None if not accounted."""
        if self.v2_dir is not None:
            usec = _read_counter(self.v2_dir / "cpu.stat", "usage_usec")
            return None if usec is None else usec / 1e6
        acct = self.dirs.get("cpuacct")
        if acct is None:
            return None
        ns = _read_int(acct / "cpuacct.usage")
        return None if ns is None else ns / 1e9

    def kill_all(self, timeout_s: float = 5.0) -> bool:
        """SIGKILL every process in the cgroup until it is empty; return whether it emptied in time."""
        for d in self.unique_dirs():
            kill_file = d / "cgroup.kill"
            if self._is_v2_dir(d) and kill_file.exists():
                try:
                    _write(kill_file, "1")
                except OSError as exc:
                    log.warning("cgroup.kill_file_failed", path=str(kill_file), error=str(exc))
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = self.pids()
            if not remaining:
                return True
            for pid in remaining:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if time.monotonic() > deadline:
                log.warning("cgroup.kill_timeout", instance=self.instance_id, pids=sorted(remaining))
                return False
            time.sleep(0.02)

    def _is_v2_dir(self, d: Path) -> bool:
        return any(self.dirs.get(c) == d and self._version(c) == 2 for c in CONTROLLERS)

    def remove(self, timeout_s: float = 5.0) -> None:
        """Kill what is left, then remove the instance directories (the parent stays)."""
        self.kill_all(timeout_s)
        deadline = time.monotonic() + timeout_s
        for d in self.unique_dirs():
            while True:
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as exc:
                    if exc.errno == errno.ENOTEMPTY:
                        # cgroupfs answers EBUSY, never ENOTEMPTY: this is a plain (test) directory.
                        _remove_plain_dir(d)
                        break
                    if time.monotonic() > deadline:
                        raise PermanentError(f"cannot remove cgroup {d}: {exc}") from exc
                    time.sleep(0.02)
        log.info("cgroup.removed", instance=self.instance_id)


def _remove_plain_dir(path: Path) -> None:
    """Remove a cgroupfs-shaped test directory: its interface files are ordinary files there."""
    for child in path.iterdir():
        if not child.is_dir():
            child.unlink()
    path.rmdir()


def remove_parent_if_empty(layout: CgroupLayout, parent: str) -> None:
    """Remove `<mount>/<parent>` in each hierarchy when no instance is left under it."""
    for mount_point in dict.fromkeys(m.mount_point for m in _mounts(layout)):
        d = mount_point / parent
        try:
            d.rmdir()
        except FileNotFoundError:
            pass
        except OSError as exc:
            if exc.errno == errno.ENOTEMPTY and not any(c.is_dir() for c in d.iterdir()):
                _remove_plain_dir(d)
            elif exc.errno not in (errno.EBUSY, errno.ENOTEMPTY):
                raise


def _mounts(layout: CgroupLayout) -> Iterable[ControllerMount]:
    found = [m for m in (layout.get(c) for c in CONTROLLERS) if m is not None]
    if layout.cpuacct is not None and not any(m.version == 2 for m in found):
        found.append(layout.cpuacct)
    return found


def layout_summary(layout: CgroupLayout) -> Mapping[str, str]:
    """A printable summary, e.g. {"memory": "v1:/sys/fs/cgroup/memory", ...}, for agent reports."""
    return {
        c: (f"v{m.version}:{m.mount_point}" if (m := layout.get(c)) is not None else "absent")
        for c in CONTROLLERS
    }
