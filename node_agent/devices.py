"""The agent's view of its devices: declarations + vendor tools -> Device objects with status.

Each declared device is checked against what its vendor tool reports (present, memory within 5%,
model) and sampled every `health_interval_seconds`. A device is never dropped: a wrong declaration
or a device the tool does not show is reported with status Error and the reason. In simulated mode
the same adapters run against stand-in tools (installed as shims on a private PATH) that read a
per-node state file seeded from the declaration; nothing else differs.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import structlog
from google.protobuf import struct_pb2

from kunlun_common.api import agent_pb2, types_pb2
from node_agent.plugins.config import DeviceDecl, NodeConfig
from node_agent.plugins.standin.state import SimChip, install_shims, write_state
from node_agent.plugins.vendors import adapter_for
from node_agent.plugins.vendors.base import ObservedDevice, ToolError, VendorAdapter, cross_check

log = structlog.get_logger("devices")
READY = types_pb2.DEVICE_STATUS_READY
UNHEALTHY = types_pb2.DEVICE_STATUS_UNHEALTHY
ERROR = types_pb2.DEVICE_STATUS_ERROR


def simulated_env(config: NodeConfig, state_dir: Path) -> dict[str, str]:
    """Seed the stand-in tools' state from the declaration (once) and put their shims on PATH."""
    state = Path(config.simulator_state) if config.simulator_state else state_dir / "sim-state.json"
    if not state.exists():
        chips = [
            SimChip(
                device_type=d.device_type,
                index=d.device_id,
                model=d.model,
                memory_total_mb=d.hbm_memory_mb or d.total_memory_mb,
                bus_id=f"0000:{0x10 + i:02x}:00.0",
            )
            for i, d in enumerate(config.devices)
            if d.device_type in ("ascend", "cambricon", "hygon", "nvidia")
        ]
        state.parent.mkdir(parents=True, exist_ok=True)
        write_state(state, chips)
    env = dict(os.environ)
    env.update(install_shims(state_dir / "sim-bin", sys.executable, state))
    return env


@dataclass
class DeviceState:
    decl: DeviceDecl
    device: types_pb2.Device
    observed: ObservedDevice | None = None


def _device_from_decl(config: NodeConfig, d: DeviceDecl) -> types_pb2.Device:
    attrs = struct_pb2.Struct()
    attrs.update(dict(d.custom_attributes))
    return types_pb2.Device(
        name=config.device_name(d),
        node=config.node_name,
        device_type=d.device_type,
        index=d.device_id,
        model=d.model,
        total_memory_mb=d.total_memory_mb,
        hbm_memory_mb=d.hbm_memory_mb,
        sys_memory_mb=d.sys_memory_mb,
        fp16_tflops=d.fp16_tflops,
        bf16_tflops=d.bf16_tflops,
        int8_tflops=d.int8_tflops,
        supported_dtypes=list(d.supported_dtypes),
        p2p_enabled=d.p2p_enabled,
        p2p_bandwidth_gbps=d.p2p_bandwidth_gbps,
        topology_distance=list(d.topology_distance),
        custom_attributes=attrs,
        plugin=d.device_type,
    )


def _health_status(obs: ObservedDevice) -> tuple[types_pb2.DeviceStatus.ValueType, str]:
    if obs.health == "Critical":
        return UNHEALTHY, "vendor tool reports health Critical"
    return READY, ("vendor tool reports health Warning" if obs.health == "Warning" else "")


@dataclass
class DeviceManager:
    """Discovers and samples every declared device through its vendor adapter."""

    config: NodeConfig
    env: Mapping[str, str]
    states: list[DeviceState] = field(default_factory=list)
    adapters: dict[str, VendorAdapter] = field(default_factory=dict)
    tool_errors: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for d in self.config.devices:
            self.states.append(DeviceState(d, _device_from_decl(self.config, d)))
            if (
                d.device_type in ("ascend", "cambricon", "hygon", "nvidia")
                and d.device_type not in self.adapters
            ):
                self.adapters[d.device_type] = adapter_for(d.device_type, env=self.env)

    def _sample_blocking(self) -> None:
        observed: dict[str, list[ObservedDevice]] = {}
        self.tool_errors = {}
        for dtype, adapter in self.adapters.items():
            try:
                observed[dtype] = adapter.discover()
            except ToolError as e:
                self.tool_errors[dtype] = str(e)
        now_ms = int(time.time() * 1000)
        for st in self.states:
            d, dev = st.decl, st.device
            if d.errors:
                dev.status, dev.status_reason = ERROR, "; ".join(str(p) for p in d.errors)
                continue
            if d.device_type in self.tool_errors:
                dev.status, dev.status_reason = ERROR, self.tool_errors[d.device_type]
                continue
            adapter = self.adapters[d.device_type]
            obs_list = observed.get(d.device_type, [])
            reasons = cross_check(
                d.device_type, adapter.tool, d.device_id, d.model, d.hbm_memory_mb, obs_list
            )
            if reasons:
                dev.status, dev.status_reason = ERROR, "; ".join(reasons)
                st.observed = None
                continue
            obs = next(o for o in obs_list if o.index == d.device_id)
            st.observed = obs
            dev.status, dev.status_reason = _health_status(obs)
            dev.telemetry.CopyFrom(
                types_pb2.DeviceTelemetry(
                    utilization_pct=obs.utilization_pct or 0.0,
                    memory_used_mb=obs.memory_used_mb or 0,
                    temperature_c=obs.temperature_c or 0.0,
                    power_w=obs.power_w or 0.0,
                    sampled_at_unix_ms=now_ms,
                    health=obs.health,
                )
            )

    async def sample(self) -> None:
        """Run the vendor tools (in a thread: they block) and update every device."""
        await asyncio.to_thread(self._sample_blocking)

    def devices(self) -> list[types_pb2.Device]:
        return [st.device for st in self.states]

    def samples(self) -> list[agent_pb2.DeviceSample]:
        return [
            agent_pb2.DeviceSample(
                name=st.device.name,
                telemetry=st.device.telemetry,
                status=st.device.status,
                status_reason=st.device.status_reason,
            )
            for st in self.states
        ]
