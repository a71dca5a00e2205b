"""Node-local device locks: an engine never starts on a device an earlier engine still holds.

One lock file per device under `<agent state dir>/devices/` (`node-a_ascend_0.lock`). A supervisor
takes an exclusive flock on the files of its devices before it spawns the engine and keeps them
until the engine (and what is left in its cgroup) is gone; the kernel drops them if the supervisor
dies. The holder writes who it is into the file, so a waiting instance can say what it waits for.
The agent checks the locks before launching (`busy`) and shows the wait as the phase reason.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import time
from collections.abc import Sequence
from pathlib import Path

LOCK_DIR = "devices"
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")


def lock_path(lock_dir: Path, device: str) -> Path:
    return lock_dir / (_SAFE.sub("_", device) + ".lock")


def _try(path: Path) -> int | None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def holder(lock_dir: Path, device: str) -> str:
    """Who holds a device's lock, as its holder wrote it ("" if unknown)."""
    try:
        data = json.loads(lock_path(lock_dir, device).read_text() or "{}")
        return f"instance {data.get('instance', '?')} (supervisor pid {data.get('pid', '?')})"
    except (OSError, ValueError, AttributeError):
        return ""


def busy(lock_dir: Path, devices: Sequence[str]) -> str | None:
    """The first device whose lock an engine holds now (probed, not kept), or None. Blocking."""
    for d in devices:
        fd = _try(lock_path(lock_dir, d))
        if fd is None:
            return d
        os.close(fd)
    return None


def acquire(lock_dir: Path, devices: Sequence[str], instance: str, timeout_s: float) -> list[int]:
    """Lock every device (sorted, so two supervisors never deadlock) within `timeout_s`; return the
    fds to keep open for as long as the engine lives. Raises TimeoutError naming the holder."""
    fds: list[int] = []
    deadline = time.monotonic() + timeout_s
    try:
        for d in sorted(devices):
            path = lock_path(lock_dir, d)
            while (fd := _try(path)) is None:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"device {d} is still held by {holder(lock_dir, d) or 'another engine'}"
                    )
                time.sleep(0.05)
            fds.append(fd)
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps({"instance": instance, "pid": os.getpid()}).encode(), 0)
    except BaseException:
        release(fds)
        raise
    return fds


def release(fds: Sequence[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
