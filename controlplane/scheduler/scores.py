"""Scores of candidate devices and nodes (higher is better).

Candidates are compared on a key, most significant first:

1. busy: a set with a device above `min_gpu_utilization_threshold` loses to any set without one;
2. the rank of the device type in `preferred_device_types` (earlier types always win);
3. total pairwise topology distance of the set (multi-device instances);
4. the weighted score below;
5. node name and device positions, so that equal candidates resolve the same way every time.

score = NODE_WEIGHT * node_score(policy) + mean over devices of (UTIL_WEIGHT * utilization_score
+ TEMPERATURE_WEIGHT * temperature_score) + COMPUTE_WEIGHT * compute_score.
"""

from __future__ import annotations

from collections.abc import Sequence

from controlplane.scheduler.model import DeviceView

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


def node_score(free_devices: int, max_node_devices: int, policy: str) -> float:
    """spread: the free share of the largest node; binpack: the used share (0..1)."""
    share = free_devices / max_node_devices if max_node_devices else 0.0
    return share if policy == "spread" else 1.0 - share


def utilization_score(utilization_pct: float) -> float:
    """1 for an idle device, 0 for a saturated one."""
    return min(1.0, max(0.0, 1.0 - utilization_pct / 100.0))


def temperature_score(temperature_c: float, limit_c: float) -> float:
    """1 up to TEMPERATURE_DERATE_SPAN_C below the limit, falling linearly to 0 at the limit."""
    return min(1.0, max(0.0, (limit_c - temperature_c) / TEMPERATURE_DERATE_SPAN_C))


def device_score(utilization_pct: float, temperature_c: float, limit_c: float) -> float:
    """The part of the score that depends only on the device's own condition."""
    return UTIL_WEIGHT * utilization_score(utilization_pct) + TEMPERATURE_WEIGHT * temperature_score(
        temperature_c, limit_c
    )


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


def compute_score(device_tflops: float, best_tflops: float) -> float:
    """Weighted share of the fastest device's throughput for the same metric."""
    return COMPUTE_WEIGHT * (device_tflops / best_tflops) if best_tflops > 0 else 0.0


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
