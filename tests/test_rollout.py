"""Canary rollouts without a cluster: the leader's state machine, canary sizing and instances,
the canary spec agents get, and the gateways' weighted, session-sticky split."""

from __future__ import annotations

from controlplane import keys
from controlplane.rollout import advance, canary_count, completed_workload
from controlplane.scheduler.leader import SchedulerLoop
from controlplane.scheduler.snapshot import decode_state
from controlplane.store import KV, PutOp
from controlplane.workloads.rollouts import spec_problems
from gateway.backends import Registry
from gateway.settings import GatewaySettings
from kunlun_common.api import gateway_pb2, rollout_pb2, workload_pb2
from kunlun_common.states import RolloutPhase


def workload(replicas: int = 4) -> workload_pb2.Workload:
    return workload_pb2.Workload(
        id="w-1", generation=3, spec=workload_pb2.WorkloadSpec(name="chat", model="m-old", replicas=replicas)
    )


def rollout(steps: tuple[int, ...] = (), pct: int = 10, interval_s: int = 60) -> rollout_pb2.Rollout:
    spec = rollout_pb2.RolloutSpec(
        workload="chat", model="m-new", steps=steps, canary_pct=pct, interval_s=interval_s
    )
    first = steps[0] if steps else pct
    return rollout_pb2.Rollout(
        workload_id="w-1",
        workload="chat",
        spec=spec,
        baseline_model="m-old",
        phase=RolloutPhase.PROGRESSING,
        weight_pct=first,
    )


def test_steps_follow_the_interval_then_complete() -> None:
    r = rollout((10, 50, 100))
    r.spec.min_requests = 0  # no traffic needed: the analysis passes on no requests
    assert advance(r, 59_000, "t") is None
    r2 = advance(r, 60_000, "t")
    assert r2 is not None and (r2.phase, r2.step, r2.weight_pct) == (RolloutPhase.PROGRESSING, 1, 50)
    r3 = advance(r2, 120_000, "t")
    assert r3 is not None and r3.weight_pct == 100
    r4 = advance(r3, 180_000, "t")
    assert r4 is not None and r4.phase == RolloutPhase.COMPLETED and r4.weight_pct == 0
    assert advance(r4, 999_999, "t") is None


def test_without_steps_only_promote_moves_on_and_abort_stops() -> None:
    r = rollout(pct=10)
    assert advance(r, 10**12, "t") is None
    r.promotions_requested = 1
    r2 = advance(r, 0, "t")
    assert r2 is not None and r2.weight_pct == 100 and r2.promotions_applied == 1
    assert advance(r2, 0, "t") is None
    r2.abort_requested = True
    r3 = advance(r2, 0, "t")
    assert r3 is not None and r3.phase == RolloutPhase.ABORTED and r3.weight_pct == 0


def test_completion_makes_the_canary_model_the_baseline_with_history() -> None:
    w = completed_workload(workload(), rollout(), "rollout@r1")
    assert w.spec.model == "m-new" and w.generation == 4
    assert "m-old -> m-new" in w.history[-1].reason and w.history[-1].by == "rollout@r1"


def test_canary_count_follows_the_weight() -> None:
    w = workload(4)
    assert canary_count(w, None) == 0
    assert canary_count(w, rollout(pct=10)) == 1
    assert canary_count(w, rollout(pct=60)) == 3
    assert canary_count(w, rollout(pct=100)) == 4
    r = rollout(pct=10)
    r.phase = RolloutPhase.ABORTED
    assert canary_count(w, r) == 0


def test_spec_problems() -> None:
    ok = rollout_pb2.RolloutSpec(workload="chat", model="m", canary_pct=10, steps=[10, 50, 100])
    assert spec_problems(ok) == []
    bad = rollout_pb2.RolloutSpec(workload="chat", canary_pct=0, steps=[50, 10])
    assert len(spec_problems(bad)) == 3


def _kv(key: str, value: bytes, rev: int) -> KV:
    return KV(key, value, rev, rev, 1, 0)


def test_scheduler_creates_and_removes_canary_instances() -> None:
    w = workload(4)
    kvs = {keys.workload(w.id): _kv(keys.workload(w.id), keys.encode_message(w), 5)}
    for o in range(4):
        inst = workload_pb2.Instance(id=f"w-1-{o}", workload_id="w-1", ordinal=o, phase="Pending")
        kvs[keys.instance(inst.id)] = _kv(keys.instance(inst.id), keys.encode_message(inst), 6 + o)
    loop = SchedulerLoop(None, "r1")  # type: ignore[arg-type]
    assert loop.lifecycle_units(decode_state(kvs, 10)) == []
    r = rollout(pct=30)
    kvs[keys.rollout("w-1")] = _kv(keys.rollout("w-1"), keys.encode_message(r), 11)
    units = loop.lifecycle_units(decode_state(kvs, 11))
    assert sorted(u.what for u in units) == ["create w-1-c0-11", "create w-1-c1-11"]
    canary = workload_pb2.Instance()
    op = units[0].ops[0]
    assert isinstance(op, PutOp)
    keys.decode_message(op.value, canary)
    assert canary.variant == "canary"
    for o in range(2):
        c = workload_pb2.Instance(id=f"w-1-c{o}", workload_id="w-1", ordinal=o, variant="canary")
        kvs[keys.instance(c.id)] = _kv(keys.instance(c.id), keys.encode_message(c), 12 + o)
    assert loop.lifecycle_units(decode_state(kvs, 13)) == []
    r.abort_requested, r.phase, r.weight_pct = True, RolloutPhase.ABORTED, 0
    kvs[keys.rollout("w-1")] = _kv(keys.rollout("w-1"), keys.encode_message(r), 14)
    units = loop.lifecycle_units(decode_state(kvs, 14))
    assert sorted(u.what for u in units) == ["remove w-1-c0", "remove w-1-c1"]  # baseline untouched
    # the canaries are gone; a new rollout wants them again: new incarnations, new ids, so an engine
    # of a removed canary still stopping on a cut-off node is never taken for the new one
    for o in range(2):
        del kvs[keys.instance(f"w-1-c{o}")]
    r2 = rollout(pct=30)
    kvs[keys.rollout("w-1")] = _kv(keys.rollout("w-1"), keys.encode_message(r2), 16)
    units = loop.lifecycle_units(decode_state(kvs, 16))
    assert sorted(u.what for u in units) == ["create w-1-c0-16", "create w-1-c1-16"]


def test_a_removed_ordinal_comes_back_under_a_new_id() -> None:
    w = workload(2)
    kvs = {keys.workload(w.id): _kv(keys.workload(w.id), keys.encode_message(w), 5)}
    loop = SchedulerLoop(None, "r1")  # type: ignore[arg-type]
    first = sorted(u.what for u in loop.lifecycle_units(decode_state(kvs, 5)))
    assert first == ["create w-1-0-5", "create w-1-1-5"]
    # the same snapshot names the same ids (so two deciders collide on Compare.absent) ...
    assert sorted(u.what for u in loop.lifecycle_units(decode_state(kvs, 5))) == first
    inst = workload_pb2.Instance(id="w-1-0-5", workload_id="w-1", ordinal=0, phase="Running")
    kvs[keys.instance(inst.id)] = _kv(keys.instance(inst.id), keys.encode_message(inst), 6)
    inst1 = workload_pb2.Instance(id="w-1-1-5", workload_id="w-1", ordinal=1, phase="Running")
    kvs[keys.instance(inst1.id)] = _kv(keys.instance(inst1.id), keys.encode_message(inst1), 6)
    assert loop.lifecycle_units(decode_state(kvs, 6)) == []
    # ... and after ordinal 0's removal (committed at 9), its successor is a different instance
    del kvs[keys.instance("w-1-0-5")]
    assert [u.what for u in loop.lifecycle_units(decode_state(kvs, 9))] == ["create w-1-0-9"]


def test_gateway_splits_by_weight_and_sticks_per_session() -> None:
    reg = Registry(GatewaySettings(static_endpoints=("w=127.0.0.1:1",)))
    eps = [
        workload_pb2.Endpoint(
            instance_id=f"b{i}", address=f"127.0.0.1:{10 + i}", workload="chat", model="m-old"
        )
        for i in range(3)
    ]
    eps.append(
        workload_pb2.Endpoint(
            instance_id="c0", address="127.0.0.1:20", workload="chat", model="m-new", variant="canary"
        )
    )
    reg.apply_endpoints(eps, 1)
    wl = reg.workloads["chat"]
    assert reg.variant_for(wl, None) == ""  # weight 0 (no rollout in the config): baseline only
    reg.apply_config(
        gateway_pb2.GatewayConfig(canaries=[gateway_pb2.CanaryWeight(workload="chat", weight_pct=10)])
    )
    picks = []
    for _ in range(10_000):
        b = reg.pick(wl, None, [], reg.variant_for(wl, None))
        assert not isinstance(b, str)
        picks.append(b.model)
    share = picks.count("m-new") / len(picks)
    assert 0.085 <= share <= 0.115, share
    sessions = [reg.variant_for(wl, f"s-{i}") for i in range(2000)]
    assert all(reg.variant_for(wl, f"s-{i}") == v for i, v in enumerate(sessions))
    assert 0.07 <= sessions.count("canary") / 2000 <= 0.13
