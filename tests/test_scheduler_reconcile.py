"""The leader's reconcile decisions as pure functions (controlplane/scheduler/reconcile.py): the
same state, clocks and observations give the same units; what a tick observed is handed back in a
new `Observations` record (the one passed in is never changed), and a grace counts only from what
the record holds, so a new leader term (an empty record) starts every grace again."""

from __future__ import annotations

from controlplane import keys
from controlplane.scheduler import reconcile
from controlplane.scheduler.reconcile import Observations
from controlplane.scheduler.snapshot import ClusterState, decode_state
from controlplane.store import KV
from kunlun_common.api import types_pb2, workload_pb2

BY = "scheduler@r1"


def _kv(key: str, value: bytes, rev: int) -> KV:
    return KV(key, value, rev, rev, 1, 0)


def _state(*, n1_alive: bool, replicas: int = 1) -> ClusterState:
    kvs: dict[str, KV] = {}
    for name in ("n1", "n2"):
        node = types_pb2.Node(
            name=name,
            devices=[
                types_pb2.Device(
                    name=f"{name}/ascend:0",
                    node=name,
                    device_type="ascend",
                    hbm_memory_mb=32768,
                    supported_dtypes=["bf16"],
                    status=types_pb2.DEVICE_STATUS_READY,
                )
            ],
        )
        kvs[keys.node(name)] = _kv(keys.node(name), keys.encode_message(node), 2)
        if name != "n1" or n1_alive:
            kvs[keys.alive(name)] = _kv(keys.alive(name), b"{}", 3)
    w = workload_pb2.Workload(
        id="w", generation=1, spec=workload_pb2.WorkloadSpec(name="w", model="m", replicas=replicas)
    )
    kvs[keys.workload("w")] = _kv(keys.workload("w"), keys.encode_message(w), 4)
    inst = workload_pb2.Instance(
        id="w-0-4",
        workload_id="w",
        ordinal=0,
        phase="Running",
        generation=1,
        node="n1",
        target_devices=["n1/ascend:0"],
    )
    kvs[keys.instance(inst.id)] = _kv(keys.instance(inst.id), keys.encode_message(inst), 5)
    kvs[keys.alloc("n1/ascend:0")] = _kv(keys.alloc("n1/ascend:0"), keys.encode({"instance": "w-0-4"}), 5)
    return decode_state(kvs, 10)


def test_a_grace_counts_from_the_observation_record() -> None:
    st = _state(n1_alive=False)
    grace = st.config.node_not_ready_grace_seconds
    empty = Observations()
    units, seen = reconcile.reschedule(st, empty, 100.0, BY)
    assert units == [] and seen.not_ready_since == {"n1": 100.0}  # first seen now: grace starts
    assert empty.not_ready_since == {}  # the record passed in is not changed
    units, later = reconcile.reschedule(st, seen, 100.0 + grace - 0.5, BY)
    assert units == [] and later.not_ready_since == {"n1": 100.0}  # not yet past the grace
    units, _ = reconcile.reschedule(st, later, 100.0 + grace, BY)
    assert [u.what.split(":")[0] for u in units] == ["release w-0-4"]
    # the same inputs give the same decision (nothing else is remembered)
    again, _ = reconcile.reschedule(st, later, 100.0 + grace, BY)
    assert [(u.what, u.compares) for u in again] == [(u.what, u.compares) for u in units]
    # a new term (an empty record) starts the grace again, whatever an earlier term saw
    units, fresh = reconcile.reschedule(st, Observations(), 100.0 + grace, BY)
    assert units == [] and fresh.not_ready_since == {"n1": 100.0 + grace}
    # back alive: forgotten
    assert reconcile.observe(later, _state(n1_alive=True), 200.0).not_ready_since == {}


def test_lifecycle_and_placement_are_functions_of_their_inputs() -> None:
    st = _state(n1_alive=True, replicas=2)
    units, obs = reconcile.lifecycle(st, Observations(), 5.0, BY)
    assert [u.what for u in units] == ["create w-1-10"]
    assert obs == Observations()  # nothing retiring: nothing observed
    decision = reconcile.placement(st, 1_000.0, BY)
    assert decision.units == [] and decision.placed == 0 and decision.queue == {}  # none pending yet


def _canary_state(phase: str, retiring: bool, deleting: bool) -> ClusterState:
    """Workload w (1 replica on n1) plus a canary on n2 whose rollout is over (no rollout record)."""
    kvs: dict[str, KV] = {}
    for name in ("n1", "n2"):
        node = types_pb2.Node(
            name=name,
            devices=[
                types_pb2.Device(
                    name=f"{name}/ascend:0",
                    node=name,
                    device_type="ascend",
                    hbm_memory_mb=32768,
                    supported_dtypes=["bf16"],
                    status=types_pb2.DEVICE_STATUS_READY,
                )
            ],
        )
        kvs[keys.node(name)] = _kv(keys.node(name), keys.encode_message(node), 2)
        kvs[keys.alive(name)] = _kv(keys.alive(name), b"{}", 3)
    w = workload_pb2.Workload(
        id="w",
        generation=2,
        deleting=deleting,
        spec=workload_pb2.WorkloadSpec(name="w", model="m", replicas=1),
    )
    kvs[keys.workload("w")] = _kv(keys.workload("w"), keys.encode_message(w), 4)
    for inst in (
        workload_pb2.Instance(
            id="w-0-4", workload_id="w", ordinal=0, phase="Running", generation=2, node="n1",
            target_devices=["n1/ascend:0"],
        ),
        workload_pb2.Instance(
            id="w-c0-6", workload_id="w", ordinal=0, variant="canary", phase=phase, generation=2,
            node="n2", target_devices=["n2/ascend:0"], retiring=retiring,
        ),
    ):  # fmt: skip
        kvs[keys.instance(inst.id)] = _kv(keys.instance(inst.id), keys.encode_message(inst), 5)
        dev = inst.target_devices[0]
        kvs[keys.alloc(dev)] = _kv(keys.alloc(dev), keys.encode({"instance": inst.id}), 5)
    return decode_state(kvs, 10)


def _canary_units(st: ClusterState, obs: Observations, mono: float) -> tuple[list[str], Observations]:
    units, seen = reconcile.lifecycle(st, obs, mono, BY)
    return [u.what for u in units if "w-c0-6" in u.what], seen


def test_a_canary_no_longer_wanted_drains_before_its_engine_stops() -> None:
    """Rollout over: a serving canary leaves routing first and is removed only after the drain
    period (it used to be removed at once, failing the requests in flight on it)."""
    whats, _ = _canary_units(_canary_state("Running", False, False), Observations(), 100.0)
    assert whats == ["retire w-c0-6"]
    retiring = _canary_state("Running", True, False)
    whats, seen = _canary_units(retiring, Observations(), 100.0)
    assert whats == [] and seen.retiring_since == {"w-c0-6": 100.0}  # draining
    whats, _ = _canary_units(retiring, seen, 100.0 + reconcile.DRAIN_S - 0.1)
    assert whats == []
    whats, _ = _canary_units(retiring, seen, 100.0 + reconcile.DRAIN_S)
    assert whats == ["remove w-c0-6"]
    # serving nobody, or its workload being deleted: removed at once
    assert _canary_units(_canary_state("Starting", False, False), Observations(), 100.0)[0] == [
        "remove w-c0-6"
    ]
    assert _canary_units(_canary_state("Running", False, True), Observations(), 100.0)[0] == ["remove w-c0-6"]
