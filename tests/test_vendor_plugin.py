"""The in-process vendor plugin against the stand-in tools: status flaps both ways, missing chips and tools."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from kunlun_common.api import types_pb2
from node_agent.devices import DeviceManager, simulated_env
from node_agent.plugins.config import NodeConfig, parse_config
from node_agent.plugins.standin.state import update_chip
from node_agent.plugins.vendor_plugin import VendorPlugin
from tests.conftest import FAST_TMP

READY = types_pb2.DEVICE_STATUS_READY
UNHEALTHY = types_pb2.DEVICE_STATUS_UNHEALTHY
ERROR = types_pb2.DEVICE_STATUS_ERROR
INTERVAL = 0.3
SLACK = 10.0  # what one or two stand-in tool runs (info, info -m) may take on a loaded machine
Devices = list[types_pb2.Device]

NODE = f"""
schema_version: 1
node: {{name: node-a, address: 127.0.0.1, simulated: true, health_interval_seconds: {INTERVAL}}}
devices:
  - device_type: ascend
    device_ids: [0, 1, 2, 3]
    model: 910B
    p2p_enabled: true
    topology_distance: [[0, 1, 2, 2], [1, 0, 2, 2], [2, 2, 0, 1], [2, 2, 1, 0]]
    hbm_memory_mb: 32768
    supported_dtypes: [fp16, bf16]
"""


@pytest.fixture
def state_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="kvp-", dir=FAST_TMP))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def config() -> NodeConfig:
    return parse_config(NODE, "node-a.yaml")


@pytest.fixture
async def watch(config: NodeConfig, state_dir: Path) -> AsyncIterator[AsyncIterator[Devices]]:
    stream = VendorPlugin(config, "ascend", simulated_env(config, state_dir)).list_and_watch()
    yield stream
    await stream.aclose()  # type: ignore[attr-defined]


async def next_matching(
    stream: AsyncIterator[Devices], pred: Callable[[Devices], bool], within: float
) -> Devices:
    """The first list from `stream` that satisfies `pred`, within `within` seconds."""
    seen: Devices = []
    try:
        async with asyncio.timeout(within):
            async for devices in stream:
                seen = devices
                if pred(devices):
                    return devices
    except TimeoutError:
        pass
    states = [(d.name, d.status, d.status_reason) for d in seen]
    raise AssertionError(f"no matching device list within {within} s; last: {states}")


def status_of(index: int, status: int) -> Callable[[Devices], bool]:
    return lambda devices: devices[index].status == status


async def test_first_list_is_ready_with_telemetry(watch: AsyncIterator[Devices], state_dir: Path) -> None:
    devices = await next_matching(watch, lambda ds: all(d.status == READY for d in ds), SLACK)
    assert [d.name for d in devices] == [f"node-a/ascend:{i}" for i in range(4)]
    assert all(d.plugin == "ascend" and d.telemetry.health == "OK" for d in devices)
    update_chip(
        state_dir / "sim-state.json", "ascend", 2, utilization_pct=55.0, memory_used_mb=1024, power_w=99.5
    )
    devices = await next_matching(watch, lambda ds: ds[2].telemetry.utilization_pct == 55.0, INTERVAL + SLACK)
    t = devices[2].telemetry
    assert (t.memory_used_mb, t.power_w, t.temperature_c) == (1024, 99.5, 40.0)
    assert t.sampled_at_unix_ms > 0


async def test_health_flaps_to_unhealthy_and_back(watch: AsyncIterator[Devices], state_dir: Path) -> None:
    state = state_dir / "sim-state.json"
    await next_matching(watch, status_of(1, READY), SLACK)
    update_chip(state, "ascend", 1, health="Critical")
    started = time.monotonic()
    devices = await next_matching(watch, status_of(1, UNHEALTHY), INTERVAL + SLACK)
    assert time.monotonic() - started < INTERVAL + SLACK
    assert devices[1].status_reason == "npu-smi reports health Critical"
    assert devices[1].telemetry.health == "Critical"
    assert [d.status for i, d in enumerate(devices) if i != 1] == [READY] * 3
    update_chip(state, "ascend", 1, health="OK")
    devices = await next_matching(watch, status_of(1, READY), INTERVAL + SLACK)
    assert devices[1].status_reason == ""


async def test_warning_stays_ready_with_a_note(watch: AsyncIterator[Devices], state_dir: Path) -> None:
    await next_matching(watch, status_of(0, READY), SLACK)
    update_chip(state_dir / "sim-state.json", "ascend", 0, health="Warning")
    devices = await next_matching(watch, lambda ds: ds[0].status_reason != "", INTERVAL + SLACK)
    assert (devices[0].status, devices[0].status_reason) == (READY, "npu-smi reports health Warning")


async def test_removed_chip_is_declared_but_not_found(watch: AsyncIterator[Devices], state_dir: Path) -> None:
    state = state_dir / "sim-state.json"
    await next_matching(watch, status_of(3, READY), SLACK)
    update_chip(state, "ascend", 3, present=False)
    devices = await next_matching(watch, status_of(3, ERROR), INTERVAL + SLACK)
    assert "ascend:3 declared but not found by npu-smi" in devices[3].status_reason
    assert "(indexes it reports: 0, 1, 2)" in devices[3].status_reason
    assert not devices[3].HasField("telemetry")
    update_chip(state, "ascend", 3, present=True)
    devices = await next_matching(watch, status_of(3, READY), INTERVAL + SLACK)
    assert devices[3].telemetry.health == "OK"


async def test_missing_tool_is_named(config: NodeConfig, state_dir: Path) -> None:
    plugin = VendorPlugin(config, "ascend", {"PATH": str(state_dir / "empty-bin")})
    assert await plugin.refresh()
    for d in plugin.devices():
        assert d.status == ERROR
        assert d.status_reason.startswith("npu-smi not found on PATH")
        assert "install the vendor driver and toolkit that provide npu-smi" in d.status_reason
    assert plugin.tool_error is not None and "npu-smi" in plugin.tool_error
    assert not await plugin.refresh()  # nothing changed: no new list


async def test_failing_tool_is_named(config: NodeConfig, state_dir: Path) -> None:
    env = simulated_env(config, state_dir)
    (state_dir / "sim-state.json").write_text("not json")
    plugin = VendorPlugin(config, "ascend", env)
    await plugin.refresh()
    reason = plugin.devices()[0].status_reason
    assert plugin.devices()[0].status == ERROR
    assert "`npu-smi info`" in reason and "check the npu-smi installation" in reason


async def test_declaration_problems_win(state_dir: Path) -> None:
    config = parse_config(NODE.replace("[1, 0, 2, 2]", "[1, 0, 2]"), "bad.yaml")
    plugin = VendorPlugin(config, "ascend", simulated_env(config, state_dir))
    await plugin.refresh()
    devices = plugin.devices()
    assert [d.status for d in devices] == [READY, ERROR, READY, READY]
    assert "bad.yaml:" in devices[1].status_reason and "4x4" in devices[1].status_reason


async def test_device_manager_keeps_the_agent_surface(config: NodeConfig, state_dir: Path) -> None:
    manager = DeviceManager(config, simulated_env(config, state_dir))
    await manager.sample()
    assert [d.status for d in manager.devices()] == [READY] * 4
    assert manager.tool_errors == {}
    samples = manager.samples()
    assert [s.name for s in samples] == [d.name for d in manager.devices()]
    assert all(s.status == READY and s.telemetry.health == "OK" for s in samples)
    update_chip(state_dir / "sim-state.json", "ascend", 1, health="Critical")
    await manager.sample()
    assert manager.samples()[1].status == UNHEALTHY

    broken = DeviceManager(config, {"PATH": str(state_dir / "empty-bin")})
    await broken.sample()
    assert set(broken.tool_errors) == {"ascend"}
    assert "npu-smi not found on PATH" in broken.tool_errors["ascend"]
    assert {d.status for d in broken.devices()} == {ERROR}
