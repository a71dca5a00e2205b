"""`telemetry metrics --filter`: the grammar, every operator, and refusals that name the fix."""

from __future__ import annotations

import pytest

from controlplane.metrics import reason_class, spread
from controlplane.telemetry import FilterError, matches, parse_filter
from kunlun_common.api import telemetry_pb2

GIB = 2**30
DEVICES = [
    telemetry_pb2.DeviceMetric(
        node="node-a",
        device="node-a/ascend:0",
        device_type="ascend",
        utilization=0.9,
        temperature_c=71,
        memory_used_bytes=8 * GIB,
        memory_total_bytes=32 * GIB,
        status="Ready",
    ),
    telemetry_pb2.DeviceMetric(
        node="node-b",
        device="node-b/cambricon:0",
        device_type="cambricon",
        utilization=0.5,
        temperature_c=60,
        memory_used_bytes=40 * GIB,
        memory_total_bytes=48 * GIB,
        status="Ready",
    ),
    telemetry_pb2.DeviceMetric(
        node="node-b",
        device="node-b/nvidia:0",
        device_type="nvidia",
        utilization=0.81,
        temperature_c=88,
        memory_total_bytes=40 * GIB,
        status="Unhealthy",
        workload="chat",
    ),
]


def select(expr: str) -> list[str]:
    conds = parse_filter(expr)
    return [d.device for d in DEVICES if matches(d, conds)]


def test_operators_and_combinations() -> None:
    assert select("") == [d.device for d in DEVICES]
    assert select("device_type==cambricon") == ["node-b/cambricon:0"]
    assert select("node=~node-a|node-b , utilization>0.8") == ["node-a/ascend:0", "node-b/nvidia:0"]
    assert select("node=~node") == []  # anchored like PromQL
    assert select("node!~node-b") == ["node-a/ascend:0"]
    assert select("utilization>=81%") == ["node-a/ascend:0", "node-b/nvidia:0"]
    assert select("temperature<61,status==Ready") == ["node-b/cambricon:0"]
    assert select("memory_used_ratio>0.5") == ["node-b/cambricon:0"]
    assert select("workload==chat") == ["node-b/nvidia:0"]
    assert select("workload!=chat,device_type!='ascend'") == ["node-b/cambricon:0"]
    assert select("power==0") == [d.device for d in DEVICES]


@pytest.mark.parametrize(
    ("expr", "says"),
    [
        ("utilisation>0.8", "unknown field 'utilisation'; known fields"),
        ("device_type>ascend", "device_type is text"),
        ("utilization=~0.8", "utilization is a number"),
        ("utilization>high", "expected a number"),
        ("node=~([", "invalid regular expression"),
        ("node", "is not FIELD OP VALUE"),
        ("x" * 1001, "at most 1000 characters"),
    ],
)
def test_bad_filters_are_refused_with_the_fix(expr: str, says: str) -> None:
    with pytest.raises(FilterError, match=None) as e:
        parse_filter(expr)
    assert says in str(e.value)


def test_spread_and_reason_labels() -> None:
    s = spread("w", [0.5, 0.7, 0.9])
    assert s.devices == 3 and abs(s.max_min - 0.4) < 1e-9 and abs(s.stddev - 0.1633) < 1e-3
    assert spread("w", []).devices == 0
    assert reason_class("InsufficientMemory (needs 40000 MB, 32768 free)") == "InsufficientMemory"
    assert reason_class("CardTypeMismatch") == "CardTypeMismatch"
    assert reason_class("(3 more nodes)") == "Other"
