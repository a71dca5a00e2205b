"""Vendor fixes found against published tool outputs: the tool that ran is the tool named, Ascend's
logical and physical ids, and memory printed as unavailable said out loud."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from node_agent.plugins.config import NodeConfig, load_config
from node_agent.plugins.vendor_plugin import VendorPlugin
from node_agent.vendors.ascend import AscendAdapter, parse_npu_smi_info, parse_npu_smi_mapping
from node_agent.vendors.hygon import FLAGS as HYGON_FLAGS
from tests.test_vendor_adapters import Reply, env_for, fake_tool, fixture

ROOT = Path(__file__).resolve().parents[1]
NV_QUERY = [
    "--query-gpu=index,name,memory.total,memory.used,utilization.gpu,temperature.gpu,power.draw",
    "--format=csv,noheader,nounits",
]


def node(tmp_path: Path, devices: str, simulated: bool = False) -> NodeConfig:
    path = tmp_path / "node.yaml"
    path.write_text(
        "schema_version: 1\nnode:\n  name: node-x\n  address: 127.0.0.1\n"
        f"  simulated: {str(simulated).lower()}\n  health_interval_seconds: 1.0\ndevices:\n{devices}"
    )
    return load_config(str(path))


def decl(device_type: str, ids: list[int], model: str, memory_mb: int) -> str:
    rows = [[0 if i == j else 10 for j in range(len(ids))] for i in range(len(ids))]
    topology = f"    topology_distance: {rows}\n" if len(ids) > 1 else ""
    return (
        f'  - device_type: {device_type}\n    device_ids: {ids}\n    model: "{model}"\n{topology}'
        f"    total_memory_mb: {memory_mb}\n    hbm_memory_mb: {memory_mb}\n"
        "    fp16_compute_power_tflops: 10\n    bf16_compute_power_tflops: 10\n    supported_dtypes: [fp16]\n"
    )


# ------------------------------------------------------------------------------ Hygon: the tool that ran


def test_hygon_fallback_names_rocm_smi_in_reasons(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"  # no hy-smi here: an older DTK with rocm-smi only
    fake_tool(bin_dir, "rocm-smi", [Reply([*HYGON_FLAGS, "--json"], fixture("rocm-smi_hygon_z100l.json"))])
    config = node(tmp_path, decl("hygon", [0, 1], "K100_AI", 65536))  # the machine has Z100L cards
    plugin = VendorPlugin(config, "hygon", env_for(bin_dir))
    sample = plugin.poll()
    plugin.apply(sample)
    assert sample.error is None and sample.tool == "rocm-smi" and plugin.tool == "rocm-smi"
    reason = plugin.verdicts["node-x/hygon:0"].reason
    assert "rocm-smi reports 'Z100L'" in reason and "hy-smi" not in reason


def test_hygon_probe_says_rocm_smi_ran(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    fake_tool(bin_dir, "rocm-smi", [Reply([*HYGON_FLAGS, "--json"], fixture("rocm-smi_hygon_z100l.json"))])
    config = node(tmp_path, decl("hygon", [0], "K100_AI", 65536))
    r = subprocess.run(
        [sys.executable, "-m", "node_agent.probe", "--config", config.path],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": str(bin_dir), "HOME": str(Path.home()), "LANG": "C.UTF-8"},
    )
    assert r.returncode == 1, r.stdout + r.stderr
    assert "hygon: running `rocm-smi --showproductname" in r.stdout
    assert "(hy-smi is not on PATH: rocm-smi runs instead)" in r.stdout
    assert "    rocm-smi index 0" not in r.stdout  # not found as declared: no index line
    assert "rocm-smi reports 'Z100L'" in r.stdout and "hy-smi reports" not in r.stdout


# ------------------------------------------------------------------------------ Ascend: logical ids


def test_ascend_device_column_is_physical_logic_id_from_info_m() -> None:
    """Huawei's paired samples of one Atlas 800 model 3000 (npu-smi 21.0.4): Device 3..6 in `npu-smi info`,
    Chip Logic ID 0..3 in `npu-smi info -m`. The logical id is the index (ASCEND_RT_VISIBLE_DEVICES), the
    Device column names the node (/dev/davinci3..6)."""
    mapping = parse_npu_smi_mapping(fixture("npu-smi_info-m_310_21.0.4.txt"))
    assert mapping == {(6, 0): 0, (6, 1): 1, (6, 2): 2, (6, 3): 3}  # the Mcu row has no logic id
    devices = parse_npu_smi_info(fixture("npu-smi_310_21.0.4_device-ids.txt"), mapping)
    assert [(d.index, d.node_id, d.bus_id) for d in devices] == [
        (0, 3, "0000:89:00.0"),
        (1, 4, "0000:8A:00.0"),
        (2, 5, "0000:8B:00.0"),
        (3, 6, "0000:8C:00.0"),
    ]
    # without -m (an old tool), the table alone decides, as before
    assert [d.index for d in parse_npu_smi_info(fixture("npu-smi_310_21.0.4_device-ids.txt"))] == [3, 4, 5, 6]


def test_ascend_older_sample_device_equals_logic_id() -> None:
    mapping = parse_npu_smi_mapping(fixture("npu-smi_info-m_310_20.2.0.txt"))
    assert mapping == {(215, 0): 0, (215, 1): 1, (215, 2): 2, (215, 3): 3}
    devices = parse_npu_smi_info(fixture("npu-smi_310_20.2.0_multichip.txt"), mapping)
    assert [(d.index, d.node_id) for d in devices] == [(0, None), (1, None), (2, None), (3, None)]


async def test_ascend_allocation_uses_logical_ids_and_physical_nodes(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    fake_tool(
        bin_dir,
        "npu-smi",
        [
            Reply(["info"], fixture("npu-smi_310_21.0.4_device-ids.txt")),
            Reply(["info", "-m"], fixture("npu-smi_info-m_310_21.0.4.txt")),
        ],
    )
    config = node(tmp_path, decl("ascend", [0, 1, 2, 3], "310", 8192))
    plugin = VendorPlugin(config, "ascend", env_for(bin_dir))
    plugin.apply(plugin.poll())
    assert {name: v.reason for name, v in plugin.verdicts.items()} == {
        f"node-x/ascend:{i}": "" for i in range(4)
    }
    result = await plugin.allocate(["node-x/ascend:1", "node-x/ascend:0"])
    assert result.envs == {"ASCEND_RT_VISIBLE_DEVICES": "0,1"}
    assert result.device_nodes[:2] == ("/dev/davinci3", "/dev/davinci4")
    raw = plugin.adapter.last_output()
    assert "$ npu-smi info -m" in raw and "Chip Logic ID" in raw


def test_ascend_without_info_m_falls_back_to_the_table(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    fake_tool(bin_dir, "npu-smi", [Reply(["info"], fixture("npu-smi_310_21.0.4_device-ids.txt"))])
    devices = AscendAdapter(env=env_for(bin_dir)).discover()
    assert [(d.index, d.node_id) for d in devices] == [(3, None), (4, None), (5, None), (6, None)]


# ------------------------------------------------------------------------------ memory printed as [N/A]


def test_gb10_memory_unavailable_is_said_in_the_reason(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    fake_tool(
        bin_dir,
        "nvidia-smi",
        [
            Reply(NV_QUERY, fixture("nvidia-smi_query-gpu_gb10_580.126.09.csv")),
            Reply(["-q"], fixture("nvidia-smi_q_a100-sxm4-40gb_535.129.03.txt")),  # health: a -q section
        ],
    )
    config = node(tmp_path, decl("nvidia", [0], "GB10", 131072))
    plugin = VendorPlugin(config, "nvidia", env_for(bin_dir))
    plugin.apply(plugin.poll())
    verdict = plugin.verdicts["node-x/nvidia:0"]
    assert verdict.observed is not None and verdict.observed.memory_total_mb is None
    assert (
        verdict.reason
        == "nvidia-smi reports memory as unavailable; the declared 131072 MB is accepted unchecked"
    )
    device = plugin._devices["node-x/nvidia:0"]
    assert device.status_reason == verdict.reason


def test_gb10_memory_unavailable_in_probe_output(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    fake_tool(
        bin_dir,
        "nvidia-smi",
        [
            Reply(NV_QUERY, fixture("nvidia-smi_query-gpu_gb10_580.126.09.csv")),
            Reply(["-q"], fixture("nvidia-smi_q_a100-sxm4-40gb_535.129.03.txt")),
        ],
    )
    config = node(tmp_path, decl("nvidia", [0], "GB10", 131072))
    r = subprocess.run(
        [sys.executable, "-m", "node_agent.probe", "--config", config.path, "--verbose"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": str(bin_dir), "HOME": str(Path.home()), "LANG": "C.UTF-8"},
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "index 0: model 'NVIDIA GB10', memory unavailable (declared size unchecked), health OK" in r.stdout
    assert "accepted unchecked" in r.stdout.split("step 5")[1]  # the table's reason column


def test_ascend_runs_info_m_again_only_when_the_chips_change(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    calls = tmp_path / "calls"
    fake_tool(
        bin_dir,
        "npu-smi",
        [
            Reply(["info"], fixture("npu-smi_310_21.0.4_device-ids.txt")),
            Reply(["info", "-m"], fixture("npu-smi_info-m_310_21.0.4.txt")),
        ],
    )
    real = bin_dir / "npu-smi"
    real.rename(bin_dir / "npu-smi-real")
    real.write_text(f'#!/bin/sh\necho "$*" >> {calls}\nexec {bin_dir / "npu-smi-real"} "$@"\n')
    real.chmod(0o755)
    adapter = AscendAdapter(env=env_for(bin_dir))
    for _ in range(3):
        assert [(d.index, d.node_id) for d in adapter.discover()] == [(0, 3), (1, 4), (2, 5), (3, 6)]
    assert calls.read_text().splitlines() == ["info", "info -m", "info", "info"]
