"""Weighted fair queueing of pending instances across priority classes.

Every pending instance costs one unit of service. Within a class, instances keep FIFO order
(`seq`); the k-th instance (1-based) of a class with weight w gets the virtual finish time k / w.
The queue is served in increasing virtual finish time, so under contention the classes are served
in the ratio of their weights (high 3 : normal 1 : low 1/3 places 9 high, 3 normal and 1 low of
every 13), and low is never starved: its k-th instance comes before high's (9k + 1)-th.

Ties (equal finish times) go to the higher priority, then to the earlier `seq`, then to the id, so
the order is a pure function of the input.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from controlplane.scheduler.model import PRIORITIES, PRIORITY_RANK, PendingInstance


def virtual_finish_times(pending: Sequence[PendingInstance], weights: Mapping[str, float]) -> list[float]:
    """The virtual finish time of each instance of `pending`, in the same positions."""
    by_class: dict[str, list[int]] = {}
    for pos, inst in enumerate(pending):
        prio = inst.workload.priority
        weight = weights.get(prio)
        if weight is None or not weight > 0:
            known = ", ".join(p for p in PRIORITIES if weights.get(p, 0) > 0)
            raise ValueError(
                f"instance {inst.instance_id}: priority {prio!r} has no positive weight (weighted: {known})"
            )
        by_class.setdefault(prio, []).append(pos)
    finish = [0.0] * len(pending)
    for prio, positions in by_class.items():
        positions.sort(key=lambda p: (pending[p].seq, pending[p].instance_id))
        weight = weights[prio]
        for k, pos in enumerate(positions, start=1):
            finish[pos] = k / weight
    return finish


def order_pending(pending: Sequence[PendingInstance], weights: Mapping[str, float]) -> list[PendingInstance]:
    """`pending` in service order: weighted fair across priorities, FIFO within one.

    `weights` maps each priority present in `pending` to a weight > 0 (ValueError otherwise).
    """
    finish = virtual_finish_times(pending, weights)
    big = len(PRIORITIES)
    order = sorted(
        range(len(pending)),
        key=lambda p: (
            finish[p],
            PRIORITY_RANK.get(pending[p].workload.priority, big),
            pending[p].seq,
            pending[p].instance_id,
        ),
    )
    return [pending[p] for p in order]
