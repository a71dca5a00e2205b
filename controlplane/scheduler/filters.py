"""Filters: whether a node or a device may take an instance, and if not, why — as one ordered table.

`FILTERS` is the feasibility stack (after Nomad's): every entry is a `Filter` (name, scope, check,
reason). Both the index (`index.py`, once per snapshot) and the planner (`plan.py`, once per
requirement) iterate it; nothing else encodes the chain. A check returns None when the candidate
passes, else the reason shown by the CLI (the exact strings below are asserted by tests).

Scopes, in the order they run:

- `node`: `check(node, config)`; a failing node takes nothing (NodeNotReady, NodeCordoned).
- `device`: one device at a time, in table order; the first failing filter is the device's stage,
  and a node reports the reason of its device group that got furthest (among equals, the one with
  the largest `rank`). A device filter depends on one of:
  - `Depends.PROFILE` — the device's capabilities (type, model, memory, precisions, throughput)
    and the requirement: `check(device, req)`, run once per profile of identical devices;
  - `Depends.DEVICE` — which device it is, and the requirement: `check(device, req)` per device;
  - `Depends.CONDITION` — the device's condition now and the config, not the requirement:
    `check(device, config)`, run once per device per snapshot.
- `group`: a device condition that matters only for a set of devices (`check(device, req)`); its
  reason is reported when a node has enough devices passing the device filters but too few of
  them pass it. Freeness is checked last, by the planner (NoFreeDevice).

A new filter: write its check, add one line to `FILTERS` at the stage it belongs, add its test.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

from controlplane.scheduler.config import SchedulerConfig
from controlplane.scheduler.model import DeviceView, NodeView
from controlplane.scheduler.requirement import (
    INT8_QUANTIZATIONS,
    Pin,
    Requirement,
    RequirementInputs,
    parse_pin,
    requirement_key,
)
from kunlun_common.names import sglang_refusal
from kunlun_common.states import DeviceState

__all__ = [
    "CARD_TYPE_MISMATCH",
    "CONDITIONS",
    "DEVICE_FILTERS",
    "DEVICE_NOT_READY",
    "FILTERS",
    "GROUP_FILTERS",
    "INT8_QUANTIZATIONS",
    "NODE_CORDONED",
    "NODE_FILTERS",
    "NODE_NOT_READY",
    "NO_FREE_DEVICE",
    "NO_P2P_GROUP",
    "PIN_MISMATCH",
    "Depends",
    "Filter",
    "Pin",
    "Requirement",
    "RequirementInputs",
    "Scope",
    "condition_failures",
    "filter_node",
    "parse_pin",
    "requirement_key",
]

NO_FREE_DEVICE = "NoFreeDevice"
CARD_TYPE_MISMATCH = "CardTypeMismatch"
PIN_MISMATCH = "PinMismatch"
DEVICE_NOT_READY = "DeviceNotReady"
NODE_NOT_READY = "NodeNotReady"
NODE_CORDONED = "NodeCordoned"
NO_P2P_GROUP = "NoP2PGroup"
UNSUPPORTED_DTYPE = "UnsupportedDtype"
UNSUPPORTED_ENGINE = "UnsupportedEngine"
INSUFFICIENT_MEMORY = "InsufficientMemory"
TOO_HOT = "TooHot"
INSUFFICIENT_DEVICES = "InsufficientDevices"


def _num(value: float) -> str:
    return f"{value:g}"


def unsupported_dtype(needed: str, supported: tuple[str, ...]) -> str:
    """`UnsupportedDtype (int8 not in [fp16])`."""
    return f"{UNSUPPORTED_DTYPE} ({needed} not in [{', '.join(supported)}])"


def insufficient_memory(needed_mb: int, free_mb: int) -> str:
    """`InsufficientMemory (needs 40000 MB, 32768 free)`; `free_mb` is the best device's HBM."""
    return f"{INSUFFICIENT_MEMORY} (needs {needed_mb} MB, {free_mb} free)"


def too_hot(temperature_c: float, limit_c: float) -> str:
    """`TooHot (91 C > 85 C)`; `>=` when the device sits exactly at the limit."""
    op = ">" if temperature_c > limit_c else ">="
    return f"{TOO_HOT} ({_num(temperature_c)} C {op} {_num(limit_c)} C)"


def insufficient_devices(needed: int, on_node: int) -> str:
    """`InsufficientDevices (needs 5, 4 on node)`: `on_node` usable devices of the best single type."""
    return f"{INSUFFICIENT_DEVICES} (needs {needed}, {on_node} on node)"


# ------------------------------------------------------------------ the checks
def node_ready(node: NodeView, config: SchedulerConfig) -> str | None:
    """NodeNotReady while the node's agent is not connected."""
    return None if node.ready else NODE_NOT_READY


def node_cordoned(node: NodeView, config: SchedulerConfig) -> str | None:
    """NodeCordoned while an operator keeps new work off the node."""
    return NODE_CORDONED if node.cordoned else None


def device_type(device: DeviceView, req: Requirement) -> str | None:
    """CardTypeMismatch when preferred types are given and the type is not one of them."""
    return None if req.type_ok(device.device_type) else CARD_TYPE_MISMATCH


def engine(device: DeviceView, req: Requirement) -> str | None:
    """UnsupportedEngine when the workload's engine cannot run on the device's type (SGLang on a
    vendor it has no backend for): the agent would refuse the launch, so never place it there."""
    why = sglang_refusal(device.device_type) if req.engine == "sglang" else ""
    return f"{UNSUPPORTED_ENGINE} (sglang on {device.device_type}: {why})" if why else None


def pinned(device: DeviceView, req: Requirement) -> str | None:
    """PinMismatch when the workload is pinned elsewhere."""
    return None if req.pin is None or req.pin.matches(device) else PIN_MISMATCH


def precision(device: DeviceView, req: Requirement) -> str | None:
    """UnsupportedDtype when the device lacks the workload's precision."""
    if req.accepted_precisions.isdisjoint(device.supported_dtypes):
        return unsupported_dtype(req.needed_precision, device.supported_dtypes)
    return None


def memory(device: DeviceView, req: Requirement) -> str | None:
    """InsufficientMemory when the device's HBM is below the need."""
    if device.hbm_memory_mb < req.memory_per_device_mb:
        return insufficient_memory(req.memory_per_device_mb, device.hbm_memory_mb)
    return None


_READY = DeviceState.READY
"""Looked up once: `DeviceState.READY` is a descriptor call on the enum class (0.1-0.2 us on 3.11),
and `device_ready` runs for every device of every snapshot."""


def device_ready(device: DeviceView, config: SchedulerConfig) -> str | None:
    """DeviceNotReady unless the device's status is Ready."""
    return None if device.status == _READY else DEVICE_NOT_READY


def temperature(device: DeviceView, config: SchedulerConfig) -> str | None:
    """TooHot at or above the temperature limit."""
    limit = config.temperature_limit_c
    return too_hot(device.temperature_c, limit) if device.temperature_c >= limit else None


def p2p(device: DeviceView, req: Requirement) -> str | None:
    """NoP2PGroup: a multi-device instance that requires p2p cannot use a device without it."""
    return NO_P2P_GROUP if req.require_p2p and not device.p2p_enabled else None


# ------------------------------------------------------------------ the table
class Scope(Enum):
    NODE = "node"
    DEVICE = "device"
    GROUP = "group"


class Depends(Enum):
    """What a device filter's verdict depends on (so it can be computed once per that)."""

    PROFILE = "profile"
    DEVICE = "device"
    CONDITION = "condition"


def _always(req: Requirement) -> bool:
    return True


@dataclass(frozen=True)
class Filter:
    """One line of the feasibility stack."""

    name: str
    """Short name (docs, logs)."""
    scope: Scope
    """node, device or group (see the module docstring)."""
    check: Callable[..., str | None]
    """The check; its arguments depend on the scope (see the module docstring)."""
    reason: str
    """The reason code its failures start with, e.g. "InsufficientMemory"."""
    depends: Depends | None = None
    """For device filters: what the verdict depends on."""
    rank: Callable[[DeviceView], float] | None = None
    """Among devices failing here, the reason of the one ranked highest is quoted (e.g. the
    largest memory, the coolest device); None: any."""
    applies: Callable[[Requirement], bool] = _always
    """Whether the filter can reject anything for this requirement (lets the planner use its
    per-profile fast path when no per-device or group filter applies)."""


def node_filter(name: str, check: Callable[[NodeView, SchedulerConfig], str | None], reason: str) -> Filter:
    return Filter(name, Scope.NODE, check, reason)


def profile_filter(
    name: str,
    check: Callable[[DeviceView, Requirement], str | None],
    reason: str,
    rank: Callable[[DeviceView], float] | None = None,
) -> Filter:
    return Filter(name, Scope.DEVICE, check, reason, Depends.PROFILE, rank)


def identity_filter(
    name: str,
    check: Callable[[DeviceView, Requirement], str | None],
    reason: str,
    applies: Callable[[Requirement], bool],
) -> Filter:
    return Filter(name, Scope.DEVICE, check, reason, Depends.DEVICE, applies=applies)


def condition_filter(
    name: str,
    check: Callable[[DeviceView, SchedulerConfig], str | None],
    reason: str,
    rank: Callable[[DeviceView], float] | None = None,
) -> Filter:
    return Filter(name, Scope.DEVICE, check, reason, Depends.CONDITION, rank)


def group_filter(
    name: str,
    check: Callable[[DeviceView, Requirement], str | None],
    reason: str,
    applies: Callable[[Requirement], bool],
) -> Filter:
    return Filter(name, Scope.GROUP, check, reason, applies=applies)


def _hbm(d: DeviceView) -> float:
    return float(d.hbm_memory_mb)


def _coolness(d: DeviceView) -> float:
    return -d.temperature_c


def _has_pin(req: Requirement) -> bool:
    return req.pin is not None


def _needs_p2p(req: Requirement) -> bool:
    return req.require_p2p


FILTERS: tuple[Filter, ...] = (
    node_filter("node-ready", node_ready, NODE_NOT_READY),
    node_filter("node-cordoned", node_cordoned, NODE_CORDONED),
    profile_filter("device-type", device_type, CARD_TYPE_MISMATCH),
    profile_filter("engine", engine, UNSUPPORTED_ENGINE),
    identity_filter("pin", pinned, PIN_MISMATCH, applies=_has_pin),
    profile_filter("precision", precision, UNSUPPORTED_DTYPE),
    profile_filter("memory", memory, INSUFFICIENT_MEMORY, rank=_hbm),
    condition_filter("device-ready", device_ready, DEVICE_NOT_READY),
    condition_filter("temperature", temperature, TOO_HOT, rank=_coolness),
    group_filter("p2p", p2p, NO_P2P_GROUP, applies=_needs_p2p),
)
"""The feasibility stack, in order."""

NODE_FILTERS = tuple(f for f in FILTERS if f.scope is Scope.NODE)
DEVICE_FILTERS = tuple(f for f in FILTERS if f.scope is Scope.DEVICE)
"""Device filters in order; a device's stage is the position of its first failing one here."""
GROUP_FILTERS = tuple(f for f in FILTERS if f.scope is Scope.GROUP)
CONDITIONS = tuple((pos, f.check) for pos, f in enumerate(DEVICE_FILTERS) if f.depends is Depends.CONDITION)
"""(stage, check) of the condition filters, in order."""


def condition_failures(devices: Sequence[DeviceView], config: SchedulerConfig) -> list[int | None]:
    """Per device, the stage of its first failing condition filter, else None.

    One call per node (the index), filter by filter over the devices still passing, so that each
    device costs only the checks themselves; a device is not checked past its first failure."""
    failed: list[int | None] = [None] * len(devices)
    for stage, check in CONDITIONS:
        for i, device in enumerate(devices):
            if failed[i] is None and check(device, config) is not None:
                failed[i] = stage
    return failed


def filter_node(node: NodeView, config: SchedulerConfig) -> str | None:
    """The reason of the first failing node filter, else None."""
    for f in NODE_FILTERS:
        reason: str | None = f.check(node, config)
        if reason is not None:
            return reason
    return None
