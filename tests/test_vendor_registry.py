"""The vendor registry: one module per vendor, one record each, and every former parallel table reads it."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from kunlun_common.names import DEVICE_TYPES, VENDOR_NAMES
from node_agent.plugins.config_schema import DEVICE_FIELDS, VENDOR_ALIASES
from node_agent.plugins.contract import allocation_for
from node_agent.plugins.standin import __main__ as standin_main
from node_agent.plugins.standin import state as standin_state
from node_agent.vendors import ADAPTERS, VENDORS, Vendor, aliases, vendor

ROOT = Path(__file__).resolve().parent.parent


def test_every_registry_line_has_a_module_with_one_record() -> None:
    assert list(VENDORS) == [v.type_name for v in VENDOR_NAMES] == list(DEVICE_TYPES)
    for name, record in VENDORS.items():
        module = importlib.import_module(f"node_agent.vendors.{name}")
        records = [value for value in vars(module).values() if isinstance(value, Vendor)]
        assert records == [record], name
        assert record.type_name == name == record.adapter.device_type
        assert record.runtime.visible_env and record.standin.tools
        assert record.tool in record.standin.tools  # the stand-in answers to the tool the adapter runs


def test_the_former_tables_read_the_registry() -> None:
    device_type = next(f for f in DEVICE_FIELDS if f.name == "device_type")
    assert device_type.enum == DEVICE_TYPES
    assert (
        VENDOR_ALIASES == aliases() and VENDOR_ALIASES["npu"] == "ascend" and VENDOR_ALIASES["dcu"] == "hygon"
    )
    assert standin_state.DEVICE_TYPES == DEVICE_TYPES
    assert set(standin_state.TOOLS) == {t for v in VENDORS.values() for t in v.standin.tools}
    assert set(standin_main.TOOLS) == set(standin_state.TOOLS)
    assert dict(ADAPTERS) == {name: v.adapter for name, v in VENDORS.items()}
    for name, record in VENDORS.items():
        result = allocation_for(name, [1, 0])
        assert result.envs == {record.runtime.visible_env: "0,1"}
        assert result.engine_args == record.runtime.sglang_args
        assert result.device_nodes[-len(record.runtime.shared_nodes) or len(result.device_nodes) :] == (
            record.runtime.shared_nodes
        )


def test_unknown_type_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown device type 'tpu'; expected one of ascend, cambricon"):
        vendor("tpu")


def test_production_code_never_imports_the_simulator() -> None:
    """Only the simulator package itself (and the simulated-mode wiring it owns) imports it."""
    offenders = {}
    for path in (ROOT / "node_agent").rglob("*.py"):
        if "plugins/standin" in str(path):
            continue
        tree = ast.parse(path.read_text())
        names = {
            *(a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names),
            *(n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module),
        }
        bad = sorted(m for m in names if m.startswith("node_agent.plugins.standin"))
        if bad:
            offenders[str(path.relative_to(ROOT))] = bad
    assert offenders == {}


def test_simulated_mode_is_injected_with_a_chip_usage_hook(tmp_path: Path) -> None:
    from node_agent.plugins.config import load_config
    from node_agent.simulation import simulated_mode

    config = load_config(str(ROOT / "deploy" / "examples" / "node-a.yaml"))
    mode = simulated_mode(config, tmp_path)
    assert mode.env["PATH"].split(":")[0] == str((tmp_path / "sim-bin").resolve())
    assert mode.state_path == (tmp_path / "sim-state.json").resolve()
    mode.chip_usage("ascend", 1, 1234, 55.0)
    chip = next(c for c in standin_state.read_state(mode.state_path) if c.index == 1)
    assert (chip.memory_used_mb, chip.utilization_pct) == (1234, 55.0)
    mode.chip_usage("ascend", 99, 1, 1.0)  # no such chip: logged, never raised into the executor
