"""The launcher behind `make demo` / `make down`: up prints all devices Ready and its processes log
readable lines, a second up over the kept state (a second `make demo`) starts on the same ports and
prints every device Ready again, down leaves nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from devcluster.procs import pid_alive


def test_up_twice_then_down_leaves_no_process(tmp_path: Path) -> None:
    base = tmp_path / "kc"
    env = {**os.environ, "KUNLUN_CONFIG": str(tmp_path / "client.yaml")}

    def up() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "devcluster", "up", "--dir", str(base), "--free-ports"],
            capture_output=True,
            text=True,
            timeout=180,
            env=env,
        )

    first = up()
    pids: dict[str, int] = {}
    try:
        assert first.returncode == 0, first.stdout + first.stderr
        first_pids = json.loads((base / "cluster.json").read_text())["pids"]
        first_ports = json.loads((base / "cluster.json").read_text())["etcd_ports"]
        # a second `make demo` over the kept state: the earlier processes stopped, the same etcd
        # members started again on their recorded ports, every device printed Ready (not the
        # Unavailable of the earlier run's records)
        out = up()
        assert out.returncode == 0, out.stdout + out.stderr
        assert "stopped the previous local cluster (11 processes)" in out.stdout, out.stdout
        assert not any(pid_alive(p) for p in first_pids.values())
        assert json.loads((base / "cluster.json").read_text())["etcd_ports"] == first_ports
        assert "[5/5] client config written" in out.stdout
        # make demo prints every process's metrics address (replicas, agents, gateways)
        assert out.stdout.count("/metrics") == 8 and "monitoring/prometheus.crt" in out.stdout, out.stdout
        for run in (first, out):
            rows = [line for line in run.stdout.splitlines() if line.startswith("node-")]
            assert len(rows) == 7 and all(" Ready " in r for r in rows), run.stdout
        pids = json.loads((base / "cluster.json").read_text())["pids"]
        assert len(pids) == 11 and all(
            pid_alive(p) for p in pids.values()
        )  # 3 etcd, 3 replicas, 2 agents, 3 gateways
        listed = subprocess.run(
            [sys.executable, "-m", "controlplane.cli.main", "device", "list", "-o", "json"],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
        assert len(json.loads(listed.stdout)["items"]) == 7
        # the demo logs readable lines (production and the test clusters log JSON)
        for log in (base / "replicas" / "replica-1.log", base / "agents" / "node-a" / "agent.log"):
            lines = [ln for ln in log.read_text().splitlines() if ln.strip()]
            assert lines and not any(ln.lstrip().startswith("{") for ln in lines), lines[:3]
        serving = [
            ln
            for ln in (base / "replicas" / "replica-1.log").read_text().splitlines()
            if "replica serving" in ln
        ]
        assert serving and "[info" in serving[0], serving
    finally:
        down = subprocess.run(
            [sys.executable, "-m", "devcluster", "down", "--dir", str(base)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert down.returncode == 0 and "stopped" in down.stdout
    assert not any(pid_alive(p) for p in pids.values())
    leftovers = subprocess.run(["pgrep", "-f", str(base)], capture_output=True, text=True).stdout.split()
    assert leftovers == []
