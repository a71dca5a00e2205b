"""Scores of candidate devices and nodes (higher is better).

Candidates are compared on a key, most significant first:

1. busy: a set with a device above `min_gpu_utilization_threshold` loses to any set without one;
2. the rank of the device type in `preferred_device_types` (earlier types always win);
3. total pairwise topology distance of the set (multi-device instances);
4. the weighted score below;
5. node name and device positions, so that equal candidates resolve the same way every time.

The weighted score is the sum of the lines of `SCORES` (the rank stack), each weight * a 0..1 share:

    score = sum of NODE scores + mean over the set's devices of (DEVICE scores + PROFILE scores)

- `node` scores: `fn(free_devices, max_node_devices, config)`, recomputed as the plan takes devices;
- `device` scores: `fn(device, config)`, the device's own condition, once per snapshot;
- `profile` scores: `fn(device, req, best_tflops)`, the device's capabilities for one requirement,
  once per profile of identical devices.

Today: NODE_WEIGHT * spread_or_binpack + mean(UTIL_WEIGHT * idle_share + TEMPERATURE_WEIGHT
* coolness + COMPUTE_WEIGHT * throughput_share). A new score: its function, one line in
`SCORES`, its test. The score functions run for every device of every snapshot: keep them to
arithmetic (comparisons rather than min()/max() calls).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from controlplane.scheduler.config import SchedulerConfig
from controlplane.scheduler.model import DeviceView
from controlplane.scheduler.requirement import Requirement

NODE_WEIGHT = 2.0
"""Weight of the spread/binpack node score."""
UTIL_WEIGHT = 1.0
"""Weight of the idle share of a device."""
TEMPERATURE_WEIGHT = 0.5
"""Weight of the temperature derating."""
COMPUTE_WEIGHT = 0.5
"""Weight of the device's throughput for the workload's precision, relative to the fastest device."""
TEMPERATURE_DERATE_SPAN_C = 30.0
"""A device loses temperature score linearly over this many degrees below the limit."""
UNKNOWN_DISTANCE = 1000
"""Distance assumed between devices when a topology row is too short."""


def is_busy(utilization_pct: float, threshold_pct: float) -> bool:
    """Busy devices are used only when nothing else fits."""
    return utilization_pct > threshold_pct


def tflops(device: DeviceView, metric: str) -> float:
    """Throughput of `device` for a compute metric (fp16, bf16 or int8)."""
    if metric == "int8":
        return device.int8_tflops
    if metric == "bf16":
        return device.bf16_tflops
    return device.fp16_tflops


def distance(rows: Sequence[Sequence[int]], a: int, b: int) -> int:
    """Topology distance from the device at position a to the one at b (UNKNOWN_DISTANCE if absent)."""
    row = rows[a]
    return row[b] if b < len(row) else UNKNOWN_DISTANCE


def set_distance(rows: Sequence[Sequence[int]], positions: Sequence[int]) -> int:
    """Sum of pairwise topology distances between the devices at `positions` of one node.

    `rows[p]` is the topology row of the device at position p; a missing entry counts as
    UNKNOWN_DISTANCE.
    """
    total = 0
    for i, a in enumerate(positions):
        row = rows[a]
        for b in positions[i + 1 :]:
            total += row[b] if b < len(row) else UNKNOWN_DISTANCE
    return total


# ------------------------------------------------------------------ the table
class ScoreScope(Enum):
    NODE = "node"
    DEVICE = "device"
    PROFILE = "profile"


@dataclass(frozen=True)
class Score:
    """One line of the rank stack."""

    name: str
    """Short name (docs, logs)."""
    scope: ScoreScope
    """node, device or profile (see the module docstring)."""
    weight: float
    """Multiplies the function's 0..1 share."""
    fn: Callable[..., float]
    """The share; its arguments depend on the scope."""


def spread_or_binpack(free_devices: int, max_node_devices: int, config: SchedulerConfig) -> float:
    """spread: the free share of the largest node; binpack: the used share (0..1)."""
    share = free_devices / max_node_devices if max_node_devices else 0.0
    return share if config.policy == "spread" else 1.0 - share


def idle_share(device: DeviceView, config: SchedulerConfig) -> float:
    """1 for an idle device, 0 for a saturated one."""
    share = 1.0 - device.utilization_pct / 100.0
    share = share if share > 0.0 else 0.0  # min(1.0, max(0.0, share)), NaN giving 0.0, without the calls
    return share if share < 1.0 else 1.0


def coolness(device: DeviceView, config: SchedulerConfig) -> float:
    """1 up to TEMPERATURE_DERATE_SPAN_C below the limit, falling linearly to 0 at the limit."""
    share = (config.temperature_limit_c - device.temperature_c) / TEMPERATURE_DERATE_SPAN_C
    share = share if share > 0.0 else 0.0  # as in idle_share
    return share if share < 1.0 else 1.0


def throughput_share(device: DeviceView, req: Requirement, best_tflops: Mapping[str, float]) -> float:
    best = best_tflops[req.compute_metric]
    return tflops(device, req.compute_metric) / best if best > 0 else 0.0


SCORES: tuple[Score, ...] = (
    Score("spread-binpack", ScoreScope.NODE, NODE_WEIGHT, spread_or_binpack),
    Score("utilization", ScoreScope.DEVICE, UTIL_WEIGHT, idle_share),
    Score("temperature", ScoreScope.DEVICE, TEMPERATURE_WEIGHT, coolness),
    Score("compute", ScoreScope.PROFILE, COMPUTE_WEIGHT, throughput_share),
)
"""The rank stack: every weighted score, by scope."""

_NODE = tuple((s.weight, s.fn) for s in SCORES if s.scope is ScoreScope.NODE)
_DEVICE = tuple((s.weight, s.fn) for s in SCORES if s.scope is ScoreScope.DEVICE)
_PROFILE = tuple((s.weight, s.fn) for s in SCORES if s.scope is ScoreScope.PROFILE)


# (loops, not sum() over generators: node_part runs on every take)
def node_part(free_devices: int, max_node_devices: int, config: SchedulerConfig) -> float:
    """The node scores of a node with `free_devices` free."""
    total = 0.0
    for w, fn in _NODE:
        total += w * fn(free_devices, max_node_devices, config)
    return total


def device_parts(devices: Sequence[DeviceView], config: SchedulerConfig) -> list[float]:
    """The device scores of each of `devices` (their own condition), summed in table order.

    One call per node (the index), line by line over the devices, so that each device costs only
    the score functions themselves (about 1 us per device less than a call per device)."""
    totals = [0.0] * len(devices)
    for w, fn in _DEVICE:
        for i, device in enumerate(devices):
            totals[i] += w * fn(device, config)
    return totals


def device_part(device: DeviceView, config: SchedulerConfig) -> float:
    """The device scores of one device (its own condition)."""
    return device_parts((device,), config)[0]


def profile_part(device: DeviceView, req: Requirement, best_tflops: Mapping[str, float]) -> float:
    """The profile scores of a device (as a sample of its profile) for `req`."""
    total = 0.0
    for w, fn in _PROFILE:
        total += w * fn(device, req, best_tflops)
    return total
