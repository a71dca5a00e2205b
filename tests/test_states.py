"""The named states keep the exact strings stored in etcd and printed in JSON, and travel through
protobuf and JSON as plain strings."""

from __future__ import annotations

import json

from google.protobuf import json_format

from controlplane.workloads.records import workload_phase
from kunlun_common.api import types_pb2, workload_pb2
from kunlun_common.clock import now_ms
from kunlun_common.states import (
    PLACED,
    DeviceState,
    ExitCause,
    InstancePhase,
    NodeState,
    RolloutPhase,
    SupervisorStatus,
    Verdict,
    WorkloadChange,
    WorkloadPhase,
    scaled_to,
)


def test_values_are_the_stored_strings() -> None:
    # Changing one of these changes stored records and the CLI's JSON: a compatibility break.
    assert [p.value for p in InstancePhase] == [
        "Pending",
        "Scheduled",
        "Starting",
        "Running",
        "CrashLoopBackOff",
        "Failed",
        "Stopped",
    ]
    assert {p.value for p in WorkloadPhase} == {
        "Pending",
        "Scheduled",
        "Running",
        "Degraded",
        "Failed",
        "Stopped",
        "Deleting",
    }
    assert [p.value for p in WorkloadChange] == ["Submitted", "Updated", "Deleting"]
    assert scaled_to(3) == "Scaled to 3"
    assert [p.value for p in RolloutPhase] == ["Progressing", "Completed", "Aborted", "Degraded"]
    assert [v.value for v in Verdict] == ["Passed", "Failed", "Waiting"]
    assert [s.value for s in NodeState] == ["Ready", "NotReady"]
    assert [s.value for s in SupervisorStatus] == ["starting", "running", "stopping", "exited", "failed"]
    assert {c.value for c in ExitCause} == {"failed", "oom_killed", "stopped", "signaled", "exited"}
    assert PLACED == ("Scheduled", "Starting", "Running")


def test_device_states_match_the_wire_enum() -> None:
    names = {
        types_pb2.DEVICE_STATUS_UNSPECIFIED: "Unknown",
        types_pb2.DEVICE_STATUS_READY: "Ready",
        types_pb2.DEVICE_STATUS_UNHEALTHY: "Unhealthy",
        types_pb2.DEVICE_STATUS_UNAVAILABLE: "Unavailable",
        types_pb2.DEVICE_STATUS_ERROR: "Error",
    }
    assert set(names) == set(types_pb2.DeviceStatus.values()), "a DeviceStatus value has no state"
    for wire, name in names.items():
        assert DeviceState.of(wire) == name and DeviceState.of(wire).proto == wire
    assert DeviceState.of(99) is DeviceState.UNKNOWN


def test_states_travel_as_plain_strings() -> None:
    inst = workload_pb2.Instance(id="i", phase=InstancePhase.RUNNING)
    assert json_format.MessageToDict(inst)["phase"] == "Running"
    assert json.dumps({"status": DeviceState.READY}) == '{"status": "Ready"}'
    assert f"{RolloutPhase.COMPLETED}" == "Completed" and str(NodeState.NOT_READY) == "NotReady"
    parsed = workload_pb2.Instance()
    json_format.ParseDict({"phase": "Stopped"}, parsed)
    assert parsed.phase == InstancePhase.STOPPED


def test_workload_phase_from_instances() -> None:
    w = workload_pb2.Workload(spec=workload_pb2.WorkloadSpec(replicas=2))

    def insts(*phases: str) -> list[workload_pb2.Instance]:
        return [workload_pb2.Instance(phase=p) for p in phases]

    assert workload_phase(w, insts("Running", "Running")) is WorkloadPhase.RUNNING
    assert workload_phase(w, insts("Running", "Starting")) is WorkloadPhase.SCHEDULED
    assert workload_phase(w, insts("Running")) is WorkloadPhase.DEGRADED
    assert workload_phase(w, insts("Pending", "Stopped")) is WorkloadPhase.PENDING
    assert workload_phase(w, insts("Failed", "Failed")) is WorkloadPhase.FAILED
    assert workload_phase(w, insts("Failed", "Running")) is WorkloadPhase.DEGRADED
    w.spec.replicas = 0
    assert workload_phase(w, insts("Running")) is WorkloadPhase.STOPPED
    w.deleting = True
    assert workload_phase(w, []) is WorkloadPhase.DELETING


def test_clock_is_wall_milliseconds() -> None:
    import time

    before = int(time.time() * 1000)
    t = now_ms()
    assert before <= t <= int(time.time() * 1000)
