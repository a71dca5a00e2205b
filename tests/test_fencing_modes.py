"""`fencing: strict|available` and the leader's pause on mass NotReady, as pure decisions.

A strict instance (the default) is always moved off a node NotReady past the grace: its engine
stops by itself at the agent's disconnect deadline. An available instance keeps serving without
contact, so when a large share of the nodes is lost at once (more likely the control plane lost
them than they stopped serving) the leader does not move it. The agent side (the engine kept
running past the deadline) is tested against a real cluster in tests/test_placement_safety.py."""

from __future__ import annotations

from controlplane import keys
from controlplane.scheduler.config import SchedulerConfig, parse_scheduler_config
from controlplane.scheduler.leader import SchedulerLoop, mass_not_ready
from controlplane.scheduler.snapshot import decode_state
from controlplane.store import KV
from controlplane.workloads.spec import validate, with_defaults
from kunlun_common.api import types_pb2, workload_pb2


def _kv(key: str, value: bytes, rev: int) -> KV:
    return KV(key, value, rev, rev, 1, 0)


def _state(alive: set[str], nodes: int = 4) -> dict[str, KV]:
    kvs: dict[str, KV] = {}
    for n in range(1, nodes + 1):
        name = f"n{n}"
        kvs[keys.node(name)] = _kv(keys.node(name), keys.encode_message(types_pb2.Node(name=name)), 2)
        if name in alive:
            kvs[keys.alive(name)] = _kv(keys.alive(name), b"{}", 3)
    for wid, fencing in (("w-a", "available"), ("w-s", "strict")):
        w = workload_pb2.Workload(
            id=wid,
            generation=1,
            spec=workload_pb2.WorkloadSpec(name=wid, model="m", replicas=1, fencing=fencing),
        )
        kvs[keys.workload(wid)] = _kv(keys.workload(wid), keys.encode_message(w), 4)
        inst = workload_pb2.Instance(
            id=f"{wid}-0-4",
            workload_id=wid,
            ordinal=0,
            phase="Running",
            generation=1,
            node="n1",
            target_devices=[f"n1/ascend:{0 if wid == 'w-a' else 1}"],
        )
        kvs[keys.instance(inst.id)] = _kv(keys.instance(inst.id), keys.encode_message(inst), 5)
    return kvs


def _moved(alive: set[str]) -> list[str]:
    loop = SchedulerLoop(None, "r1")  # type: ignore[arg-type]
    st = decode_state(_state(alive), 10)
    loop.observe(st, 0.0)  # the leader first sees the lost nodes at 0; the grace (30 s) has passed at 100
    return sorted(u.what.split()[1].rstrip(":") for u in loop.reschedule_units(st, 100.0))


def test_one_node_lost_moves_both() -> None:
    assert _moved({"n2", "n3", "n4"}) == ["w-a-0-4", "w-s-0-4"]


def test_half_the_nodes_lost_moves_only_the_strict_instance() -> None:
    assert _moved({"n3", "n4"}) == ["w-s-0-4"]
    assert _moved(set()) == ["w-s-0-4"]


def test_the_pause_threshold() -> None:
    st = decode_state(_state({"n3", "n4"}), 10)
    assert mass_not_ready(st, 0.5) == "2 of 4 nodes NotReady at once (pause_moves_not_ready_fraction 0.5)"
    assert mass_not_ready(st, 0.75) == ""
    one_lost = decode_state(_state({"n2", "n3", "n4"}), 10)
    assert mass_not_ready(one_lost, 0.0) == ""  # never for a single node
    assert (
        parse_scheduler_config("pause_moves_not_ready_fraction: 0.75\n").pause_moves_not_ready_fraction
        == 0.75
    )
    assert SchedulerConfig().pause_moves_not_ready_fraction == 0.5


def test_fencing_values_are_validated() -> None:
    ok = with_defaults(workload_pb2.WorkloadSpec(name="x", model="m", fencing="available"))
    assert not [p for p in validate(ok) if str(p).startswith("fencing")]
    bad = with_defaults(workload_pb2.WorkloadSpec(name="x", model="m", fencing="relaxed"))
    assert "fencing: expected one of strict, available, found 'relaxed'" in [str(p) for p in validate(bad)]
