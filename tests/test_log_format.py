"""`--log-format json|console`: one JSON object a line (production) or readable lines, same event names."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from devcluster.procs import free_port


def gateway_log(fmt: str) -> list[str]:
    port = free_port()
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gateway.main",
            "--name=g",
            f"--listen=127.0.0.1:{port}",
            "--static-endpoints=w=127.0.0.1:1",
            "--health-interval=0",
            f"--log-format={fmt}",
        ],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    assert p.stderr is not None
    lines: list[str] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = p.stderr.readline()
        if not line:
            break
        lines.append(line.rstrip("\n"))
        if "gateway serving" in line:
            break
    p.send_signal(signal.SIGTERM)
    _, rest = p.communicate(timeout=30)
    return lines + rest.splitlines()


@pytest.mark.parametrize("fmt", ["json", "console"])
def test_gateway_log_format(fmt: str) -> None:
    lines = [ln for ln in gateway_log(fmt) if ln.strip()]
    serving = [ln for ln in lines if "gateway serving" in ln]
    assert serving, lines
    if fmt == "json":
        events = [json.loads(ln) for ln in lines]  # every line is one JSON object
        rec = next(e for e in events if e["event"] == "gateway serving")
        assert rec["component"] == "kunlun-gateway" and rec["level"] == "info" and "timestamp" in rec
    else:
        assert not any(ln.startswith("{") for ln in lines)
        assert "component=kunlun-gateway" in serving[0]


def test_bad_log_format_is_refused() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "gateway.main", "--static-endpoints=w=127.0.0.1:1", "--log-format=xml"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "--log-format" in r.stderr
