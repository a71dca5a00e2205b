"""Vendor tool adapters: fixtures of real tool output, fake tools on PATH, errors, and stand-in round trips.

Fixtures live in tests/fixtures/vendor_tools/ with a .source.txt each saying where the output came from.
"Fake tools" are tiny executables written into tmp_path that print a fixture for exactly the expected
arguments and refuse anything else; "stand-ins" are the simulator's tools (node_agent.plugins.standin)
installed with install_shims and fed from a state file.
"""

from __future__ import annotations

import io
import json
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from node_agent.plugins.standin.__main__ import run as run_standin
from node_agent.plugins.standin.state import (
    STATE_ENV,
    SimChip,
    StateError,
    install_shims,
    read_state,
    update_chip,
    write_state,
)
from node_agent.vendors import ADAPTERS, adapter_for
from node_agent.vendors.ascend import AscendAdapter, parse_npu_smi_info
from node_agent.vendors.base import (
    ObservedDevice,
    ToolFailed,
    ToolNotFound,
    ToolTimeout,
    VendorAdapter,
    cross_check,
    models_match,
)
from node_agent.vendors.cambricon import CambriconAdapter, parse_cnmon_json
from node_agent.vendors.hygon import FLAGS as HYGON_FLAGS
from node_agent.vendors.hygon import HygonAdapter, parse_smi_json
from node_agent.vendors.nvidia import (
    NvidiaAdapter,
    combine,
    parse_nvsmi_log,
    parse_query_csv,
)

FIXTURES = Path(__file__).parent / "fixtures" / "vendor_tools"
NV_QUERY = [
    "--query-gpu=index,name,memory.total,memory.used,utilization.gpu,temperature.gpu,power.draw",
    "--format=csv,noheader,nounits",
]
A100 = "NVIDIA A100-SXM4-40GB"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


def dev(
    index: int,
    model: str,
    total: int | None,
    used: int | None,
    util: float | None,
    temp: float | None,
    power: float | None,
    health: str = "OK",
    bus: str | None = None,
) -> ObservedDevice:
    return ObservedDevice(index, model, total, used, util, temp, power, health, bus)


# ------------------------------------------------------------------------------------------ fake tools


@dataclass
class Reply:
    args: list[str]
    stdout: str = ""
    rc: int = 0
    stderr: str = ""
    write_file: str | None = None  # name of a file to create in the cwd with `stdout` as content


def fake_tool(bin_dir: Path, name: str, replies: Sequence[Reply]) -> Path:
    """An executable `name` that answers exactly the given argument lists and refuses all others."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    spec = json.dumps([r.__dict__ for r in replies])
    script = f"""#!{sys.executable}
import json, pathlib, sys
args = sys.argv[1:]
for reply in json.loads({spec!r}):
    if reply["args"] == args:
        if reply["write_file"]:
            pathlib.Path(reply["write_file"]).write_text(reply["stdout"])
        else:
            sys.stdout.write(reply["stdout"])
        sys.stderr.write(reply["stderr"])
        sys.exit(reply["rc"])
sys.stderr.write("{name}: unrecognized arguments: " + " ".join(args) + "\\n")
sys.exit(2)
"""
    path = bin_dir / name
    path.write_text(script, encoding="utf-8")
    path.chmod(0o755)
    return path


def env_for(bin_dir: Path) -> dict[str, str]:
    return {"PATH": str(bin_dir)}


# ------------------------------------------------------------------------------------------ Ascend


def test_npu_smi_910b1_with_process_table() -> None:
    assert parse_npu_smi_info(fixture("npu-smi_910b1_23.0.rc3.3.txt")) == [
        dev(0, "910B1", 65536, 65099, 55.0, 41.0, 271.1, bus="0000:C1:00.0"),
        dev(1, "910B1", 65536, 65098, 66.0, 42.0, 275.0, bus="0000:01:00.0"),
    ]


def test_npu_smi_910_warning_health_hbm_over_ddr() -> None:
    rows = [
        (0, 70.5, 42.0, "0000:C1:00.0", "OK"),
        (1, 71.2, 36.0, "0000:81:00.0", "OK"),
        (2, 69.0, 35.0, "0000:41:00.0", "OK"),
        (3, 206.9, 39.0, "0000:01:00.0", "Warning"),
        (4, 70.2, 39.0, "0000:C2:00.0", "OK"),
        (5, 64.9, 37.0, "0000:82:00.0", "OK"),
        (6, 69.4, 40.0, "0000:42:00.0", "OK"),
        (7, 203.2, 42.0, "0000:02:00.0", "Warning"),
    ]
    expected = [dev(i, "xxx", 32768, 0, 0.0, t, p, h, b) for i, p, t, b, h in rows]
    assert parse_npu_smi_info(fixture("npu-smi_910_24.1.RC2_warning.txt")) == expected


def test_npu_smi_310_four_chips_under_one_npu_id_use_device_ids() -> None:
    temps = [56.0, 57.0, 57.0, 55.0]
    buses = ["0000:DA:00.0", "0000:DC:00.0", "0000:DD:00.0", "0000:DB:00.0"]
    assert parse_npu_smi_info(fixture("npu-smi_310_20.2.0_multichip.txt")) == [
        dev(i, "310", 8192, 2703, 0.0, temps[i], 12.8, bus=buses[i]) for i in range(4)
    ]


def test_npu_smi_310_device_column_differs_from_chip_id() -> None:
    devices = parse_npu_smi_info(fixture("npu-smi_310_21.0.4_device-ids.txt"))
    assert devices == [
        dev(3, "310", 8192, 2703, 0.0, 73.0, 12.8, bus="0000:89:00.0"),
        dev(4, "310", 8192, 2867, 0.0, 74.0, 12.8, bus="0000:8A:00.0"),
        dev(5, "310", 8192, 2867, 0.0, 70.0, 12.8, bus="0000:8B:00.0"),
        dev(6, "310", 8192, 2867, 0.0, 65.0, 12.8, bus="0000:8C:00.0"),
    ]


def test_npu_smi_310p3_noncontiguous_npu_ids_na_power_ragged_table() -> None:
    assert parse_npu_smi_info(fixture("npu-smi_310p3_23.0.rc3_noncontiguous.txt")) == [
        dev(0, "310P3", 21527, 3841, 0.0, 51.0, None, bus="0000:01:00.0"),
        dev(1, "310P3", 21527, 1764, 0.0, 48.0, None, bus="0000:06:00.0"),
    ]


def test_npu_smi_a3_two_chips_per_npu_phy_ids_dash_power() -> None:
    hbm = [3122, 2891, 3124, 2888, 3117, 2885, 3109, 2890, 3113, 2876, 3106, 2888, 3108, 2885, 3120, 2879]
    power = [161.8, 167.2, 159.7, 161.4, 163.9, 170.9, 164.7, 169.0]
    temps = [36, 36, 36, 36, 37, 36, 36, 36, 37, 36, 36, 36, 38, 37, 37, 38]
    buses = ["9D", "9F", "99", "9B", "95", "97", "91", "93", "8D", "8F", "89", "8B", "85", "87", "81", "83"]
    expected = [
        dev(
            i,
            "Ascend910",
            65536,
            hbm[i],
            0.0,
            float(temps[i]),
            power[i // 2] if i % 2 == 0 else None,
            bus=f"0000:{buses[i]}:00.0",
        )
        for i in range(16)
    ]
    assert parse_npu_smi_info(fixture("npu-smi_a3_ascend910_25.2.1.txt")) == expected


def test_npu_smi_warning_lines_and_alarm_health() -> None:
    text = "DrvMngGetConsoleLogLevel failed. (g_conLogLevel=3)\n" + fixture(
        "npu-smi_910b1_23.0.rc3.3.txt"
    ).replace("| OK            | 275.0", "| Alarm         | 275.0")
    devices = parse_npu_smi_info(text)
    assert [(d.index, d.health) for d in devices] == [(0, "OK"), (1, "Critical")]


def test_npu_smi_several_chip_rows_under_one_npu_row_use_logical_order() -> None:
    # Synthetic: one NPU row followed by two chip rows and no id column (the brief's "several chips under
    # one NPU id" layout); chips are numbered in table order.
    text = """\
| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
+===========================+===============+====================================================+
| 4     910B4               | OK            | 90.0        40                0    / 0             |
| 0                         | 0000:C1:00.0  | 5           0    / 0          100  / 32768         |
| 1                         | 0000:C2:00.0  | 6           0    / 0          200  / 32768         |
+===========================+===============+====================================================+
"""
    assert parse_npu_smi_info(text) == [
        dev(0, "910B4", 32768, 100, 5.0, 40.0, 90.0, bus="0000:C1:00.0"),
        dev(1, "910B4", 32768, 200, 6.0, 40.0, 90.0, bus="0000:C2:00.0"),
    ]


def test_ascend_adapter_runs_fake_npu_smi(tmp_path: Path) -> None:
    text = fixture("npu-smi_910b1_23.0.rc3.3.txt")
    fake_tool(tmp_path / "bin", "npu-smi", [Reply(["info"], text)])
    adapter = AscendAdapter(env=env_for(tmp_path / "bin"))
    assert adapter.command() == ["npu-smi", "info"]
    assert [d.index for d in adapter.discover()] == [0, 1]
    assert adapter.last_output() == text


# ------------------------------------------------------------------------------------------ Cambricon


def test_cnmon_json_units_na_and_degraded_link() -> None:
    assert parse_cnmon_json(fixture("cnmon_info_mlu370-x8.json")) == [
        dev(0, "MLU370-X8", 24576, 1043, 37.0, 45.0, 93.0, "OK", "0000:3b:00.0"),
        dev(1, "MLU370-X8", None, None, None, None, None, "Critical", "0000:3d:00.0"),
        dev(3, "MLU370-X8", 24576, 0, 0.0, 38.0, 41.0, "Warning", "0000:b1:00.0"),
    ]


def test_cambricon_adapter_reads_json_file_written_in_cwd(tmp_path: Path) -> None:
    text = fixture("cnmon_info_mlu370-x8.json")
    fake_tool(tmp_path / "bin", "cnmon", [Reply(["info", "-j"], text, write_file="cnmon_info.json")])
    adapter = CambriconAdapter(env=env_for(tmp_path / "bin"))
    assert [d.index for d in adapter.discover()] == [0, 1, 3]
    assert adapter.last_output() == text


def test_cambricon_adapter_without_json_file_fails_clearly(tmp_path: Path) -> None:
    fake_tool(tmp_path / "bin", "cnmon", [Reply(["info", "-j"], "Card 0 ...\n")])
    with pytest.raises(ToolFailed, match=r"wrote no cnmon_info\.json"):
        CambriconAdapter(env=env_for(tmp_path / "bin")).discover()


# ------------------------------------------------------------------------------------------ Hygon


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("rocm-smi_hygon_dtk-24.04.3.json", dev(0, "DCU xxxx", 65520, 2, 0.0, 39.0, 80.0)),
        ("hy-smi_k100-ai_dtk-25.04.json", dev(0, "K100_AI", 65520, 2, 0.0, 35.0, 77.0)),
        ("rocm-smi_hygon_z100l.json", dev(0, "Z100L", 32752, 2, 0.0, 41.0, 38.0)),
        (
            "rocm-smi_amd_6.2.4_bytes.json",
            dev(0, "Navi 32 [Radeon RX 7700 XT / 7800 XT]", 16368, 11077, 100.0, 51.0, 53.0),
        ),
    ],
)
def test_smi_json_fixtures(name: str, expected: ObservedDevice) -> None:
    assert parse_smi_json(fixture(name)) == [expected]


def test_smi_json_warning_lines_numbers_bytes_and_na() -> None:
    # Synthetic: warning text around the JSON, numbers instead of strings, bytes, an unreadable card.
    text = (
        "WARNING: AMD GPU device(s) is/are in a low-power state. Check power control/runtime_status\n"
        '{"card1": {"HCU use (%)": 7, "vram Total Memory (B)": "1073741824", "vram Total Used Memory (B)": 536870912,'
        ' "Temperature (Sensor core) (C)": "50.0", "PCI Bus": "0000:36:00.0", "Card Series": "BW"},'
        ' "card0": {"Card Series": "BW", "HCU use (%)": "N/A", "vram Total Memory (MiB)": "N/A",'
        ' "vram Total Used Memory (MiB)": "N/A"}, "system": {"Driver version": "6.3"}}\n'
        "=============== End of SMI Log ===============\n"
    )
    assert parse_smi_json(text) == [
        dev(0, "BW", None, None, None, None, None, "Critical"),
        dev(1, "BW", 1024, 512, 7.0, 50.0, None, "OK", "0000:36:00.0"),
    ]


def test_hygon_adapter_prefers_hy_smi_and_falls_back_to_rocm_smi(tmp_path: Path) -> None:
    text = fixture("rocm-smi_hygon_z100l.json")
    fake_tool(tmp_path / "old", "rocm-smi", [Reply([*HYGON_FLAGS, "--json"], text)])
    old = HygonAdapter(env=env_for(tmp_path / "old"))
    assert old.command() == ["rocm-smi", *HYGON_FLAGS, "--json"]
    assert [d.model for d in old.discover()] == ["Z100L"]
    fake_tool(
        tmp_path / "new",
        "hy-smi",
        [Reply([*HYGON_FLAGS, "--json"], fixture("hy-smi_k100-ai_dtk-25.04.json"))],
    )
    both = HygonAdapter(env={"PATH": f"{tmp_path / 'new'}:{tmp_path / 'old'}"})
    assert both.command()[0] == "hy-smi"
    assert [d.model for d in both.discover()] == ["K100_AI"]


def test_hygon_missing_tool_names_both_tools(tmp_path: Path) -> None:
    with pytest.raises(ToolNotFound, match=r"hy-smi \(or rocm-smi\) not found on PATH \(" + str(tmp_path)):
        HygonAdapter(env={"PATH": str(tmp_path)}).discover()


def test_hygon_unparsable_output(tmp_path: Path) -> None:
    fake_tool(
        tmp_path / "bin", "hy-smi", [Reply([*HYGON_FLAGS, "--json"], "WARNING: No JSON data to report\n")]
    )
    with pytest.raises(ToolFailed, match=r"cannot be parsed \(no JSON object in the output\)"):
        HygonAdapter(env=env_for(tmp_path / "bin")).discover()


# ------------------------------------------------------------------------------------------ NVIDIA


def test_nvidia_query_and_log_fixtures_combined() -> None:
    rows, inforom = parse_query_csv(fixture("nvidia-smi_query-gpu_a100-sxm4-40gb_535.129.03.csv"))
    sections = parse_nvsmi_log(fixture("nvidia-smi_q_a100-sxm4-40gb_535.129.03.txt"))
    assert inforom == []
    assert combine(rows, sections, inforom) == [
        dev(0, A100, 40960, 4, 0.0, 22.0, 52.12, "OK", "00000000:2F:00.0"),
        dev(1, A100, 40960, 4, 0.0, 22.0, 53.16, "OK", "00000000:35:00.0"),
    ]


def test_nvidia_query_na_values() -> None:
    rows, _ = parse_query_csv(fixture("nvidia-smi_query-gpu_na_450.57.csv"))
    devices = combine(rows, [], [])
    assert devices == [
        dev(0, "GeForce GTX 1070 Ti", 8119, 4856, 14.0, 38.0, 41.22, "Unknown"),
        dev(1, "GeForce GT 710", 981, 871, None, 45.0, None, "Unknown"),
    ]


@pytest.mark.parametrize(
    ("old", "new", "health"),
    [
        (
            "        Pending                           : No",
            "        Pending                           : Yes",
            "Warning",
        ),
        ("Remapping Failure Occurred        : No", "Remapping Failure Occurred        : Yes", "Critical"),
        (
            "            DRAM Uncorrectable            : 0",
            "            DRAM Uncorrectable            : 3",
            "Critical",
        ),
        (
            "        Reset Required                    : No",
            "        Reset Required                    : Yes",
            "Critical",
        ),
        ("Drain and Reset Recommended       : No", "Drain and Reset Recommended       : Yes", "Warning"),
        ("HW Thermal Slowdown           : Not Active", "HW Thermal Slowdown           : Active", "OK"),
    ],
)
def test_nvidia_health_from_q_sections(old: str, new: str, health: str) -> None:
    # Synthetic variants of the captured log: change the second GPU's section only.
    head, second = fixture("nvidia-smi_q_a100-sxm4-40gb_535.129.03.txt").split("GPU 00000000:35:00.0")
    assert old in second
    sections = parse_nvsmi_log(head + "GPU 00000000:35:00.0" + second.replace(old, new, 1))
    assert [(s.bus_id, s.health) for s in sections] == [
        ("00000000:2F:00.0", "OK"),
        ("00000000:35:00.0", health),
    ]


def test_nvidia_older_double_bit_counters_and_requires_reset_value() -> None:
    log = """\
GPU 0000:05:00.0
    ECC Errors
        Volatile
            Single Bit
                Device Memory             : 4
            Double Bit
                Device Memory             : 1
"""
    assert [s.health for s in parse_nvsmi_log(log)] == ["Critical"]
    rows, _ = parse_query_csv("0, Tesla V100-SXM2-32GB, 32510, [GPU requires reset], 0, 40, 60.00\n")
    assert [d.health for d in combine(rows, [], [])] == ["Critical"]


def test_nvidia_adapter_runs_both_commands(tmp_path: Path) -> None:
    csv_text = fixture("nvidia-smi_query-gpu_a100-sxm4-40gb_535.129.03.csv")
    log_text = fixture("nvidia-smi_q_a100-sxm4-40gb_535.129.03.txt")
    fake_tool(tmp_path / "bin", "nvidia-smi", [Reply(NV_QUERY, csv_text), Reply(["-q"], log_text)])
    adapter = NvidiaAdapter(env=env_for(tmp_path / "bin"))
    assert adapter.command() == ["nvidia-smi", *NV_QUERY]
    assert [(d.index, d.health, d.bus_id) for d in adapter.discover()] == [
        (0, "OK", "00000000:2F:00.0"),
        (1, "OK", "00000000:35:00.0"),
    ]
    assert adapter.last_output() == f"{csv_text}\n$ nvidia-smi -q\n{log_text}"


def test_nvidia_inforom_warning_exit_14(tmp_path: Path) -> None:
    csv_text = fixture("nvidia-smi_query-gpu_inforom-warning.csv")
    log_text = fixture("nvidia-smi_q_a100-sxm4-40gb_535.129.03.txt")
    fake_tool(tmp_path / "bin", "nvidia-smi", [Reply(NV_QUERY, csv_text, rc=14), Reply(["-q"], log_text)])
    devices = NvidiaAdapter(env=env_for(tmp_path / "bin")).discover()
    assert [(d.index, d.health) for d in devices] == [(0, "OK"), (1, "Warning")]


def test_nvidia_no_devices_exit_6_is_empty(tmp_path: Path) -> None:
    fake_tool(tmp_path / "bin", "nvidia-smi", [Reply(NV_QUERY, "No devices were found\n", rc=6)])
    assert NvidiaAdapter(env=env_for(tmp_path / "bin")).discover() == []


def test_nvidia_fake_refuses_health_field_like_real_tool(tmp_path: Path) -> None:
    refusal = fixture("nvidia-smi_query-gpu_invalid-field.txt")
    health_query = ["--query-gpu=index,health", "--format=csv,noheader,nounits"]
    fake_tool(tmp_path / "bin", "nvidia-smi", [Reply(health_query, refusal, rc=2)])
    with pytest.raises(ToolFailed) as failed:
        NvidiaAdapter(env=env_for(tmp_path / "bin")).discover()  # its own query is not answered
    assert failed.value.returncode == 2


# ------------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize("device_type", sorted(ADAPTERS))
def test_missing_tool_names_tool_and_path(device_type: str, tmp_path: Path) -> None:
    adapter = adapter_for(device_type, env={"PATH": f"{tmp_path}/a:{tmp_path}/b"})
    with pytest.raises(ToolNotFound) as missing:
        adapter.discover()
    message = str(missing.value)
    assert f"{adapter.tool}" in message
    assert f"not found on PATH ({tmp_path}/a:{tmp_path}/b)" in message
    assert "install" in message


def test_tool_failure_carries_stderr_and_code(tmp_path: Path) -> None:
    fake_tool(tmp_path / "bin", "npu-smi", [Reply(["info"], "", rc=3, stderr="dcmi init failed: -8020\n")])
    with pytest.raises(ToolFailed) as failed:
        AscendAdapter(env=env_for(tmp_path / "bin")).discover()
    assert failed.value.returncode == 3
    assert failed.value.stderr == "dcmi init failed: -8020\n"
    assert "`npu-smi info` exited with code 3: dcmi init failed: -8020" in str(failed.value)
    assert failed.value.tool == "npu-smi"
    assert failed.value.command == ["npu-smi", "info"]


def test_fake_tool_refuses_unknown_flags(tmp_path: Path) -> None:
    fake_tool(tmp_path / "bin", "npu-smi", [Reply(["info", "-l"], "")])
    with pytest.raises(ToolFailed, match="npu-smi: unrecognized arguments: info"):
        AscendAdapter(env=env_for(tmp_path / "bin")).discover()


def test_unparsable_npu_smi_output(tmp_path: Path) -> None:
    fake_tool(tmp_path / "bin", "npu-smi", [Reply(["info"], "something else\n")])
    with pytest.raises(ToolFailed, match="cannot be parsed"):
        AscendAdapter(env=env_for(tmp_path / "bin")).discover()


def test_timeout_kills_the_tool_and_its_children(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    hung = bin_dir / "npu-smi"
    hung.write_text(  # a hung tool whose child keeps the pipes open
        f"#!{sys.executable}\nimport subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])\ntime.sleep(30)\n",
        encoding="utf-8",
    )
    hung.chmod(0o755)
    start = time.monotonic()
    with pytest.raises(ToolTimeout, match=r"did not finish within 0.3 s and was killed"):
        AscendAdapter(env=env_for(bin_dir), timeout_s=0.3).discover()
    assert time.monotonic() - start < 5


def test_not_executable_tool(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "npu-smi").write_bytes(b"\x7fELF not really")
    (bin_dir / "npu-smi").chmod(0o755)
    with pytest.raises(ToolFailed, match="could not be started"):
        AscendAdapter(env=env_for(bin_dir)).discover()


def test_adapter_registry() -> None:
    assert {k: v.tool for k, v in ADAPTERS.items()} == {
        "ascend": "npu-smi",
        "cambricon": "cnmon",
        "hygon": "hy-smi",
        "nvidia": "nvidia-smi",
        "iluvatar": "ixsmi",
    }
    assert isinstance(adapter_for("nvidia", env={}), NvidiaAdapter)
    with pytest.raises(ValueError, match="unknown device type 'tpu'; expected one of ascend, cambricon"):
        adapter_for("tpu")


# ------------------------------------------------------------------------------------------ cross_check


def test_cross_check() -> None:
    observed = [
        dev(0, "Ascend910B3", 65536, 0, 0.0, 40.0, 90.0),
        dev(2, "910B3", None, None, None, None, None),
    ]

    def check(*args: Any) -> list[str]:  # each reason is a message: its English text
        return [str(m) for m in cross_check(*args)]

    assert check("ascend", "npu-smi", 0, "910B", 65536, observed) == []
    assert check("ascend", "npu-smi", 0, "910b3", 63000, observed) == []  # within 5 %
    assert check("ascend", "npu-smi", 1, "910B3", 65536, observed) == [
        "ascend:1 declared but not found by npu-smi (indexes it reports: 0, 2)"
    ]
    assert check("ascend", "npu-smi", 0, "910B", 32768, observed) == [
        "ascend:0: declared 32768 MB, npu-smi reports 65536 MB"
    ]
    assert check("ascend", "npu-smi", 0, "910A", 65536, observed) == [
        "ascend:0: declared model '910A', npu-smi reports 'Ascend910B3'"
    ]
    assert check("ascend", "npu-smi", 2, "910B3", 65536, observed) == []  # memory unknown: not judged
    assert check("nvidia", "nvidia-smi", 0, "A100", 40960, []) == [
        "nvidia:0 declared but not found by nvidia-smi (indexes it reports: none)"
    ]


@pytest.mark.parametrize(
    ("declared", "observed", "match"),
    [
        ("910B", "Ascend910B3", True),
        ("Ascend 910B3", "910B3", True),
        ("A100", A100, True),
        ("a100-sxm4-40gb", A100, True),
        ("A100-SXM4-80GB", A100, False),
        ("A10", "NVIDIA A100-PCIE-40GB", False),
        ("910A", "910B3", False),
        ("MLU370", "MLU370-X8", True),
        ("MLU370-X4", "MLU370-X8", False),
        ("K100_AI", "K100_AI", True),
        ("K100", "Z100L", False),
    ],
)
def test_model_rule(declared: str, observed: str, match: bool) -> None:
    assert models_match(declared, observed) is match


# ------------------------------------------------------------------------------------------ state file


def test_state_round_trip_and_update(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    chips = [SimChip("ascend", 0, "910B3", 65536), SimChip("nvidia", 0, A100, 40960, utilization_pct=12.5)]
    write_state(path, chips)
    assert read_state(path) == chips
    update_chip(path, "ascend", 0, utilization_pct=90.0, health="Critical", present=False)
    assert read_state(path)[0] == SimChip(
        "ascend", 0, "910B3", 65536, utilization_pct=90.0, health="Critical", present=False
    )
    assert not list(tmp_path.glob(".state.json.*.tmp"))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"health": "Broken"}, "health must be one of OK, Warning, Critical, got 'Broken'"),
        ({"colour": "red"}, "unknown field 'colour'"),
        ({"memory_used_mb": "lots"}, "memory_used_mb must be int, got 'lots'"),
        ({"index": 3}, "index identifies the chip and cannot change"),
    ],
)
def test_state_rejects_bad_changes(tmp_path: Path, change: dict[str, object], message: str) -> None:
    path = tmp_path / "state.json"
    write_state(path, [SimChip("ascend", 0, "910B3", 65536)])
    with pytest.raises(StateError, match=message):
        update_chip(path, "ascend", 0, **change)


def test_state_unknown_chip_and_bad_file(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    write_state(path, [])
    with pytest.raises(StateError, match="no chip hygon:1"):
        update_chip(path, "hygon", 1, utilization_pct=1.0)
    path.write_text('{"version": 2, "chips": []}')
    with pytest.raises(StateError, match="version 2 is not supported"):
        read_state(path)


def test_concurrent_updates_are_not_lost(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    write_state(path, [SimChip("nvidia", i, A100, 40960) for i in range(8)])

    def bump(index: int) -> None:
        for step in range(1, 6):
            update_chip(path, "nvidia", index, memory_used_mb=step * 100 + index)

    threads = [threading.Thread(target=bump, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [c.memory_used_mb for c in read_state(path)] == [500 + i for i in range(8)]


# ------------------------------------------------------------------------------------------ stand-ins


def standin(argv: list[str], state: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[int, str, str]:
    monkeypatch.setenv(STATE_ENV, str(state))
    out, err = io.StringIO(), io.StringIO()
    rc = run_standin(argv, out, err)
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture
def one_of_each(tmp_path: Path) -> Path:
    path = tmp_path / "state.json"
    write_state(
        path,
        [
            SimChip("ascend", 0, "910B3", 65536),
            SimChip("cambricon", 0, "MLU370-X8", 24576),
            SimChip("hygon", 0, "K100_AI", 65520),
            SimChip("nvidia", 0, A100, 40960),
        ],
    )
    return path


def test_standin_nvidia_smi_refuses_like_real_tool(
    one_of_each: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    refusal = fixture("nvidia-smi_query-gpu_invalid-field.txt")
    assert standin(["nvidia-smi", "--query-gpu=index,health", "--format=csv"], one_of_each, monkeypatch) == (
        2,
        refusal,
        "",
    )
    assert standin(["nvidia-smi", "--bogus"], one_of_each, monkeypatch) == (
        2,
        "ERROR: Option --bogus is not recognized. Please run 'nvidia-smi -h'.\n",
        "",
    )
    assert standin(["nvidia-smi", "--format=csv"], one_of_each, monkeypatch) == (
        2,
        "Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.\n",
        "",
    )
    rc, out, _ = standin(
        ["nvidia-smi", "--query-gpu=index,clocks.sm,power.draw", "--format=csv"], one_of_each, monkeypatch
    )
    assert (rc, out) == (0, "index, clocks.sm, power.draw [W]\n0, [N/A], 80.00 W\n")


def test_standin_nvidia_smi_without_driver_or_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rc, out, err = standin(["nvidia-smi", "-q"], tmp_path / "missing.json", monkeypatch)
    assert rc == 9
    assert out.startswith("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.")
    assert "cannot read KUNLUN_SIM_STATE" in err
    empty = tmp_path / "empty.json"
    write_state(empty, [SimChip("ascend", 0, "910B3", 65536)])
    assert standin(["nvidia-smi", "-L"], empty, monkeypatch) == (6, "No devices were found\n", "")


def test_standin_other_tools_refuse(one_of_each: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rc, out, _ = standin(["npu-smi", "info", "-t", "health"], one_of_each, monkeypatch)
    assert rc == 1 and out.startswith("Command error: `npu-smi info -t health` is not supported")
    rc, _, err = standin(["hy-smi", "--showuse", "--bogus"], one_of_each, monkeypatch)
    assert rc == 2 and err.endswith("hy-smi: error: unrecognized arguments: --bogus\n")
    rc, _, err = standin(["rocm-smi", "--showmeminfo", "disk"], one_of_each, monkeypatch)
    assert rc == 2 and "argument --showmeminfo: invalid choice: 'disk'" in err
    rc, _, err = standin(["cnmon", "info"], one_of_each, monkeypatch)
    assert rc == 1 and "add -j" in err
    rc, _, err = standin(["cnmon", "info", "-x", "-j"], one_of_each, monkeypatch)
    assert rc == 1 and "unknown command or option '-x'" in err
    rc, _, err = standin(["gpu-smi"], one_of_each, monkeypatch)
    assert rc == 2 and err.startswith("usage: python -m node_agent.plugins.standin")


def test_standin_text_modes(one_of_each: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rc, out, _ = standin(["hy-smi", "--showuse"], one_of_each, monkeypatch)
    assert rc == 0 and "HCU[0]\t\t: HCU use (%): 0.0\n" in out
    rc, out, _ = standin(["nvidia-smi"], one_of_each, monkeypatch)
    assert rc == 0 and "NVIDIA A100-SXM4-40GB" in out and "0MiB /  40960MiB" in out
    rc, out, _ = standin(["nvidia-smi", "-L"], one_of_each, monkeypatch)
    assert (rc, out) == (0, "GPU 0: NVIDIA A100-SXM4-40GB (UUID: GPU-00000000-0000-4000-8000-6b756e6c756e)\n")


# ------------------------------------------------------------------------------------------ round trips


def discover_via_shims(tmp_path: Path, chips: list[SimChip], device_type: str) -> VendorAdapter:
    tmp_path.mkdir(parents=True, exist_ok=True)
    state = tmp_path / "state.json"
    write_state(state, chips)
    env = install_shims(tmp_path / "bin", sys.executable, state)
    assert env[STATE_ENV] == str(state.resolve())
    assert env["PATH"].startswith(f"{(tmp_path / 'bin').resolve()}:")
    return adapter_for(device_type, env={"PATH": env["PATH"]})


def test_round_trip_ascend_910b(tmp_path: Path) -> None:
    chips = [
        SimChip("ascend", 0, "910B3", 65536, 3000, 25.0, 41.0, 95.7, bus_id="0000:C1:00.0"),
        SimChip("ascend", 1, "910B3", 65536, 0, 0.0, 40.0, 90.0, health="Critical", bus_id="0000:C2:00.0"),
        SimChip("ascend", 2, "910B3", 65536, present=False, bus_id="0000:81:00.0"),
        SimChip(
            "ascend", 3, "910B3", 65536, 60000, 100.0, 97.0, 310.5, health="Warning", bus_id="0000:82:00.0"
        ),
        SimChip("nvidia", 0, A100, 40960),
    ]
    adapter = discover_via_shims(tmp_path, chips, "ascend")
    assert adapter.discover() == [
        dev(0, "910B3", 65536, 3000, 25.0, 41.0, 95.7, "OK", "0000:C1:00.0"),
        dev(1, "910B3", 65536, 0, 0.0, 40.0, 90.0, "Critical", "0000:C2:00.0"),
        dev(3, "910B3", 65536, 60000, 100.0, 97.0, 310.5, "Warning", "0000:82:00.0"),
    ]
    assert "No running processes found in NPU 3" in adapter.last_output()


def test_round_trip_ascend_a3_and_310_layouts(tmp_path: Path) -> None:
    a3 = [SimChip("ascend", i, "Ascend910", 65536, 1000 + i, bus_id=f"0000:9{i}:00.0") for i in range(4)]
    a3[3].present = False
    adapter = discover_via_shims(tmp_path / "a3", a3, "ascend")
    assert adapter.discover() == [
        dev(0, "Ascend910", 65536, 1000, 0.0, 40.0, 80.0, bus="0000:90:00.0"),
        dev(1, "Ascend910", 65536, 1001, 0.0, 40.0, None, bus="0000:91:00.0"),
        dev(2, "Ascend910", 65536, 1002, 0.0, 40.0, 80.0, bus="0000:92:00.0"),
    ]
    assert "| Chip  Phy-ID" in adapter.last_output()
    cards = [SimChip("ascend", i, "310", 8192, 2703, bus_id=f"0000:D{i}:00.0") for i in range(6)]
    adapter = discover_via_shims(tmp_path / "310", cards, "ascend")
    assert [(d.index, d.memory_used_mb, d.power_w) for d in adapter.discover()] == [
        (i, 2703, 80.0) for i in range(6)
    ]
    assert "| 1     310" in adapter.last_output()  # chips 4 and 5 sit under NPU id 1
    pro = [SimChip("ascend", i, "310P3", 21527, 1764, temperature_c=48.0) for i in (0, 1)]
    adapter = discover_via_shims(tmp_path / "310p", pro, "ascend")
    assert [(d.index, d.memory_total_mb, d.power_w, d.temperature_c) for d in adapter.discover()] == [
        (0, 21527, None, 48.0),
        (1, 21527, None, 48.0),
    ]


def test_round_trip_cambricon(tmp_path: Path) -> None:
    chips = [
        SimChip("cambricon", 0, "MLU370-X8", 24576, 1043, 37.0, 45.0, 93.0, bus_id="0000:3b:00.0"),
        SimChip("cambricon", 1, "MLU370-X8", 24576, health="Critical", bus_id="0000:3d:00.0"),
        SimChip("cambricon", 2, "MLU370-X8", 24576, present=False),
        SimChip(
            "cambricon", 3, "MLU370-X8", 24576, 100, 99.0, 105.0, 150.0, "Warning", bus_id="0000:b1:00.0"
        ),
    ]
    assert discover_via_shims(tmp_path, chips, "cambricon").discover() == [
        dev(0, "MLU370-X8", 24576, 1043, 37.0, 45.0, 93.0, "OK", "0000:3b:00.0"),
        dev(1, "MLU370-X8", None, None, None, None, None, "Critical", "0000:3d:00.0"),
        dev(3, "MLU370-X8", 24576, 100, 99.0, 105.0, 150.0, "Warning", "0000:b1:00.0"),
    ]


def test_round_trip_hygon(tmp_path: Path) -> None:
    chips = [
        SimChip("hygon", 0, "K100_AI", 65520, 20413, 27.5, 50.0, 118.0, bus_id="0000:09:00.0"),
        SimChip("hygon", 1, "K100_AI", 65520, health="Critical", bus_id="0000:36:00.0"),
        SimChip("hygon", 2, "K100_AI", 65520, present=False),
        SimChip("hygon", 3, "K100_AI", 65520, 3, 0.0, 101.0, 300.0, "Warning", bus_id="0000:9f:00.0"),
    ]
    assert discover_via_shims(tmp_path, chips, "hygon").discover() == [
        dev(0, "K100_AI", 65520, 20413, 27.5, 50.0, 118.0, "OK", "0000:09:00.0"),
        dev(1, "K100_AI", None, None, None, None, None, "Critical", "0000:36:00.0"),
        dev(3, "K100_AI", 65520, 3, 0.0, 101.0, 300.0, "OK", "0000:9f:00.0"),  # Warning cannot be shown
    ]


def test_round_trip_nvidia(tmp_path: Path) -> None:
    chips = [
        SimChip("nvidia", 0, A100, 40960, 4, 0.0, 22.0, 52.12, bus_id="00000000:2F:00.0"),
        SimChip("nvidia", 1, A100, 40960, 100, 3.0, 40.0, 60.0, "Critical", bus_id="00000000:35:00.0"),
        SimChip("nvidia", 2, A100, 40960, present=False),
        SimChip("nvidia", 3, A100, 40960, 39000, 100.0, 95.0, 399.5, "Warning", bus_id="00000000:62:00.0"),
    ]
    adapter = discover_via_shims(tmp_path, chips, "nvidia")
    assert adapter.discover() == [
        dev(0, A100, 40960, 4, 0.0, 22.0, 52.12, "OK", "00000000:2F:00.0"),
        dev(1, A100, 40960, 100, 3.0, 40.0, 60.0, "Critical", "00000000:35:00.0"),
        dev(3, A100, 40960, 39000, 100.0, 95.0, 399.5, "Warning", "00000000:62:00.0"),
    ]
    assert "HW Thermal Slowdown           : Active" in adapter.last_output()


def test_round_trip_follows_state_changes(tmp_path: Path) -> None:
    adapter = discover_via_shims(tmp_path, [SimChip("nvidia", 0, A100, 40960)], "nvidia")
    assert [d.utilization_pct for d in adapter.discover()] == [0.0]
    update_chip(tmp_path / "state.json", "nvidia", 0, utilization_pct=64.0, memory_used_mb=30000)
    assert [(d.utilization_pct, d.memory_used_mb) for d in adapter.discover()] == [(64.0, 30000)]
    update_chip(tmp_path / "state.json", "nvidia", 0, present=False)
    assert adapter.discover() == []
