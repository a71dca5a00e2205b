"""The in-process device plugin of one vendor: declarations + the vendor's tool -> devices with status.

One `VendorPlugin` serves every declared device of one `device_type`. Each sample runs the vendor
tool through its adapter (`node_agent.vendors`; the tool blocks, so async callers run it in a
thread), cross-checks every declaration against what the tool reports and sets each device's status:

| condition                                              | status    | reason                              |
|--------------------------------------------------------|-----------|-------------------------------------|
| the declaration has problems                            | Error     | every problem, `FILE:LINE: ...`     |
| the tool is missing, fails, times out, prints garbage   | Error     | the tool, its command line, the fix |
| declared but not reported / other model / other memory | Error     | `cross_check`'s reasons             |
| the tool reports health Critical                        | Unhealthy | `<tool> reports health Critical`    |
| otherwise (health OK, Warning, Unknown)                 | Ready     | empty, or the Warning/Unknown note, |
|                                                         |           | and "memory unavailable, declared   |
|                                                         |           | size accepted unchecked" when the   |
|                                                         |           | tool prints memory as [N/A]         |

Reasons name the tool that actually ran (Hygon falls back to rocm-smi when hy-smi is missing). Each
is a message (`kunlun_common.messages`): the device carries its English text in `status_reason` and the
message in `status_reason_message` (`set_reason`), which kunlun-cli and kunlun-device-probe show in the
reader's language; replicas store both as they come.

Statuses move both ways: a chip that comes back, or whose health returns to OK, turns Ready again at
the next sample. Telemetry (utilization, memory used, temperature, power, health) is set on every
device the tool reports and cleared on the others. `list_and_watch` samples every
`health_interval_seconds` and yields a new list whenever a status, a reason or a telemetry value
changes; `refresh()` samples at once (the agent's sampling loop and `kunlun-device-probe` use it).
"""

from __future__ import annotations

import asyncio
import math
import shutil
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeAlias

import structlog
from google.protobuf import struct_pb2

from kunlun_common.api import types_pb2
from kunlun_common.clock import now_ms
from kunlun_common.messages import Message, msg, msg_list, of_error, to_stored
from node_agent.plugins.config import DeviceDecl, NodeConfig
from node_agent.plugins.contract import (
    AllocateResult,
    DevicePlugin,
    allocation_for,
    choose_devices,
    resolve_names,
    status_name,
    total_distance,
)
from node_agent.vendors import ADAPTERS, adapter_for
from node_agent.vendors.base import (
    HEALTH_CRITICAL,
    HEALTH_OK,
    ObservedDevice,
    ToolError,
    VendorAdapter,
    cross_check,
)

log = structlog.get_logger("device-plugin")

READY = types_pb2.DEVICE_STATUS_READY
UNHEALTHY = types_pb2.DEVICE_STATUS_UNHEALTHY
ERROR = types_pb2.DEVICE_STATUS_ERROR
StatusValue: TypeAlias = types_pb2.DeviceStatus.ValueType


def device_from_decl(config: NodeConfig, d: DeviceDecl, plugin: str) -> types_pb2.Device:
    """The Device of a declaration, before any sample (status unspecified)."""
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
        plugin=plugin,
    )


@dataclass(frozen=True)
class ToolSample:
    """One run of the vendor tool: what it reported, or why it could not."""

    command: list[str]
    executable: str | None  # where the tool was found on PATH (None: not found)
    observed: tuple[ObservedDevice, ...]
    error: ToolError | None
    raw_output: str
    duration_s: float
    sampled_at_ms: int

    @property
    def tool(self) -> str:
        """The tool that actually ran (Hygon: rocm-smi when hy-smi is not installed)."""
        return self.command[0]


@dataclass(frozen=True)
class Verdict:
    """The status of one declared device after a sample, and the tool's view of it (if any)."""

    status: StatusValue
    message: Message | None
    """Why (None: nothing to say)."""
    observed: ObservedDevice | None

    @property
    def reason(self) -> str:
        """The reason's English text ("" when there is none)."""
        return "" if self.message is None else str(self.message)


def _telemetry_key(t: types_pb2.DeviceTelemetry) -> tuple[float, int, float, float, str]:
    return (t.utilization_pct, t.memory_used_mb, t.temperature_c, t.power_w, t.health)


class VendorPlugin(DevicePlugin):
    """In-process plugin of one vendor on one node (see the module docstring)."""

    def __init__(
        self,
        config: NodeConfig,
        device_type: str,
        env: Mapping[str, str] | None = None,
        *,
        name: str | None = None,
        adapter: VendorAdapter | None = None,
    ) -> None:
        self.config = config
        self.device_type = device_type
        self.name = name or device_type
        self.adapter = adapter or adapter_for(device_type, env=env)
        self.interval_s = config.health_interval_seconds
        self.decls = [d for d in config.devices if d.device_type == device_type]
        if not self.decls:
            raise ValueError(f"{config.path}: no {device_type} device is declared on node {config.node_name}")
        self.positions = {config.device_name(d): i for i, d in enumerate(config.devices)}
        self._devices = {config.device_name(d): device_from_decl(config, d, self.name) for d in self.decls}
        self.last_sample: ToolSample | None = None
        self.verdicts: dict[str, Verdict] = {}
        self._lock = asyncio.Lock()
        self._version = 0
        self._sampled_at = -math.inf

    # -------------------------------------------------------------------------------------- sampling

    @property
    def tool(self) -> str:
        """The tool of the last sample (the one that actually ran), else the vendor's main tool."""
        return self.last_sample.tool if self.last_sample is not None else self.adapter.tool

    @property
    def tool_error(self) -> str | None:
        """Why the last sample could not use the tool (None when it could, or before any sample)."""
        m = self.tool_error_message
        return None if m is None else str(m)

    @property
    def tool_error_message(self) -> Message | None:
        """`tool_error` as a message (for the reader's language)."""
        sample = self.last_sample
        return of_error(sample.error) if sample is not None and sample.error is not None else None

    def poll(self) -> ToolSample:
        """Run the vendor tool once (blocking) and return what it gave; never raises ToolError."""
        command = self.adapter.command()
        executable = shutil.which(command[0], path=self.adapter.env.get("PATH", ""))
        started = time.monotonic()
        observed: tuple[ObservedDevice, ...] = ()
        error: ToolError | None = None
        try:
            observed = tuple(self.adapter.discover())
        except ToolError as e:
            error = e
        raw = self.adapter.last_output() if error is None else _error_output(error)
        return ToolSample(
            command=command,
            executable=executable,
            observed=observed,
            error=error,
            raw_output=raw,
            duration_s=time.monotonic() - started,
            sampled_at_ms=now_ms(),
        )

    def verdict(self, d: DeviceDecl, sample: ToolSample) -> Verdict:
        """The status of declaration `d` given `sample` (the table of the module docstring)."""
        if d.errors:
            return Verdict(ERROR, joined([p.message() for p in d.errors]), None)
        if sample.error is not None:
            return Verdict(ERROR, of_error(sample.error), None)
        tool = sample.tool
        reasons = cross_check(
            d.device_type, tool, d.device_id, d.model, d.hbm_memory_mb, list(sample.observed)
        )
        if reasons:
            return Verdict(ERROR, joined(reasons), None)
        obs = next(o for o in sample.observed if o.index == d.device_id)
        if obs.health == HEALTH_CRITICAL:
            return Verdict(UNHEALTHY, health_note(tool, HEALTH_CRITICAL), obs)
        notes = [] if obs.health == HEALTH_OK else [health_note(tool, obs.health)]
        if obs.memory_total_mb is None:
            notes.append(memory_unchecked(tool, d.hbm_memory_mb))
        return Verdict(READY, joined(notes), obs)

    def apply(self, sample: ToolSample) -> bool:
        """Update every device from `sample`; True when a status, reason or telemetry value changed."""
        self.last_sample = sample
        changed = False
        for d in self.decls:
            name = self.config.device_name(d)
            dev = self._devices[name]
            v = self.verdict(d, sample)
            self.verdicts[name] = v
            before = (dev.status, dev.status_reason, _telemetry_key(dev.telemetry))
            if (dev.status, dev.status_reason) != (v.status, v.reason):
                log.info(
                    "device status changed",
                    device=name,
                    plugin=self.name,
                    status=status_name(v.status),
                    was=status_name(dev.status),
                    reason=v.reason,
                )
            dev.status = v.status
            set_reason(dev, v.message)
            if v.observed is None:
                dev.ClearField("telemetry")
            else:
                o = v.observed
                dev.telemetry.CopyFrom(
                    types_pb2.DeviceTelemetry(
                        utilization_pct=o.utilization_pct or 0.0,
                        memory_used_mb=o.memory_used_mb or 0,
                        temperature_c=o.temperature_c or 0.0,
                        power_w=o.power_w or 0.0,
                        sampled_at_unix_ms=sample.sampled_at_ms,
                        health=o.health,
                    )
                )
            changed |= before != (dev.status, dev.status_reason, _telemetry_key(dev.telemetry))
        if changed:
            self._version += 1
        return changed

    async def refresh(self) -> bool:
        """Sample now (the tool runs in a thread); True when something changed."""
        async with self._lock:
            started = time.monotonic()
            sample = await asyncio.to_thread(self.poll)
            self._sampled_at = started  # the cadence counts from the start of each run
            return self.apply(sample)

    async def _refresh_if_due(self) -> None:
        async with self._lock:
            if time.monotonic() - self._sampled_at < self.interval_s:
                return  # another watcher sampled meanwhile
            started = time.monotonic()
            sample = await asyncio.to_thread(self.poll)
            self._sampled_at = started
            self.apply(sample)

    # -------------------------------------------------------------------------------------- contract

    def devices(self) -> list[types_pb2.Device]:
        """Copies of the devices, in declaration order."""
        out = []
        for dev in self._devices.values():
            copy = types_pb2.Device()
            copy.CopyFrom(dev)
            out.append(copy)
        return out

    async def list_and_watch(self) -> AsyncIterator[list[types_pb2.Device]]:
        seen = -1
        while True:
            await self._refresh_if_due()
            if self._version != seen:
                seen = self._version
                yield self.devices()
            wait = self.interval_s - (time.monotonic() - self._sampled_at)
            await asyncio.sleep(max(wait, 0.01))

    async def preferred_allocation(
        self, available: Sequence[str], must_include: Sequence[str], size: int, require_p2p: bool
    ) -> list[str]:
        return choose_devices(
            self.name, self._devices, self.positions, available, must_include, size, require_p2p
        )

    def total_distance(self, names: Sequence[str]) -> int:
        """Sum of pairwise topology distances between `names` (devices of this plugin)."""
        resolve_names(self.name, self._devices, names)
        return total_distance(self._devices, self.positions, names)

    async def allocate(self, devices: Sequence[str]) -> AllocateResult:
        chosen = resolve_names(self.name, self._devices, devices)
        node_ids = {  # where the tool says a device's node has another id (Ascend: its physical id)
            v.observed.index: v.observed.node_id
            for v in self.verdicts.values()
            if v.observed is not None and v.observed.node_id is not None
        }
        return allocation_for(self.device_type, [d.index for d in chosen], node_ids)


def memory_unchecked(tool: str, declared_mb: int) -> Message:
    """The note of a device whose tool prints its memory as unavailable ([N/A]: NVIDIA GB10 and other
    unified-memory parts): the declaration cannot be checked, so say that it was accepted as declared."""
    return msg(
        "device.memory_unchecked",
        "{tool} reports memory as unavailable; the declared {declared_mb} MB is accepted unchecked",
        tool=tool,
        declared_mb=declared_mb,
    )


def health_note(tool: str, health: str) -> Message:
    """The note of a device whose tool reports a health other than OK (the value as the tool says it)."""
    return msg("device.health", "{tool} reports health {health}", tool=tool, health=health)


def joined(reasons: Sequence[Message]) -> Message | None:
    """Several reasons as one, `; ` between them, each translated on its own (None: no reason)."""
    if not reasons:
        return None
    if len(reasons) == 1:
        return reasons[0]
    return msg_list("device.reasons", "{parts}", reasons, bullet="", sep="; ")


def set_reason(dev: types_pb2.Device, reason: Message | None) -> None:
    """Give `dev` its reason: the English text in `status_reason`, the message beside it in
    `status_reason_message` (both empty when there is none)."""
    dev.status_reason = "" if reason is None else str(reason)
    dev.status_reason_message = "" if reason is None else to_stored(reason)


def _error_output(error: ToolError) -> str:
    stdout = getattr(error, "stdout", "")
    stderr = getattr(error, "stderr", "")
    parts = [p for p in (stdout, f"(stderr)\n{stderr}" if stderr else "") if p]
    return "\n".join(parts)


def plugins_for(config: NodeConfig, env: Mapping[str, str]) -> dict[str, VendorPlugin]:
    """One in-process plugin per vendor declared on the node, in declaration order (declarations of an
    unknown type get none: they are in Error already)."""
    out: dict[str, VendorPlugin] = {}
    for d in config.devices:
        if d.device_type not in out and d.device_type in ADAPTERS:
            out[d.device_type] = VendorPlugin(config, d.device_type, env)
    return out
