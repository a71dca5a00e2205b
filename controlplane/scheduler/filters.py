"""Filters: whether a node or a device may take an instance, and if not, why.

Each filter returns None when the candidate passes, else a reason (the exact strings below are shown
by the CLI and asserted by tests). Device filters run in `DEVICE_FILTER_STAGES` order: capability
first (type, pin, precision, memory), then condition (status, temperature); freeness is checked last,
by the caller. A node reports the reason of the device that got furthest through that chain.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from controlplane.scheduler.model import DeviceView, NodeView, WorkloadReq
from kunlun_common.states import DeviceState

NO_FREE_DEVICE = "NoFreeDevice"
CARD_TYPE_MISMATCH = "CardTypeMismatch"
PIN_MISMATCH = "PinMismatch"
DEVICE_NOT_READY = "DeviceNotReady"
NODE_NOT_READY = "NodeNotReady"
NODE_CORDONED = "NodeCordoned"
NO_P2P_GROUP = "NoP2PGroup"

# Stages of the device filter chain; a larger stage got further.
STAGE_TYPE = 0
STAGE_PIN = 1
STAGE_DTYPE = 2
STAGE_MEMORY = 3
STAGE_STATUS = 4
STAGE_TEMPERATURE = 5
STAGE_PASSED = 6
DEVICE_FILTER_STAGES = ("type", "pin", "dtype", "memory", "status", "temperature")

INT8_QUANTIZATIONS = frozenset({"int8", "w8a8"})
"""Quantizations served by int8 kernels: a device supporting either name qualifies."""


def _num(value: float) -> str:
    return f"{value:g}"


def unsupported_dtype(needed: str, supported: tuple[str, ...]) -> str:
    """`UnsupportedDtype (int8 not in [fp16])`."""
    return f"UnsupportedDtype ({needed} not in [{', '.join(supported)}])"


def insufficient_memory(needed_mb: int, free_mb: int) -> str:
    """`InsufficientMemory (needs 40000 MB, 32768 free)`; `free_mb` is the best device's HBM."""
    return f"InsufficientMemory (needs {needed_mb} MB, {free_mb} free)"


def too_hot(temperature_c: float, limit_c: float) -> str:
    """`TooHot (91 C > 85 C)`; `>=` when the device sits exactly at the limit."""
    op = ">" if temperature_c > limit_c else ">="
    return f"TooHot ({_num(temperature_c)} C {op} {_num(limit_c)} C)"


def insufficient_devices(needed: int, on_node: int) -> str:
    """`InsufficientDevices (needs 5, 4 on node)`: `on_node` usable devices of the best single type."""
    return f"InsufficientDevices (needs {needed}, {on_node} on node)"


_PIN_RE = re.compile(r"^(?:(?P<node>[a-z0-9][a-z0-9-]*)/)?(?P<type>[a-z]+)(?::(?P<index>\d+))?$")


@dataclass(frozen=True)
class Pin:
    """A parsed `WorkloadReq.pin`; None fields match anything."""

    device_type: str
    """Type the device must have."""
    node: str | None = None
    """Node the device must be on."""
    index: int | None = None
    """Index the device must have."""
    valid: bool = True
    """False for a pin that could not be parsed: it matches no device."""

    def matches(self, device: DeviceView) -> bool:
        """Whether `device` satisfies the pin."""
        return (
            self.valid
            and device.device_type == self.device_type
            and (self.node is None or device.node == self.node)
            and (self.index is None or device.index == self.index)
        )


def parse_pin(text: str) -> Pin:
    """Parse `ascend`, `ascend:0`, `node-a/ascend` or `node-a/ascend:0`; junk gives an invalid pin."""
    m = _PIN_RE.match(text)
    if not m:
        return Pin(device_type="", valid=False)
    index = m["index"]
    return Pin(device_type=m["type"], node=m["node"], index=None if index is None else int(index))


@dataclass(frozen=True)
class Requirement:
    """The parts of a `WorkloadReq` that decide where it may run; equal for identical instances."""

    type_rank: Mapping[str, int] | None
    """Preferred device type -> rank (0 is best); None allows every type at rank 0. The pin is a
    separate filter (PinMismatch), not folded in here."""
    pin: Pin | None
    """Parsed pin, or None."""
    needed_precision: str
    """The name shown in UnsupportedDtype, e.g. int8, fp8 or bf16."""
    accepted_precisions: frozenset[str]
    """A device qualifies when it supports any of these."""
    compute_metric: str
    """Which throughput counts for this workload: fp16, bf16 or int8."""
    memory_per_device_mb: int
    """HBM needed on each device."""
    devices: int
    """Devices per instance."""
    require_p2p: bool
    """Every device must have p2p enabled (only meaningful for more than one device)."""

    @staticmethod
    def of(workload: WorkloadReq) -> Requirement:
        """The requirement of `workload`."""
        ranks: dict[str, int] = {}
        for t in workload.preferred_device_types:
            ranks.setdefault(t, len(ranks))
        quant = workload.quantization
        if quant in INT8_QUANTIZATIONS:
            accepted, metric = INT8_QUANTIZATIONS, "int8"
        elif quant in ("", "none"):
            accepted = frozenset({workload.dtype})
            metric = "bf16" if workload.dtype == "bf16" else "fp16"
        else:
            accepted, metric = frozenset({quant}), "int8"
        return Requirement(
            type_rank=MappingProxyType(ranks) if ranks else None,
            pin=parse_pin(workload.pin) if workload.pin else None,
            needed_precision=workload.dtype if quant in ("", "none") else quant,
            accepted_precisions=accepted,
            compute_metric=metric,
            memory_per_device_mb=workload.memory_per_device_mb,
            devices=workload.devices_per_instance,
            require_p2p=workload.require_p2p and workload.devices_per_instance > 1,
        )

    def type_ok(self, device_type: str) -> bool:
        """Whether the type passes the type filter."""
        return self.type_rank is None or device_type in self.type_rank

    def rank_of(self, device_type: str) -> int:
        """Preference rank of an allowed type (0 is the most preferred)."""
        return 0 if self.type_rank is None else self.type_rank[device_type]


def requirement_key(workload: WorkloadReq) -> tuple[object, ...]:
    """A hashable key equal for workloads with the same `Requirement`."""
    return (
        workload.preferred_device_types,
        workload.pin,
        workload.quantization,
        workload.dtype,
        workload.memory_per_device_mb,
        workload.devices_per_instance,
        workload.require_p2p,
    )


def filter_node(node: NodeView) -> str | None:
    """NodeNotReady or NodeCordoned, else None."""
    if not node.ready:
        return NODE_NOT_READY
    if node.cordoned:
        return NODE_CORDONED
    return None


def filter_type(device_type: str, req: Requirement) -> str | None:
    """CardTypeMismatch when preferred types are given and the type is not one of them."""
    return None if req.type_ok(device_type) else CARD_TYPE_MISMATCH


def filter_pin(device: DeviceView, req: Requirement) -> str | None:
    """PinMismatch when the workload is pinned elsewhere."""
    return None if req.pin is None or req.pin.matches(device) else PIN_MISMATCH


def filter_dtype(supported: tuple[str, ...], req: Requirement) -> str | None:
    """UnsupportedDtype when the device lacks the workload's precision."""
    if req.accepted_precisions.isdisjoint(supported):
        return unsupported_dtype(req.needed_precision, supported)
    return None


def filter_memory(hbm_memory_mb: int, req: Requirement) -> str | None:
    """InsufficientMemory when the device's HBM is below the need."""
    if hbm_memory_mb < req.memory_per_device_mb:
        return insufficient_memory(req.memory_per_device_mb, hbm_memory_mb)
    return None


def filter_status(status: str) -> str | None:
    """DeviceNotReady unless the status is Ready."""
    return None if status == DeviceState.READY else DEVICE_NOT_READY


def filter_temperature(temperature_c: float, limit_c: float) -> str | None:
    """TooHot at or above the limit."""
    return too_hot(temperature_c, limit_c) if temperature_c >= limit_c else None


def device_stage(device: DeviceView, req: Requirement, limit_c: float) -> tuple[int, str | None]:
    """Run the device chain (freeness excluded): (stage reached, reason or None when it passed)."""
    reason = filter_type(device.device_type, req)
    if reason is not None:
        return STAGE_TYPE, reason
    for stage, reason in (
        (STAGE_PIN, filter_pin(device, req)),
        (STAGE_DTYPE, filter_dtype(device.supported_dtypes, req)),
        (STAGE_MEMORY, filter_memory(device.hbm_memory_mb, req)),
        (STAGE_STATUS, filter_status(device.status)),
        (STAGE_TEMPERATURE, filter_temperature(device.temperature_c, limit_c)),
    ):
        if reason is not None:
            return stage, reason
    return STAGE_PASSED, None
