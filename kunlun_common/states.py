"""Every named state of the platform, in one place.

The values are the strings stored in etcd and printed in JSON, so they never change: a `StrEnum`
member compares equal to its string and serialises as it (`json.dumps`, protobuf string fields,
f-strings). Code compares with the members, never with literals.

Instances (one running copy of a workload; written by the scheduler, then overlaid by the agent):

    Pending --scheduler--> Scheduled --agent--> Starting --> Running
    Running --(exit, OOM, failed liveness)--> CrashLoopBackOff --> Pending (agent, restarting)
    any --(stop)--> Stopped;  a launch that cannot be prepared --> Failed

Workloads (derived from their instances by `workload_phase`), rollouts (the canary state machine,
`controlplane/rollout.py`), nodes (liveness), devices (health, `types.proto` DeviceStatus) and an
engine's supervisor (its state file on the node) have their own enums below.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from types import MappingProxyType

from kunlun_common.api import types_pb2


class InstancePhase(StrEnum):
    """`Instance.phase` and the agent's `InstanceStatus.phase`."""

    PENDING = "Pending"
    """Waiting for placement (scheduler), or being prepared on the node (agent)."""
    SCHEDULED = "Scheduled"
    """Placed on devices by the leader; the agent has not started it yet."""
    STARTING = "Starting"
    """The engine process runs but has not passed its readiness probe."""
    RUNNING = "Running"
    """Ready: its endpoint receives traffic."""
    CRASH_LOOP = "CrashLoopBackOff"
    """The engine exited or failed liveness; the agent restarts it after a backoff."""
    FAILED = "Failed"
    """The launch cannot be prepared (bad plan, missing model...); the reason says why."""
    STOPPED = "Stopped"
    """Stopped on purpose (scale down, removal, drain)."""


PLACED: tuple[InstancePhase, ...] = (InstancePhase.SCHEDULED, InstancePhase.STARTING, InstancePhase.RUNNING)
"""Instance phases that hold devices on a node."""

SERVING: tuple[InstancePhase, ...] = (InstancePhase.STARTING, InstancePhase.RUNNING)
"""Instance phases whose engine process is up (it uses its devices)."""


class WorkloadPhase(StrEnum):
    """A workload's phase, derived from its instances (`controlplane.workloads.records.workload_phase`)."""

    PENDING = "Pending"
    SCHEDULED = "Scheduled"
    RUNNING = "Running"
    DEGRADED = "Degraded"
    FAILED = "Failed"
    STOPPED = "Stopped"
    DELETING = "Deleting"


class WorkloadChange(StrEnum):
    """The `phase` of an entry in a workload's history (besides "Scaled to N": `scaled_to`)."""

    SUBMITTED = "Submitted"
    UPDATED = "Updated"
    DELETING = "Deleting"


def scaled_to(replicas: int) -> str:
    """The history entry of a scale request."""
    return f"Scaled to {replicas}"


class RolloutPhase(StrEnum):
    """`Rollout.phase`: the canary state machine (`controlplane/rollout.py`)."""

    PROGRESSING = "Progressing"
    COMPLETED = "Completed"
    ABORTED = "Aborted"
    DEGRADED = "Degraded"


class Verdict(StrEnum):
    """A rollout analysis' verdict."""

    PASSED = "Passed"
    FAILED = "Failed"
    WAITING = "Waiting"


class NodeState(StrEnum):
    """A node's liveness as shown by the CLI (`node-status/<node>` stores it as a boolean)."""

    READY = "Ready"
    NOT_READY = "NotReady"


class DeviceState(StrEnum):
    """A device's health; the names of `types.proto` DeviceStatus."""

    UNKNOWN = "Unknown"
    READY = "Ready"
    """Present, declared correctly and healthy: the only state that receives new work."""
    UNHEALTHY = "Unhealthy"
    """The vendor tool reports it unhealthy (or over its temperature limit)."""
    UNAVAILABLE = "Unavailable"
    """Its node or its plugin is gone."""
    ERROR = "Error"
    """Its declaration is wrong; the status reason says why."""

    @property
    def proto(self) -> types_pb2.DeviceStatus.ValueType:
        """The wire value (`types_pb2.DEVICE_STATUS_*`)."""
        return _PROTO_OF[self]

    @classmethod
    def of(cls, status: int) -> DeviceState:
        """The state of a wire value; UNKNOWN for unspecified or unknown values."""
        return DEVICE_STATE_OF_PROTO.get(status, cls.UNKNOWN)


_PROTO_OF: Mapping[DeviceState, types_pb2.DeviceStatus.ValueType] = MappingProxyType(
    {
        DeviceState.UNKNOWN: types_pb2.DEVICE_STATUS_UNSPECIFIED,
        DeviceState.READY: types_pb2.DEVICE_STATUS_READY,
        DeviceState.UNHEALTHY: types_pb2.DEVICE_STATUS_UNHEALTHY,
        DeviceState.UNAVAILABLE: types_pb2.DEVICE_STATUS_UNAVAILABLE,
        DeviceState.ERROR: types_pb2.DEVICE_STATUS_ERROR,
    }
)
DEVICE_STATE_OF_PROTO: Mapping[int, DeviceState] = MappingProxyType({v: k for k, v in _PROTO_OF.items()})
"""Wire value -> state, for every DeviceStatus value."""


class SupervisorStatus(StrEnum):
    """The `status` of an engine supervisor's state file on the node."""

    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    EXITED = "exited"
    FAILED = "failed"


SUPERVISOR_DONE: tuple[SupervisorStatus, ...] = (SupervisorStatus.EXITED, SupervisorStatus.FAILED)
"""Supervisor statuses after which no engine runs any more."""


class ExitCause(StrEnum):
    """Why an engine run ended, as its supervisor records it (`exit.json`)."""

    FAILED = "failed"
    """It could not be started (sandbox setup failed, the command is missing...)."""
    OOM_KILLED = "oom_killed"
    """The kernel killed it for exceeding its memory limit."""
    STOPPED = "stopped"
    """It was stopped on purpose."""
    SIGNALED = "signaled"
    """A signal ended it."""
    EXITED = "exited"
    """It exited on its own."""
