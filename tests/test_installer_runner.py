"""`kunlun-installer run` after an upgrade: SIGHUP restarts only the services whose release or unit
changed (etcd's binary is the host's own, so an upgrade leaves the member running)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SERVICE = """#!/bin/sh
echo "release {name} pid $$"
exec sleep 300
"""


def _unit(exec_start: str) -> str:
    return f"[Unit]\nDescription=t\n\n[Service]\nExecStart={exec_start}\nRestartSec=0.2\nTimeoutStopSec=5\n"


def _starts(log: Path) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for m in re.finditer(r"(kunlun-\w+\.service) started \(pid (\d+)", log.read_text()):
        out.setdefault(m.group(1), []).append(int(m.group(2)))
    return out


def _wait(check: object, what: str, timeout: float = 30) -> None:
    assert callable(check)
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if check():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_sighup_restarts_only_the_services_whose_release_or_unit_changed(tmp_path: Path) -> None:
    prefix, units, data, etc = (tmp_path / d for d in ("opt", "units", "data", "etc"))
    for rel in ("0.5.0", "0.6.0"):
        exe = prefix / "releases" / rel / "venv" / "bin" / "kunlun-platform"
        exe.parent.mkdir(parents=True)
        exe.write_text(SERVICE.format(name=rel))
        exe.chmod(0o755)
    (prefix / "current").symlink_to("releases/0.5.0")
    units.mkdir()
    (units / "kunlun-platform.service").write_text(_unit(f"{prefix}/current/venv/bin/kunlun-platform"))
    (units / "kunlun-etcd.service").write_text(_unit("/bin/sleep 301"))
    (prefix / "state").mkdir()
    roles = {"etcd": {"user": "root"}, "control-plane": {"user": "root"}}
    (prefix / "state" / "installed.json").write_text(json.dumps({"roles": roles, "current": "0.5.0"}))
    log = tmp_path / "runner.log"
    argv = [sys.executable, "-m", "kunlun_installer", "run"]
    argv += ["--prefix", str(prefix), "--unit-dir", str(units), "--data", str(data), "--etc", str(etc)]
    with log.open("wb") as out:
        runner = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        _wait(lambda: len(_starts(log)) == 2, "both services started")
        first = _starts(log)
        # the upgrade: `current` switched; a SIGHUP with nothing changed restarts nothing
        runner.send_signal(signal.SIGHUP)
        _wait(lambda: "unchanged" in log.read_text(), "the runner to look at its services")
        assert _starts(log) == first
        tmp = prefix / ".current.tmp"
        tmp.symlink_to("releases/0.6.0")
        os.replace(tmp, prefix / "current")
        runner.send_signal(signal.SIGHUP)
        _wait(lambda: len(_starts(log).get("kunlun-platform.service", [])) == 2, "the replica restarted")
        after = _starts(log)
        assert after["kunlun-etcd.service"] == first["kunlun-etcd.service"], "etcd was left running"
        os.kill(first["kunlun-etcd.service"][0], 0)  # still alive
        service_log = data / "log" / "kunlun-platform.log"
        _wait(lambda: "release 0.6.0" in service_log.read_text(), "the new release's process to run")
        # a changed unit (a new flag in the release's template) restarts its service too
        (units / "kunlun-etcd.service").write_text(_unit("/bin/sleep 302"))
        runner.send_signal(signal.SIGHUP)
        _wait(lambda: len(_starts(log).get("kunlun-etcd.service", [])) == 2, "etcd restarted")
        assert len(_starts(log)["kunlun-platform.service"]) == 2
    finally:
        runner.send_signal(signal.SIGTERM)
        assert runner.wait(30) == 0
