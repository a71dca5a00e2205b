"""What a pending instance needs, reduced to the inputs of the filters and scores.

`requirement_key(workload)` picks the `WorkloadReq` fields listed in `RequirementInputs`, and
`Requirement.of(workload)` is computed from that key alone, so two workloads with equal keys have
equal requirements by construction (the planner shares its per-requirement state between them).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from operator import attrgetter
from types import MappingProxyType
from typing import NamedTuple

from controlplane.scheduler.model import DeviceView, WorkloadReq

INT8_QUANTIZATIONS = frozenset({"int8", "w8a8"})
"""Quantizations served by int8 kernels: a device supporting either name qualifies."""

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


class RequirementInputs(NamedTuple):
    """The `WorkloadReq` fields a `Requirement` is computed from (and nothing else)."""

    preferred_device_types: tuple[str, ...]
    pin: str | None
    quantization: str
    dtype: str
    memory_per_device_mb: int
    devices_per_instance: int
    require_p2p: bool
    engine: str


_INPUTS = attrgetter(*RequirementInputs._fields)


def requirement_key(workload: WorkloadReq) -> tuple[object, ...]:
    """A hashable key equal for workloads with the same `Requirement`: the values of the
    `RequirementInputs` fields, in order (a plain tuple: this runs once per decision)."""
    key: tuple[object, ...] = _INPUTS(workload)
    return key


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
    engine: str = "sglang"
    """The engine the instance runs (UnsupportedEngine where it cannot run on a device type)."""

    @staticmethod
    def of(workload: WorkloadReq) -> Requirement:
        """The requirement of `workload`."""
        return Requirement.from_inputs(RequirementInputs._make(requirement_key(workload)))

    @staticmethod
    def from_inputs(w: RequirementInputs) -> Requirement:
        """The requirement of a workload with these inputs."""
        ranks: dict[str, int] = {}
        for t in w.preferred_device_types:
            ranks.setdefault(t, len(ranks))
        quant = w.quantization
        if quant in INT8_QUANTIZATIONS:
            accepted, metric = INT8_QUANTIZATIONS, "int8"
        elif quant in ("", "none"):
            accepted = frozenset({w.dtype})
            metric = "bf16" if w.dtype == "bf16" else "fp16"
        else:
            accepted, metric = frozenset({quant}), "int8"
        return Requirement(
            type_rank=MappingProxyType(ranks) if ranks else None,
            pin=parse_pin(w.pin) if w.pin else None,
            needed_precision=w.dtype if quant in ("", "none") else quant,
            accepted_precisions=accepted,
            compute_metric=metric,
            memory_per_device_mb=w.memory_per_device_mb,
            devices=w.devices_per_instance,
            require_p2p=w.require_p2p and w.devices_per_instance > 1,
            engine=w.engine,
        )

    def type_ok(self, device_type: str) -> bool:
        """Whether the type passes the type filter."""
        return self.type_rank is None or device_type in self.type_rank

    def rank_of(self, device_type: str) -> int:
        """Preference rank of an allowed type (0 is the most preferred)."""
        return 0 if self.type_rank is None else self.type_rank[device_type]
