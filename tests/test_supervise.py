"""devcluster/supervise.py, `make demo`'s stand-in for systemd's `Restart=always`: a command that
exits by itself is started again (a new pid), SIGTERM is passed on and ends the supervision, and a
command that keeps exiting at once hits the start limit instead of spinning. Real processes and
real signals."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from devcluster.procs import pid_alive, wait_for

CHILD = """
import os, signal, sys, time
from pathlib import Path
pids = Path(sys.argv[1])
pids.write_text(pids.read_text() + f"{os.getpid()}\\n" if pids.exists() else f"{os.getpid()}\\n")
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
if len(pids.read_text().split()) == 1:
    sys.exit(0)  # the first run exits by itself with status 0, like a drained replica
time.sleep(120)
"""


def supervise(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "devcluster.supervise", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def pids_in(path: Path) -> list[int]:
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def test_a_command_that_exits_is_started_again_and_sigterm_ends_both(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    sup = supervise("--restart-sec=0.2", "--", sys.executable, "-c", CHILD, str(pids))
    try:
        wait_for(lambda: len(pids_in(pids)) == 2, 30, "the command started a second time")
        first, second = pids_in(pids)
        assert first != second and not pid_alive(first) and pid_alive(second)
        sup.send_signal(signal.SIGTERM)
        assert sup.wait(30) == 0  # the command's own status: it handled SIGTERM and exited 0
        assert not pid_alive(second) and len(pids_in(pids)) == 2  # passed on, and not restarted
        assert sup.stderr is not None
        assert f"supervise: pid {first} exited with status 0" in sup.stderr.read().decode()
    finally:
        if sup.poll() is None:
            sup.kill()
            sup.wait(10)
        for pid in pids_in(pids):
            if pid_alive(pid):
                subprocess.run(["kill", "-9", str(pid)], check=False)


def test_a_command_that_keeps_exiting_hits_the_start_limit(tmp_path: Path) -> None:
    sup = supervise("--restart-sec=0", "--burst=3", "--interval=60", "--", sys.executable, "-c", "pass")
    try:
        assert sup.wait(60) == 1
        assert sup.stderr is not None
        assert "started 3 times within 60 s; giving up" in sup.stderr.read().decode()
    finally:
        if sup.poll() is None:
            sup.kill()
            sup.wait(10)
