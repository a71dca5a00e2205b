"""Placement of LLM inference instances on accelerators: a pure function and its queue.

`plan = schedule(snapshot, pending, running, config, now)` maps a graph snapshot, the pending queue,
the running instances (for preemption), the scheduler config and a clock to a `Plan`. It does no
I/O: the leader commits the plan in fenced etcd transactions and calls it again when a commit is
rejected. Modules: `model` (inputs and outputs), `config` (`SchedulerConfig`, YAML), `queue`
(weighted fair ordering), `requirement` (what an instance needs), `filters` (the feasibility table,
`FILTERS`, and the reason codes), `scores` (the rank table, `SCORES`), `index` (per-call indexes)
and `plan` (`schedule()`).
"""

from controlplane.scheduler.config import SchedulerConfig, parse_scheduler_config, to_yaml
from controlplane.scheduler.filters import (
    CARD_TYPE_MISMATCH,
    DEVICE_NOT_READY,
    NO_FREE_DEVICE,
    NO_P2P_GROUP,
    NODE_CORDONED,
    NODE_NOT_READY,
    PIN_MISMATCH,
    insufficient_devices,
    insufficient_memory,
    too_hot,
    unsupported_dtype,
)
from controlplane.scheduler.model import (
    PRIORITIES,
    DeviceView,
    GraphSnapshot,
    NodeView,
    PendingInstance,
    Placement,
    Plan,
    RunningInstance,
    Unplaced,
    WorkloadReq,
)
from controlplane.scheduler.plan import PlanBuilder, schedule
from controlplane.scheduler.queue import order_pending

__all__ = [
    "CARD_TYPE_MISMATCH",
    "DEVICE_NOT_READY",
    "NODE_CORDONED",
    "NODE_NOT_READY",
    "NO_FREE_DEVICE",
    "NO_P2P_GROUP",
    "PIN_MISMATCH",
    "PRIORITIES",
    "DeviceView",
    "GraphSnapshot",
    "NodeView",
    "PendingInstance",
    "Placement",
    "Plan",
    "PlanBuilder",
    "RunningInstance",
    "SchedulerConfig",
    "Unplaced",
    "WorkloadReq",
    "insufficient_devices",
    "insufficient_memory",
    "order_pending",
    "parse_scheduler_config",
    "schedule",
    "to_yaml",
    "too_hot",
    "unsupported_dtype",
]
