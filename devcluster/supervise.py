"""`python -m devcluster.supervise [--restart-sec S] -- COMMAND...`: the local cluster's service
manager for one process, doing what systemd's `Restart=always` does for deploy/systemd's units.

It runs COMMAND and starts it again, after `--restart-sec`, whenever it exits by itself (a drained
replica exits 0: `kunlun-cli cluster replica drain`). SIGTERM and SIGINT are passed on and end the
supervision (the supervisor exits with the command's status); SIGHUP is passed on (certificate
reload). Like systemd's start limit, more than `--burst` starts within `--interval` seconds give up
(exit 1), so a command that cannot start does not spin.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from types import FrameType


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m devcluster.supervise")
    p.add_argument("--restart-sec", type=float, default=1.0, help="seconds before a restart")
    p.add_argument("--burst", type=int, default=5, help="most starts within --interval")
    p.add_argument("--interval", type=float, default=60.0, help="seconds of the start limit")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ARGS...")
    a = p.parse_args(argv)
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not command:
        p.error("give the command after --")
    stopping = threading.Event()
    child: subprocess.Popen[bytes] | None = None

    def forward(signum: int, frame: FrameType | None) -> None:
        if signum in (signal.SIGTERM, signal.SIGINT):
            stopping.set()
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    starts: deque[float] = deque()
    while True:
        now = time.monotonic()
        while starts and now - starts[0] > a.interval:
            starts.popleft()
        if len(starts) >= a.burst:
            print(
                f"supervise: {command[0]} started {len(starts)} times within {a.interval:.0f} s; giving up",
                file=sys.stderr,
                flush=True,
            )
            return 1
        starts.append(now)
        child = subprocess.Popen(command)
        rc = child.wait()
        if stopping.is_set():
            return rc if rc >= 0 else 128 - rc
        print(
            f"supervise: pid {child.pid} exited with status {rc}; starting it again in {a.restart_sec:g} s",
            file=sys.stderr,
            flush=True,
        )
        if stopping.wait(a.restart_sec):
            return 0


if __name__ == "__main__":
    sys.exit(main())
