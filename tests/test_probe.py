"""`kunlun-device-probe` as a real subprocess: a good node, a bad topology row, not YAML, missing tool/chip."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from node_agent.plugins.standin.state import SimChip, write_state

ROOT = Path(__file__).resolve().parents[1]
NODE_A = ROOT / "deploy" / "examples" / "node-a.yaml"


def probe(*args: str, path: str | None = None) -> subprocess.CompletedProcess[str]:
    env = None
    if path is not None:
        env = {"PATH": path, "HOME": str(Path.home()), "LANG": "C.UTF-8"}
    return subprocess.run(
        [sys.executable, "-m", "node_agent.probe", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def node_a_with(tmp_path: Path, old: str, new: str) -> Path:
    text = NODE_A.read_text()
    assert old in text
    path = tmp_path / "node.yaml"
    path.write_text(text.replace(old, new))
    return path


def table(stdout: str) -> list[list[str]]:
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["DEVICE", "TYPE"])
    rows = []
    for line in lines[start + 1 :]:
        if not line.startswith("  "):
            break
        rows.append(line.split(None, 4))
    return rows


def test_node_a_is_usable(tmp_path: Path) -> None:
    r = probe("--config", str(NODE_A), "--verbose", "--state-dir", str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert f"step 1: reading {NODE_A}" in out
    assert (
        "ok: node node-a, address 127.0.0.1, simulated true, health every 1 s, 4 device(s) of type ascend"
        in out
    )
    assert f"ascend: running `npu-smi info` ({tmp_path.resolve() / 'sim-bin' / 'npu-smi'})" in out
    assert "-> ok in" in out and "4 device(s) reported" in out
    assert "| NPU   Name" in out  # --verbose: npu-smi's own table
    assert "node-a/ascend:2: built from the declaration at" in out
    assert [row[:4] for row in table(out)] == [
        [f"node-a/ascend:{i}", "ascend", "910B", "Ready"] for i in range(4)
    ]
    assert "all 4 declared device(s) are usable" in out
    assert (tmp_path / "sim-state.json").exists()  # the agent's layout: state file and shims


def test_json_output(tmp_path: Path) -> None:
    r = probe("--config", str(NODE_A), "-o", "json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["usable"] is True and report["exit_code"] == 0
    assert [t["command"] for t in report["tools"]] == [["npu-smi", "info"]]
    assert report["tools"][0]["reported_indexes"] == [0, 1, 2, 3]
    assert [(d["name"], d["status"]) for d in report["devices"]] == [
        (f"node-a/ascend:{i}", "Ready") for i in range(4)
    ]


def test_wrong_topology_row_names_the_device(tmp_path: Path) -> None:
    config = node_a_with(tmp_path, "- [1, 0, 2, 2]", "- [1, 0, 2]")
    r = probe("--config", str(config))
    assert r.returncode == 1, r.stdout + r.stderr
    rows = table(r.stdout)
    assert [row[3] for row in rows] == ["Ready", "Error", "Ready", "Ready"]
    assert rows[1][0] == "node-a/ascend:1"
    assert "1 of 4 devices unusable (config file" in r.stdout
    why = r.stdout.split("devices unusable", 1)[1]
    assert "node-a/ascend:1: Error:" in why
    assert "expected a row of 4 distances for this device" in why and "a 4x4 matrix" in why


def test_not_yaml_is_exit_2(tmp_path: Path) -> None:
    config = tmp_path / "node.yaml"
    config.write_text("schema_version: 1\nnode: [unclosed\n\tdevices: {\n")
    r = probe("--config", str(config))
    assert r.returncode == 2, r.stdout + r.stderr
    assert "the file cannot be used" in r.stdout
    assert f"{config}:" in r.stdout and "expected valid YAML" in r.stdout
    r = probe("--config", str(tmp_path / "missing.yaml"), "-o", "json")
    assert r.returncode == 2
    assert json.loads(r.stdout)["problems"][0].endswith(
        "no such file; create it (examples in deploy/examples/) or give the agent the right path"
    )


def test_missing_tool_is_named(tmp_path: Path) -> None:
    config = node_a_with(tmp_path, "simulated: true", "simulated: false")
    r = probe("--config", str(config), path=str(tmp_path / "bin"))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "ascend: running `npu-smi info` (not found on PATH)" in r.stdout
    assert f"no usable device on node node-a (config file {config})" in r.stdout
    why = r.stdout.split("no usable device", 1)[1]
    assert f"ascend: npu-smi not found on PATH ({tmp_path / 'bin'})" in why
    assert "install the vendor driver and toolkit that provide npu-smi" in why
    assert [row[3] for row in table(r.stdout)] == ["Error"] * 4


def test_chip_missing_from_the_tool(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    chips = [SimChip("ascend", i, "910B3", 32768, present=i != 2) for i in range(4)]
    write_state(state, chips)
    config = node_a_with(tmp_path, "simulated: true", f"simulated: true\n  simulator_state: {state}")
    r = probe("--config", str(config), "--state-dir", str(tmp_path / "agent"))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "index 3: model '910B3'" in r.stdout and "index 2:" not in r.stdout
    why = r.stdout.split("devices unusable", 1)[1]
    assert (
        "node-a/ascend:2: Error: ascend:2 declared but not found by npu-smi (indexes it reports: 0, 1, 3)"
        in why
    )
