"""The scheduler's filter and score tables: one ordered stack that the index and the planner both
follow, and a requirement key derived from the requirement's own inputs."""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

from controlplane.scheduler import (
    DeviceView,
    GraphSnapshot,
    NodeView,
    PendingInstance,
    PlanBuilder,
    SchedulerConfig,
    schedule,
)
from controlplane.scheduler.filters import (
    DEVICE_FILTERS,
    FILTERS,
    Depends,
    Requirement,
    RequirementInputs,
    Scope,
    condition_failures,
    requirement_key,
)
from controlplane.scheduler.model import Placement, Unplaced, WorkloadReq
from controlplane.scheduler.scores import (
    SCORES,
    ScoreScope,
    coolness,
    device_part,
    device_parts,
    idle_share,
    node_part,
    profile_part,
)

CONFIG = SchedulerConfig()


def device(node: str, index: int, **kw: object) -> DeviceView:
    base: dict[str, object] = dict(
        name=f"{node}/ascend:{index}", node=node, device_type="ascend", index=index, model="910B",
        hbm_memory_mb=32768, supported_dtypes=("fp16", "bf16"), fp16_tflops=300.0, bf16_tflops=300.0,
        int8_tflops=600.0, p2p_enabled=True, topology_distance=(0, 1), status="Ready",
        utilization_pct=10.0, temperature_c=40.0,
    )  # fmt: skip
    return DeviceView(**{**base, **kw})  # type: ignore[arg-type]


def workload(**kw: object) -> WorkloadReq:
    base: dict[str, object] = dict(
        workload_id="w", name="w", model="m", quantization="none", dtype="fp16",
        devices_per_instance=1, memory_per_device_mb=1000,
    )  # fmt: skip
    return WorkloadReq(**{**base, **kw})  # type: ignore[arg-type]


def test_the_stack_in_order() -> None:
    assert [(f.name, f.scope, f.depends) for f in FILTERS] == [
        ("node-ready", Scope.NODE, None),
        ("node-cordoned", Scope.NODE, None),
        ("device-type", Scope.DEVICE, Depends.PROFILE),
        ("engine", Scope.DEVICE, Depends.PROFILE),
        ("pin", Scope.DEVICE, Depends.DEVICE),
        ("precision", Scope.DEVICE, Depends.PROFILE),
        ("memory", Scope.DEVICE, Depends.PROFILE),
        ("device-ready", Scope.DEVICE, Depends.CONDITION),
        ("temperature", Scope.DEVICE, Depends.CONDITION),
        ("p2p", Scope.GROUP, None),
    ]
    assert [s.name for s in SCORES] == ["spread-binpack", "utilization", "temperature", "compute"]


def test_every_device_filter_fails_with_its_reason_code() -> None:
    req = Requirement.of(
        workload(
            preferred_device_types=("nvidia",), pin="node-b/ascend", memory_per_device_mb=10**6, dtype="bf16"
        )
    )
    bad = device(
        "node-a",
        0,
        device_type="iluvatar",
        status="Unhealthy",
        temperature_c=99.0,
        supported_dtypes=("fp16",),
    )
    for f in DEVICE_FILTERS:
        reason = f.check(bad, CONFIG) if f.depends is Depends.CONDITION else f.check(bad, req)
        assert reason is not None and reason.startswith(f.reason), (f.name, reason)


def test_the_node_quotes_the_group_that_got_furthest() -> None:
    # device 0 fails memory (stage 4), device 1 only temperature (stage 6): the node says TooHot
    node = NodeView(
        "node-a",
        True,
        False,
        (device("node-a", 0, hbm_memory_mb=1000), device("node-a", 1, model="910C", temperature_c=95.0)),
    )
    plan = schedule(
        GraphSnapshot((node,), 1),
        [PendingInstance("i", workload(memory_per_device_mb=2000), 0.0, 0)],
        [],
        CONFIG,
        0.0,
    )
    (u,) = plan.unplaced
    assert isinstance(u, Unplaced) and u.reasons["node-a"].startswith("TooHot (95 C")


def test_requirement_key_is_derived_from_the_requirement_inputs() -> None:
    w = workload(preferred_device_types=("ascend",), pin="ascend", require_p2p=True, devices_per_instance=2)
    # fields that do not decide placement leave the key alone
    assert requirement_key(w) == requirement_key(
        replace(w, workload_id="x", name="y", model="z", priority="low")
    )
    # every input changes it, and the requirement is computed from the key alone
    assert set(RequirementInputs._fields) < {f.name for f in fields(WorkloadReq)}
    changed: dict[str, Any] = dict(
        preferred_device_types=("nvidia",), pin=None, quantization="int8", dtype="bf16",
        memory_per_device_mb=5, devices_per_instance=3, require_p2p=False, engine="template",
    )  # fmt: skip
    assert set(changed) == set(RequirementInputs._fields)
    for field, value in changed.items():
        assert requirement_key(replace(w, **{field: value})) != requirement_key(w), field
    assert Requirement.of(w) == Requirement.from_inputs(RequirementInputs._make(requirement_key(w)))


def test_the_placement_score_is_the_sum_of_the_score_table() -> None:
    d = device("node-a", 0, utilization_pct=30.0, temperature_c=70.0)
    node = NodeView("node-a", True, False, (d,))
    w = workload()
    plan = schedule(GraphSnapshot((node,), 1), [PendingInstance("i", w, 0.0, 0)], [], CONFIG, 0.0)
    (p,) = plan.placements
    req = Requirement.of(w)
    expected = node_part(1, 1, CONFIG) + device_part(d, CONFIG) + profile_part(d, req, {"fp16": 300.0})
    assert isinstance(p, Placement) and p.score == round(expected, 6)
    assert {s.scope for s in SCORES} == set(ScoreScope)


def test_sglang_without_a_device_type_is_kept_off_devices_it_cannot_run_on() -> None:
    ilu = NodeView(
        "node-i", True, False, (device("node-i", 0, device_type="iluvatar", name="node-i/iluvatar:0"),)
    )
    nv = NodeView("node-n", True, False, (device("node-n", 0, device_type="nvidia", name="node-n/nvidia:0"),))
    pending = [
        PendingInstance("s", workload(), 0.0, 0),
        PendingInstance("t", workload(engine="template"), 0.0, 1),
    ]
    # only the Iluvatar node: SGLang waits and says why; a template engine runs there
    plan = schedule(GraphSnapshot((ilu,), 1), pending, [], CONFIG, 0.0)
    assert [(p.instance_id, p.devices) for p in plan.placements] == [("t", ("node-i/iluvatar:0",))]
    (u,) = plan.unplaced
    assert u.instance_id == "s"
    assert u.reasons["node-i"].startswith("UnsupportedEngine (sglang on iluvatar: upstream SGLang")
    # with an NVIDIA node as well, SGLang goes there even though Iluvatar is free
    plan = schedule(GraphSnapshot((ilu, nv), 1), pending[:1], [], CONFIG, 0.0)
    assert [p.devices for p in plan.placements] == [("node-n/nvidia:0",)]


def test_a_node_s_conditions_and_device_scores_follow_the_tables() -> None:
    # the index asks once per node; the answer is the tables' own, device by device
    conditions = [(pos, f) for pos, f in enumerate(DEVICE_FILTERS) if f.depends is Depends.CONDITION]
    assert len(conditions) >= 2
    devices = (
        device("node-a", 0),
        device("node-a", 1, status="Unhealthy", utilization_pct=20.0, temperature_c=99.0),  # the first fails
        device("node-a", 2, temperature_c=99.0),  # only the second
        device("node-a", 3, utilization_pct=80.0, temperature_c=70.0),
    )
    expected = []
    for d in devices:
        failing = [pos for pos, f in conditions if f.check(d, CONFIG) is not None]
        expected.append(failing[0] if failing else None)
    assert expected == [None, conditions[0][0], conditions[1][0], None]
    assert condition_failures(devices, CONFIG) == expected
    assert condition_failures((), CONFIG) == []
    total = [sum(s.weight * s.fn(d, CONFIG) for s in SCORES if s.scope is ScoreScope.DEVICE) for d in devices]
    assert device_parts(devices, CONFIG) == [device_part(d, CONFIG) for d in devices] == total
    assert len(set(total)) == len(total)


def test_device_score_shares_clamp_to_0_1_like_min_max() -> None:
    # idle_share and coolness clamp with comparisons (they run on every device of every snapshot)
    nan, inf = float("nan"), float("inf")
    limit = CONFIG.temperature_limit_c
    for util in (nan, -inf, -50.0, -0.0, 0.0, 0.5, 37.5, 99.999, 100.0, 100.5, 250.0, inf):
        d = device("node-a", 0, utilization_pct=util)
        assert repr(idle_share(d, CONFIG)) == repr(min(1.0, max(0.0, 1.0 - util / 100.0))), util
    for temp in (nan, -inf, -40.0, 0.0, limit - 31, limit - 30, limit - 12.5, limit, limit + 0.5, inf):
        d = device("node-a", 0, temperature_c=temp)
        want = min(1.0, max(0.0, (limit - temp) / 30.0))
        assert repr(coolness(d, CONFIG)) == repr(want), temp


def test_instances_of_one_requirement_share_one_workload_class() -> None:
    # the planner looks a workload record up by identity first; equal requirements still share
    node = NodeView("node-a", True, False, (device("node-a", 0),))
    builder = PlanBuilder(GraphSnapshot((node,), 1), [], CONFIG)
    w = workload()
    first = builder.workload_class(PendingInstance("a", w, 0.0, 0))
    assert builder.workload_class(PendingInstance("b", w, 0.0, 1)) is first
    assert (
        builder.workload_class(PendingInstance("c", replace(w, workload_id="x", priority="low"), 0.0, 2))
        is first
    )
    other = builder.workload_class(PendingInstance("d", replace(w, dtype="bf16"), 0.0, 3))
    assert other is not first and other.req == Requirement.of(replace(w, dtype="bf16"))
    assert builder.workload_class(PendingInstance("e", w, 0.0, 4)) is first
