"""Weighted fair queueing of pending instances (order_pending)."""

from __future__ import annotations

import random

import pytest

from controlplane.scheduler import PendingInstance, SchedulerConfig, WorkloadReq, order_pending
from controlplane.scheduler.queue import virtual_finish_times

WEIGHTS = SchedulerConfig().priority_weights


def inst(instance_id: str, priority: str, seq: int) -> PendingInstance:
    workload = WorkloadReq(
        workload_id="w",
        name="w",
        model="m",
        quantization="none",
        dtype="fp16",
        devices_per_instance=1,
        memory_per_device_mb=1000,
        priority=priority,
    )
    return PendingInstance(instance_id=instance_id, workload=workload, enqueued_at=float(seq), seq=seq)


def backlog(high: int, normal: int, low: int) -> list[PendingInstance]:
    out: list[PendingInstance] = []
    seq = 0
    for prio, count in (("low", low), ("normal", normal), ("high", high)):  # low submitted first
        for k in range(count):
            out.append(inst(f"{prio}-{k}", prio, seq))
            seq += 1
    return out


def classes(order: list[PendingInstance]) -> list[str]:
    return [p.workload.priority for p in order]


def test_default_weights_are_3_1_and_a_third() -> None:
    assert dict(WEIGHTS) == {"high": 3.0, "normal": 1.0, "low": 1.0 / 3.0}


def test_first_thirteen_follow_the_9_3_1_ratio() -> None:
    order = order_pending(backlog(30, 30, 30), WEIGHTS)
    first = classes(order[:13])
    assert (first.count("high"), first.count("normal"), first.count("low")) == (9, 3, 1)
    assert classes(order[:4]) == ["high", "high", "high", "normal"]


def test_share_holds_over_a_long_backlog() -> None:
    order = order_pending(backlog(900, 300, 100), WEIGHTS)
    for cut in (130, 650, 1300):
        head = classes(order[:cut])
        assert (head.count("high"), head.count("normal"), head.count("low")) == (
            cut * 9 // 13,
            cut * 3 // 13,
            cut // 13,
        )


def test_low_is_never_starved() -> None:
    order = order_pending(backlog(10_000, 0, 5), WEIGHTS)
    positions = [i for i, p in enumerate(order) if p.workload.priority == "low"]
    assert positions == [9, 19, 29, 39, 49]


def test_fifo_within_a_class_by_seq() -> None:
    pending = [inst("b", "normal", 5), inst("a", "normal", 9), inst("c", "normal", 1)]
    assert [p.instance_id for p in order_pending(pending, WEIGHTS)] == ["c", "b", "a"]


def test_order_does_not_depend_on_input_order() -> None:
    pending = backlog(20, 20, 20)
    expected = order_pending(pending, WEIGHTS)
    shuffled = pending[:]
    random.Random(7).shuffle(shuffled)
    assert order_pending(shuffled, WEIGHTS) == expected


def test_configurable_weights() -> None:
    order = order_pending(backlog(10, 10, 10), {"high": 1.0, "normal": 1.0, "low": 1.0})
    assert classes(order[:6]) == ["high", "normal", "low", "high", "normal", "low"]
    order = order_pending(backlog(10, 10, 0), {"high": 1.0, "normal": 4.0, "low": 1.0})
    assert classes(order[:5]) == ["normal", "normal", "normal", "high", "normal"]


def test_finish_times() -> None:
    pending = [inst("h1", "high", 0), inst("l1", "low", 1), inst("h2", "high", 2)]
    assert virtual_finish_times(pending, {"high": 2.0, "low": 0.5}) == [0.5, 2.0, 1.0]


def test_unknown_priority_is_refused() -> None:
    with pytest.raises(ValueError, match=r"instance u1: priority 'urgent' has no positive weight"):
        order_pending([inst("u1", "urgent", 0)], WEIGHTS)


def test_empty_queue() -> None:
    assert order_pending([], WEIGHTS) == []
