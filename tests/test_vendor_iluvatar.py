"""The fifth vendor, Iluvatar CoreX (`ixsmi`), added through the registry: its published output, its
stand-in, its runtime, and `engine: sglang` refused at submit and at launch while `template` runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from controlplane.workloads.spec import validate, with_defaults
from kunlun_common.api import workload_pb2
from kunlun_common.errors import ConfigError
from node_agent.executor.launch_plan import EngineRequest, LaunchSettings, build_launch_plan
from node_agent.plugins.contract import allocation_for
from node_agent.plugins.standin.state import SimChip, install_shims, write_state
from node_agent.vendors import VENDORS, adapter_for
from node_agent.vendors.base import ObservedDevice
from node_agent.vendors.iluvatar import IluvatarAdapter, parse_ixsmi_csv
from tests.test_vendor_adapters import Reply, env_for, fake_tool, fixture

ROOT = Path(__file__).resolve().parents[1]
COMMAND = [
    "--format=csv,noheader",
    "--query-gpu=index,name,memory.total,memory.used,utilization.gpu,temperature.gpu",
]
PUBLISHED = [
    ObservedDevice(0, "Iluvatar MR-V50", 16384, 116, 0.0, 30.0, None, "OK"),
    ObservedDevice(1, "Iluvatar MR-V100", 32768, 27996, 0.0, 36.0, None, "OK"),
]


def test_published_ixsmi_output_parses() -> None:
    assert parse_ixsmi_csv(fixture("ixsmi_query-gpu_mr-v50_mr-v100.csv")) == PUBLISHED


def test_adapter_runs_exactly_the_published_command(tmp_path: Path) -> None:
    fake_tool(tmp_path / "bin", "ixsmi", [Reply(COMMAND, fixture("ixsmi_query-gpu_mr-v50_mr-v100.csv"))])
    adapter = IluvatarAdapter(env=env_for(tmp_path / "bin"))
    assert adapter.discover() == PUBLISHED
    assert adapter.command() == ["ixsmi", *COMMAND]


def test_unreadable_gpu_is_critical_and_no_devices_is_empty(tmp_path: Path) -> None:
    rows = parse_ixsmi_csv("0, Iluvatar BI-V150, [N/A], [N/A], [N/A], 40 C\n")
    assert [(d.memory_total_mb, d.health) for d in rows] == [(None, "Critical")]
    fake_tool(tmp_path / "bin", "ixsmi", [Reply(COMMAND, "No devices were found\n", rc=6)])
    assert IluvatarAdapter(env=env_for(tmp_path / "bin")).discover() == []


def test_stand_in_round_trip(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    write_state(
        state,
        [
            SimChip("iluvatar", 0, "Iluvatar BI-V150", 32768, memory_used_mb=1024, utilization_pct=12.0),
            SimChip("iluvatar", 2, "Iluvatar BI-V150", 32768, temperature_c=51.0),
            SimChip("nvidia", 0, "NVIDIA A100-SXM4-40GB", 40960),
        ],
    )
    env = install_shims(tmp_path / "bin", sys.executable, state)
    devices = adapter_for("iluvatar", env=env).discover()
    assert [(d.index, d.model, d.memory_total_mb, d.memory_used_mb, d.utilization_pct) for d in devices] == [
        (0, "Iluvatar BI-V150", 32768, 1024, 12.0),
        (2, "Iluvatar BI-V150", 32768, 0, 0.0),
    ]
    refused = subprocess.run([str(tmp_path / "bin" / "ixsmi"), "-q"], capture_output=True, text=True, env=env)
    assert refused.returncode == 2 and "not supported by the Kunlun stand-in" in refused.stderr
    bad_field = subprocess.run(
        [str(tmp_path / "bin" / "ixsmi"), "--format=csv,noheader", "--query-gpu=index,health"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert (bad_field.returncode, bad_field.stdout) == (
        2,
        'Field "health" is not a valid field to query.\n\n',
    )


def test_runtime_allocation() -> None:
    result = allocation_for("iluvatar", [3, 1])
    assert result.envs == {"CUDA_VISIBLE_DEVICES": "1,3"}
    assert result.device_nodes == ("/dev/iluvatar1", "/dev/iluvatar3") and result.engine_args == ()


def request(engine: str, template: str | None = None) -> EngineRequest:
    return EngineRequest(
        workload_name="chat",
        model="/models/m",
        engine=engine,
        command_template=template,
        quantization=None,
        dtype=None,
        tp_size=1,
        device_type="iluvatar",
        device_model="BI-V150",
        envs={"CUDA_VISIBLE_DEVICES": "2"},
        device_nodes=("/dev/iluvatar2",),
        engine_hints=(),
        custom_attributes={},
        host="127.0.0.1",
        port=30000,
    )


def test_launch_refuses_sglang_and_runs_a_template() -> None:
    with pytest.raises(
        ConfigError, match="engine 'sglang' cannot run on iluvatar: upstream SGLang has no Iluvatar"
    ):
        build_launch_plan(request("sglang"), LaunchSettings())
    plan = build_launch_plan(
        request("template", "/opt/ix/serve --model {model} --port {port}"), LaunchSettings()
    )
    assert plan.argv == ("/opt/ix/serve", "--model", "/models/m", "--port", "30000")
    assert plan.env["CUDA_VISIBLE_DEVICES"] == "2" and plan.device_nodes == ("/dev/iluvatar2",)


def spec(**fields: object) -> workload_pb2.WorkloadSpec:
    return with_defaults(workload_pb2.WorkloadSpec(name="chat", model="m", **fields))  # type: ignore[arg-type]


def test_submit_refuses_sglang_on_iluvatar_with_the_reason() -> None:
    problems = [
        str(p) for p in validate(spec(preferred_device_types=["iluvatar"]))
    ]  # engine defaults to sglang
    assert problems == [
        "engine: sglang cannot run on iluvatar devices: upstream SGLang has no Iluvatar CoreX device; "
        "use engine: template"
    ]
    assert str(validate(spec(pin="node-a/iluvatar:0"))[0]).startswith("engine: sglang cannot run on iluvatar")
    assert validate(spec(preferred_device_types=["ascend", "nvidia"])) == []
    template = spec(
        preferred_device_types=["iluvatar"], engine="template", command_template="/opt/ix/serve --port {port}"
    )
    assert validate(template) == []


def test_adding_the_vendor_touched_only_its_own_files() -> None:
    """Outside tests, the word appears only in the vendor's module, its stand-in, the registry line and
    the editor schema's enum (see README, "Adding a device vendor")."""
    allowed = {
        "node_agent/vendors/iluvatar.py",
        "node_agent/plugins/standin/ixsmi.py",
        "kunlun_common/names.py",
        "node_agent/plugins/device-plugin-config.schema.json",
        "README.md",
    }
    found = set()
    for top in (
        "controlplane",
        "node_agent",
        "gateway",
        "devcluster",
        "kunlun_common",
        "deploy",
        "README.md",
    ):
        for path in [ROOT / top] if top.endswith(".md") else (ROOT / top).rglob("*"):
            if path.is_file() and path.suffix in (".py", ".json", ".yaml", ".md", ".toml"):
                if "iluvatar" in path.read_text(errors="replace").lower():
                    found.add(str(path.relative_to(ROOT)))
    assert found <= allowed and "node_agent/vendors/iluvatar.py" in found
    assert VENDORS["iluvatar"].sglang_refusal
