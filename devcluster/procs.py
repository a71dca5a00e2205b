"""Background processes with log files and pid files, plus the signals tests and chaos use."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie is not alive
    with contextlib.suppress(OSError):
        if Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z"):
            return False
    return True


@dataclass
class ManagedProcess:
    """One background process started by the launcher."""

    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    popen: subprocess.Popen[bytes] | None = None
    pid: int = 0

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        logf = open(self.log_path, "ab")
        env = {**os.environ, **self.env}
        self.popen = subprocess.Popen(
            self.argv,
            stdout=logf,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        logf.close()
        self.pid = self.popen.pid

    def alive(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is None
        return self.pid > 0 and pid_alive(self.pid)

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)

    def kill(self) -> None:
        """kill -9, and reap it."""
        self.signal(signal.SIGKILL)
        self.wait(10)

    def pause(self) -> None:
        self.signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.signal(signal.SIGCONT)

    def wait(self, timeout: float) -> int | None:
        if self.popen is not None:
            try:
                return self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                return None
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if not pid_alive(self.pid):
                return 0
            time.sleep(0.05)
        return None

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (after SIGCONT, in case it is paused), then SIGKILL after timeout."""
        if not self.alive():
            self.wait(0.1)
            return
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        if self.wait(timeout) is None:
            self.kill()

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""


def wait_for(predicate: object, timeout: float, what: str, interval: float = 0.1) -> None:
    """Poll a condition (a callable returning truthy) until it holds, or raise TimeoutError."""
    assert callable(predicate)
    end = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < end:
        try:
            if predicate():
                return
        except Exception as e:
            last_exc = e
        time.sleep(interval)
    raise TimeoutError(
        f"timed out after {timeout:.0f}s waiting for {what}"
        + (f" (last error: {last_exc})" if last_exc else "")
    )


def stop_all(procs: Sequence[ManagedProcess], timeout: float = 10.0) -> None:
    for p in procs:
        if p.alive():
            p.signal(signal.SIGCONT)
            p.signal(signal.SIGTERM)
    end = time.monotonic() + timeout
    for p in procs:
        left = max(0.1, end - time.monotonic())
        if p.wait(left) is None:
            p.kill()


def env_with(extra: Mapping[str, str]) -> dict[str, str]:
    return {**os.environ, **extra}
