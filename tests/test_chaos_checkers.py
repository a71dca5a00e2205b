"""The chaos checkers themselves: each gets a clean history (must pass) and one with a planted
violation (must report it). A checker that cannot fail does not count."""

from __future__ import annotations

import math
from pathlib import Path

from chaos.checkers import (
    Observation,
    check_allocations,
    check_convergence,
    check_engines,
    check_fencing,
    check_linearizable,
    check_lost_writes,
    check_serving,
    longest_gap,
    serving_errors,
)
from chaos.history import FAILED, OK, UNKNOWN, ApiOp, FaultRecord, RunHistory, Sample, ServeOp
from chaos.invariants import AllocEvent, LeaderWrite
from chaos.linearizable import check_name

# ------------------------------------------------------------------ 1. allocations


def test_allocations_clean_handover_passes() -> None:
    ev = [
        AllocEvent(10, "node-a/ascend:0", "put", "i-1", 1),
        AllocEvent(12, "node-a/ascend:0", "delete", "", 0),
        AllocEvent(13, "node-a/ascend:0", "put", "i-2", 1),
    ]
    assert check_allocations(ev).ok


def test_allocations_planted_double_allocation_is_reported() -> None:
    ev = [
        AllocEvent(10, "node-a/ascend:0", "put", "i-1", 1),
        AllocEvent(13, "node-a/ascend:0", "put", "i-2", 2),
    ]
    v = check_allocations(ev)
    assert not v.ok
    assert "rev 13" in v.violations[0] and "i-2" in v.violations[0] and "i-1" in v.violations[0]


# ------------------------------------------------------------------ 2. engine ledger


def _eng(
    event: str, inst: str, dev: str, pid: int, mono: int, wall: int, node: str = "node-a"
) -> dict[str, object]:
    return {
        "event": event,
        "node": node,
        "instance": inst,
        "devices": [dev],
        "pid": pid,
        "wall_ms": wall,
        "mono_ns": mono,
        "boot_id": f"boot-{node}",
        "cause": "test",
    }


def test_engines_sequential_on_one_device_pass() -> None:
    led = [
        _eng("start", "i-1", "node-a/ascend:0", 100, 1_000, 1),
        _eng("stop", "i-1", "node-a/ascend:0", 100, 2_000, 2),
        _eng("start", "i-2", "node-a/ascend:0", 101, 3_000, 3),
    ]
    v = check_engines(led, ledger_files=1)
    assert v.ok, v.violations


def test_engines_planted_overlap_on_a_device_is_reported() -> None:
    led = [
        _eng("start", "i-1", "node-a/ascend:0", 100, 1_000, 1),
        _eng("start", "i-2", "node-a/ascend:0", 101, 1_500, 1),
        _eng("stop", "i-1", "node-a/ascend:0", 100, 2_000, 2),
    ]
    v = check_engines(led, ledger_files=1)
    assert not v.ok
    assert "device node-a/ascend:0" in v.violations[0]


def test_engines_same_node_compares_monotonic_not_wall_clock() -> None:
    # the wall clock stepped back: by wall_ms they would overlap, by mono_ns they do not
    led = [
        _eng("start", "i-1", "node-a/ascend:0", 100, 1_000, 500),
        _eng("stop", "i-1", "node-a/ascend:0", 100, 2_000, 600),
        _eng("start", "i-2", "node-a/ascend:0", 101, 3_000, 550),
    ]
    assert check_engines(led, ledger_files=1).ok


def test_engines_planted_two_engines_of_one_instance_across_nodes_is_reported() -> None:
    led = [
        _eng("start", "i-1", "node-a/ascend:0", 100, 1_000, 1_000, node="node-a"),
        _eng("start", "i-1", "node-b/mlu:0", 200, 9, 1_500, node="node-b"),
        _eng("stop", "i-1", "node-a/ascend:0", 100, 5_000, 2_000, node="node-a"),
    ]
    v = check_engines(led, ledger_files=2)
    assert not v.ok and "instance i-1" in v.violations[0]


def test_engines_no_ledger_is_a_failure_not_a_pass() -> None:
    v = check_engines([], ledger_files=0)
    assert not v.ok and "no ledger" in v.summary


# ------------------------------------------------------------------ 3. lost writes


def _op(
    client: int,
    kind: str,
    name: str,
    start: float,
    end: float,
    result: str = OK,
    arg: int | None = None,
    code: str = "",
    read: str | None = None,
) -> ApiOp:
    return ApiOp(client, kind, name, arg, start, end, result, code, read)


def test_lost_writes_clean_and_deleted_pass() -> None:
    ops = [
        _op(1, "submit", "w1", 0, 1, arg=1),
        _op(1, "submit", "w2", 1, 2, arg=0),
        _op(2, "delete", "w2", 3, 4, result=UNKNOWN),
    ]
    assert check_lost_writes(ops, {"w1": "r=1"}).ok


def test_lost_writes_planted_lost_acknowledged_submit_is_reported() -> None:
    ops = [_op(1, "submit", "w1", 0, 1, arg=1), _op(1, "submit", "w2", 1, 2, arg=0)]
    v = check_lost_writes(ops, {"w1": "r=1"})
    assert not v.ok and v.violations[0].startswith("w2:")


# ------------------------------------------------------------------ 4. linearizable


def test_linearizable_sequential_history_passes() -> None:
    ops = [
        _op(1, "submit", "w", 0, 1, arg=1),
        _op(2, "get", "w", 2, 3, read="r=1"),
        _op(1, "scale", "w", 4, 5, arg=2),
        _op(2, "get", "w", 6, 7, read="r=2"),
        _op(1, "delete", "w", 8, 9),
        _op(2, "get", "w", 10, 11, read="deleting"),
        _op(2, "get", "w", 12, 13, read=""),  # the leader finished the delete
        _op(1, "scale", "w", 14, 15, result=FAILED, code="NOT_FOUND", arg=1),
    ]
    assert check_name("w", ops).ok is True


def test_linearizable_concurrent_reads_may_see_either_value() -> None:
    ops = [
        _op(1, "submit", "w", 0, 1, arg=1),
        _op(1, "scale", "w", 2, 10, arg=2),
        _op(2, "get", "w", 3, 4, read="r=2"),
        _op(3, "get", "w", 3, 4, read="r=2"),
        _op(2, "get", "w", 11, 12, read="r=2"),
    ]
    assert check_name("w", ops).ok is True


def test_linearizable_planted_stale_read_is_reported() -> None:
    ops = [
        _op(1, "submit", "w", 0, 1, arg=1),
        _op(1, "scale", "w", 2, 3, arg=2),
        _op(2, "get", "w", 4, 5, read="r=1"),  # the scale was acknowledged before this read began
    ]
    r = check_name("w", ops)
    assert r.ok is False
    assert "get" in r.detail and "'r=1'" in r.detail


def test_linearizable_planted_resurrection_after_delete_is_reported() -> None:
    ops = [
        _op(1, "submit", "w", 0, 1, arg=1),
        _op(1, "delete", "w", 2, 3),
        _op(2, "get", "w", 4, 5, read=""),
        _op(2, "get", "w", 6, 7, read="deleting"),
    ]
    assert check_name("w", ops).ok is False


def test_linearizable_unknown_outcome_may_go_either_way() -> None:
    took = [
        _op(1, "submit", "w", 0, 1, arg=1),
        _op(1, "scale", "w", 2, math.inf, result=UNKNOWN, arg=3),
        _op(2, "get", "w", 5, 6, read="r=3"),
    ]
    did_not = [*took[:2], _op(2, "get", "w", 5, 6, read="r=1")]
    assert check_name("w", took).ok is True
    assert check_name("w", did_not).ok is True


def test_linearizable_failed_call_must_not_take_effect() -> None:
    ops = [
        _op(1, "submit", "w", 0, 1, arg=1),
        _op(1, "scale", "w", 2, 3, result=FAILED, code="INVALID_ARGUMENT", arg=3),
        _op(2, "get", "w", 5, 6, read="r=3"),
    ]
    assert check_name("w", ops).ok is False


def test_linearizable_step_budget_gives_inconclusive_not_pass() -> None:
    # many concurrent unknown scales: exponential without memoisation; a budget of 5 steps is too small
    ops = [_op(1, "submit", "w", 0, 1, arg=1)] + [
        _op(10 + k, "scale", "w", 2, math.inf, result=UNKNOWN, arg=k) for k in range(8)
    ]
    ops.append(_op(2, "get", "w", 3, 4, read="r=7"))
    assert check_name("w", ops, budget=5).ok is None
    assert check_name("w", ops).ok is True
    v = check_linearizable(ops, budget_per_name=5)
    assert not v.ok and "inconclusive" in v.violations[0]


# ------------------------------------------------------------------ 5. fencing


def test_fencing_clean_and_planted_stale_epoch() -> None:
    assert check_fencing([LeaderWrite(10, 5), LeaderWrite(20, 19), LeaderWrite(21, 19)]).ok
    v = check_fencing([LeaderWrite(10, 5), LeaderWrite(20, 19), LeaderWrite(22, 5)])
    assert not v.ok and "rev 22" in v.violations[0] and "epoch 5" in v.violations[0]


# ------------------------------------------------------------------ 6. convergence


def _obs(t: float, views: dict[str, str], pending: int, gw: dict[str, frozenset[str] | None]) -> Observation:
    return Observation(t, views, pending, frozenset({"w=10.0.0.1:1"}), gw)


def test_convergence_within_bound_passes() -> None:
    good = frozenset({"w=10.0.0.1:1"})
    obs = [
        _obs(10, {"r1": "a", "r2": "b"}, 0, {"g1": good}),
        _obs(12, {"r1": "a", "r2": "a"}, 0, {"g1": good}),
    ]
    v = check_convergence(obs, last_heal=9, bound_s=30)
    assert v.ok, v.violations


def test_convergence_planted_stale_gateway_is_reported() -> None:
    stale = frozenset({"w=10.0.0.1:1", "w=10.0.0.2:1"})
    obs = [_obs(t, {"r1": "a", "r2": "a"}, 0, {"g1": stale}) for t in (10, 20, 40)]
    v = check_convergence(obs, last_heal=9, bound_s=30)
    assert not v.ok and "gateway g1" in v.violations[0] and "10.0.0.2" in v.violations[0]


def test_convergence_too_late_is_a_failure() -> None:
    good = frozenset({"w=10.0.0.1:1"})
    obs = [_obs(10, {"r1": "a"}, 1, {"g1": good}), _obs(50, {"r1": "a"}, 0, {"g1": good})]
    assert not check_convergence(obs, last_heal=9, bound_s=30).ok


# ------------------------------------------------------------------ 7. serving


def test_serving_errors_counted_per_fault_kind_and_gateway_only_errors_fail() -> None:
    faults = [FaultRecord("gateway-kill", "gateway-1", 10, 20), FaultRecord("partition", "etcd", 30, 40)]
    serve = [
        ServeOp(5, 5.1, False, True, "gateway-1", 1),
        ServeOp(12, 12.1, False, True, "gateway-2", 2),
        ServeOp(32, 32.1, True, False, "gateway-2", 3, "reset"),
    ]
    table = serving_errors(serve, faults)
    assert table["none"]["requests"] == 1 and table["partition"]["stream_errors"] == 1
    assert check_serving(serve, faults).ok
    planted = [*serve, ServeOp(15, 15.5, False, False, "gateway-3", 3, "connection refused")]
    v = check_serving(planted, faults)
    assert not v.ok and "gateway-kill" in v.violations[0]


def test_serving_with_no_requests_is_not_a_pass() -> None:
    assert not check_serving([], []).ok


def test_longest_gap_measures_unavailability() -> None:
    calls = [(1.0, True), (2.0, False), (3.0, False), (6.0, True), (7.0, True)]
    assert longest_gap(calls) == (5.0, 1.0)


def test_history_round_trips_through_jsonl(tmp_path: Path) -> None:
    h = RunHistory(
        api=[_op(1, "scale", "w", 2, math.inf, result=UNKNOWN, arg=3)],
        serve=[ServeOp(1, 2, True, False, "g", 2, "x")],
        faults=[FaultRecord("agent-pause", "node-a", 1, 9, "SIGSTOP")],
        samples=[Sample(1.0, "replica-1", 2, 3)],
        last_heal=9,
    )
    h.write(tmp_path / "h.jsonl")
    back = RunHistory.read(tmp_path / "h.jsonl")
    assert back.api == h.api and back.serve == h.serve and back.faults == h.faults
    assert back.samples == h.samples and back.last_heal == 9


def test_fault_schedule_is_reproducible_from_its_seed_and_covers_every_kind() -> None:
    import random

    from chaos.faults import KINDS, schedule

    a = schedule(random.Random(5), 20)
    assert a == schedule(random.Random(5), 20)
    assert a != schedule(random.Random(6), 20)
    assert len(a) == 20 and set(a[: len(KINDS)]) == set(KINDS)


def test_linearizable_ignores_calls_of_other_apis() -> None:
    ops = [
        _op(1, "submit", "w", 0, 1, arg=1),
        _op(100, "rollout-create", "w", 2, 3),
        _op(100, "rollout-abort", "w", 4, 5, result=FAILED, code="NOT_FOUND"),
        _op(2, "get", "w", 6, 7, read="r=1"),
    ]
    assert check_name("w", ops).ok is True


def test_first_violation_context_names_the_calls_revisions_and_faults_around_it() -> None:
    from chaos.checkers import Verdict
    from chaos.etcdhist import EtcdHistory
    from chaos.runner import context_for

    ops = [
        _op(1, "submit", "w", 0, 1, arg=1),
        _op(1, "scale", "w", 2, 3, arg=0),
        _op(2, "get", "w", 4, 5, read="r=1"),
    ]
    h = RunHistory(api=ops, faults=[FaultRecord("partition", "etcd-1+replica-1", 1, 6)])
    lin = check_linearizable(ops)
    ctx = context_for(lin, EtcdHistory(), h)
    assert any("scale(0) w" in line for line in ctx) and any("partition" in line for line in ctx)
    eh = EtcdHistory(allocs=[AllocEvent(40, "node-a/ascend:0", "put", "i-1", 1)], leaders=[(38, "replica-2")])
    alloc = Verdict("allocations", False, "", ["rev 42: node-a/ascend:0 given to i-2 while held by i-1"])
    ctx = context_for(alloc, eh, h)
    assert "rev 40: put node-a/ascend:0 -> i-1" in ctx and "rev 38: leader replica-2" in ctx
