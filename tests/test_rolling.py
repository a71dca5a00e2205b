"""Rolling replacement after a spec change, without a cluster: the pure decision for combinations of
max_surge and max_unavailable (stepped to the end, checking the serving floor at every step), the
default policy's fallback on a full cluster, validation, and the leader's units for a spec update."""

from __future__ import annotations

import pytest

from controlplane import keys
from controlplane.scheduler.leader import SchedulerLoop
from controlplane.scheduler.rolling import Member, RollPolicy, decide_roll, progress_text
from controlplane.scheduler.snapshot import decode_state
from controlplane.store import KV, PutOp
from controlplane.workloads.spec import rolling_problems, same_engine_spec, with_defaults
from kunlun_common.api import workload_pb2

RUN, PEND, SCHED = "Running", "Pending", "Scheduled"


def old(n: int, gen: int = 1) -> list[Member]:
    return [Member(f"w-{o}-1", o, gen, RUN) for o in range(n)]


def test_surge_first_by_default_one_at_a_time() -> None:
    p = RollPolicy()
    assert (p.max_surge, p.max_unavailable, p.defaulted) == (1, 0, True)
    d = decide_roll(3, 2, old(3), p)
    assert (d.create, d.retire, d.remove) == ((0,), (), ())  # a successor first; nothing stops yet
    assert progress_text(3, d) == "rolling: 0/3 updated, 3 serving (max surge 1, max unavailable 0, defaults)"
    # the successor is placed but not serving: still nothing stops, nothing more starts (surge used)
    ms = [*old(3), Member("w-0-9", 0, 2, SCHED)]
    d = decide_roll(3, 2, ms, p)
    assert (d.create, d.retire, d.remove) == ((), (), ())
    assert d.waiting == "waiting for new instances to serve"
    # it serves: the old one of its ordinal leaves routing (4 serving -> 3, never below 3)
    ms[-1] = Member("w-0-9", 0, 2, RUN)
    d = decide_roll(3, 2, ms, p)
    assert (d.create, d.retire, d.remove) == ((), ("w-0-1",), ())
    assert progress_text(3, d).startswith("rolling: 1/3 updated, 4 serving")
    # draining: kept until the drain period passed, then removed and the next ordinal starts
    ms[0] = Member("w-0-1", 0, 1, RUN, retiring=True)
    assert decide_roll(3, 2, ms, p).waiting == "draining"
    d = decide_roll(3, 2, ms, p, drained={"w-0-1"})
    assert (d.create, d.retire, d.remove) == ((1,), (), ("w-0-1",))


def test_unavailable_first_without_surge() -> None:
    p = RollPolicy(max_surge=0, max_unavailable=1, defaulted=False)
    d = decide_roll(3, 2, old(3), p)
    assert (d.create, d.retire, d.remove) == ((), ("w-0-1",), ())  # no room above 3: one goes first
    ms = [Member("w-0-1", 0, 1, RUN, retiring=True), *old(3)[1:]]
    d = decide_roll(3, 2, ms, p, drained={"w-0-1"})
    assert (d.create, d.retire, d.remove) == ((), (), ("w-0-1",))  # the lifecycle refills ordinal 0


def test_more_surge_and_unavailable_go_faster() -> None:
    d = decide_roll(4, 2, old(4), RollPolicy(2, 1, False))
    assert d.create == (0, 1) and d.retire == ("w-0-1",)


def test_old_instances_that_serve_nobody_go_at_once() -> None:
    ms = [Member("w-0-1", 0, 1, "Failed"), *old(3)[1:]]
    d = decide_roll(3, 2, ms, RollPolicy())
    assert d.remove == ("w-0-1",) and d.retire == () and d.create == (1,)


def test_full_cluster_default_policy_gives_one_up_explicit_policy_waits() -> None:
    stuck = Member("w-0-9", 0, 2, PEND, unplaceable=True)
    ms = [*old(3), stuck]
    d = decide_roll(3, 2, ms, RollPolicy())
    assert d.retire == ("w-0-1",)  # the stuck successor's own ordinal makes room
    strict = RollPolicy(1, 0, False)
    d = decide_roll(3, 2, ms, strict)
    assert (d.create, d.retire, d.remove) == ((), (), ())
    assert "cannot be placed (max_unavailable 0)" in progress_text(3, d)


def test_duplicate_current_instances_keep_the_best() -> None:
    ms = [Member("w-0-5", 0, 2, RUN), Member("w-0-7", 0, 2, PEND)]
    d = decide_roll(1, 2, ms, RollPolicy())
    assert d.remove == ("w-0-7",) and d.retire == ()


def test_nothing_to_do_when_every_instance_is_current() -> None:
    d = decide_roll(3, 1, old(3), RollPolicy())
    assert not d.rolling and progress_text(3, d) == ""


def _simulate(replicas: int, policy: RollPolicy, start_ticks: int = 2) -> tuple[int, int]:
    """Step the decision like the leader would (successors serve `start_ticks` ticks after their
    creation, retiring ones drain for one tick) until every instance is current; the lowest number
    serving seen and the ticks taken."""
    members = {m.id: m for m in old(replicas)}
    age: dict[str, int] = {}
    floor = replicas
    for tick in range(1, 200):
        for m in list(members.values()):  # successors come up; the lifecycle refills empty ordinals
            age[m.id] = age.get(m.id, 0) + 1
            if m.generation == 2 and m.phase != RUN and age[m.id] >= start_ticks:
                members[m.id] = Member(m.id, m.ordinal, 2, RUN)
        for o in range(replicas):
            if not any(m.ordinal == o for m in members.values()):
                members[f"w-{o}-r{tick}"] = Member(f"w-{o}-r{tick}", o, 2, SCHED)
        drained = {i for i, m in members.items() if m.retiring and age.get(i, 0) >= 1}
        d = decide_roll(replicas, 2, list(members.values()), policy, drained)
        for iid in d.remove:
            del members[iid]
        for iid in d.retire:
            m = members[iid]
            members[iid] = Member(m.id, m.ordinal, m.generation, m.phase, retiring=True)
            age[iid] = 0
        for o in d.create:
            members[f"w-{o}-c{tick}"] = Member(f"w-{o}-c{tick}", o, 2, SCHED)
        serving = sum(1 for m in members.values() if m.serving)
        floor = min(floor, serving)
        assert len(members) <= replicas + max(policy.max_surge, 0) + policy.max_unavailable
        if all(m.generation == 2 and m.serving for m in members.values()) and len(members) == replicas:
            return floor, tick
    raise AssertionError(f"the roll never finished: {sorted(members.values(), key=lambda m: m.id)}")


@pytest.mark.parametrize(("surge", "unavailable"), [(1, 0), (0, 1), (2, 0), (1, 1), (2, 2), (3, 0), (0, 3)])
def test_every_policy_finishes_and_keeps_the_floor(surge: int, unavailable: int) -> None:
    for replicas in (1, 3, 5):
        policy = RollPolicy(surge, unavailable, False)
        floor, _ = _simulate(replicas, policy)
        assert floor >= max(0, replicas - unavailable), (replicas, surge, unavailable, floor)


def test_more_room_means_fewer_steps() -> None:
    slow = _simulate(5, RollPolicy(1, 0, False))[1]
    fast = _simulate(5, RollPolicy(3, 0, False))[1]
    assert fast < slow


def test_policy_of_a_spec_and_its_validation() -> None:
    spec = workload_pb2.WorkloadSpec(name="chat", model="m", replicas=3)
    assert RollPolicy.of(spec) == RollPolicy(1, 0, True)
    spec.max_surge = 0
    assert RollPolicy.of(spec) == RollPolicy(0, 1, False)  # no surge: one below instead
    spec.max_unavailable = 0
    assert any("both 0" in str(p) for p in rolling_problems(spec))
    spec.max_surge, spec.max_unavailable = -1, 2000
    assert len(rolling_problems(spec)) == 2
    pinned = with_defaults(workload_pb2.WorkloadSpec(name="p", model="m", pin="ascend:0", max_unavailable=0))
    assert any("pin" in str(p) for p in rolling_problems(pinned))
    assert (
        rolling_problems(with_defaults(workload_pb2.WorkloadSpec(name="p", model="m", pin="ascend:0"))) == []
    )


def test_replicas_and_roll_settings_are_no_new_generation() -> None:
    a = workload_pb2.WorkloadSpec(name="chat", model="m", replicas=3)
    b = workload_pb2.WorkloadSpec(name="chat", model="m", replicas=5, max_surge=2)
    assert same_engine_spec(a, b)
    assert not same_engine_spec(a, workload_pb2.WorkloadSpec(name="chat", model="m2", replicas=3))
    # fencing reaches the engines' supervisors: a new generation (instances keep their placed spec)
    assert not same_engine_spec(
        a, workload_pb2.WorkloadSpec(name="chat", model="m", replicas=3, fencing="available")
    )


def _kv(key: str, value: bytes, rev: int) -> KV:
    return KV(key, value, rev, rev, 1, 0)


def test_a_spec_update_replaces_one_instance_at_a_time_not_all() -> None:
    """Before rolling updates, the leader released every old instance in the same tick (a full outage)."""
    w = workload_pb2.Workload(
        id="w-1", generation=2, spec=workload_pb2.WorkloadSpec(name="chat", model="m2", replicas=3)
    )
    kvs = {keys.workload(w.id): _kv(keys.workload(w.id), keys.encode_message(w), 5)}
    for o in range(3):
        inst = workload_pb2.Instance(
            id=f"w-1-{o}-3",
            workload_id="w-1",
            ordinal=o,
            phase=RUN,
            generation=1,
            node="n1",
            target_devices=[f"n1/ascend:{o}"],
            spec=workload_pb2.WorkloadSpec(name="chat", model="m1"),
        )
        kvs[keys.instance(inst.id)] = _kv(keys.instance(inst.id), keys.encode_message(inst), 6 + o)
        kvs[keys.alive("n1")] = _kv(keys.alive("n1"), b"{}", 4)
    loop = SchedulerLoop(None, "r1")  # type: ignore[arg-type]
    st = decode_state(kvs, 10)
    units = loop.lifecycle_units(st) + loop.reschedule_units(st, 100.0)
    assert [u.what for u in units] == ["create w-1-0-10"]
    op = units[0].ops[0]
    assert isinstance(op, PutOp)
    created = workload_pb2.Instance()
    keys.decode_message(op.value, created)
    assert (created.ordinal, created.generation) == (0, 2)
    # it lives beside the old instance of ordinal 0: its own slot, one per ordinal and generation
    assert created.slot == keys.instance_slot("w-1", 0) + "/g2"
    assert [o.key for o in units[0].ops] == [keys.instance(created.id), created.slot]
