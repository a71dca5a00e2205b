"""schedule() on hand-built graphs: filters and their reasons, topology, scoring, preemption."""

from __future__ import annotations

import random
from dataclasses import replace
from itertools import combinations
from typing import Any

import pytest

from controlplane.scheduler import (
    DeviceView,
    GraphSnapshot,
    NodeView,
    PendingInstance,
    Placement,
    Plan,
    RunningInstance,
    SchedulerConfig,
    Unplaced,
    WorkloadReq,
    order_pending,
    schedule,
)
from controlplane.scheduler.filters import FILTERS, Depends, Requirement, Scope
from controlplane.scheduler.scores import SCORES, ScoreScope, is_busy, set_distance, tflops
from kunlun_common.names import device_name

ASCEND_ROWS = ((0, 1, 2, 2), (1, 0, 2, 2), (2, 2, 0, 1), (2, 2, 1, 0))
NODE_B_ROWS = ((0, 1, 3), (1, 0, 3), (3, 3, 0))
CONFIG = SchedulerConfig()


DEVICE_DEFAULTS: dict[str, Any] = dict(
    model="910B", hbm_memory_mb=32768, supported_dtypes=("fp16", "bf16", "int8"), fp16_tflops=300.0,
    bf16_tflops=300.0, int8_tflops=600.0, p2p_enabled=True, status="Ready", utilization_pct=0.0, temperature_c=40.0
)  # fmt: skip


def dev(node: str, device_type: str, index: int, row: tuple[int, ...], **kw: Any) -> DeviceView:
    name = device_name(node, device_type, index)
    fields = {**DEVICE_DEFAULTS, **kw}
    return DeviceView(name, node, device_type, index, topology_distance=row, **fields)


def mixed_server(
    changes: dict[str, dict[str, Any]] | None = None, **node_changes: dict[str, Any]
) -> GraphSnapshot:
    """node-a: 4 ascend 910B (32 GB); node-b: 2 cambricon MLU370 (48 GB) and 1 nvidia A100 (40 GB)."""
    node_a = [dev("node-a", "ascend", i, ASCEND_ROWS[i]) for i in range(4)]
    mlu = dict(model="MLU370", hbm_memory_mb=49152, fp16_tflops=96.0, bf16_tflops=96.0, int8_tflops=256.0)
    node_b = [
        dev("node-b", "cambricon", 0, NODE_B_ROWS[0], **mlu),
        dev("node-b", "cambricon", 1, NODE_B_ROWS[1], **mlu),
        dev("node-b", "nvidia", 0, NODE_B_ROWS[2], model="A100", hbm_memory_mb=40960, fp16_tflops=312.0),
    ]
    changes = changes or {}
    nodes = []
    for name, devices in (("node-a", node_a), ("node-b", node_b)):
        devs = tuple(replace(d, **changes.get(d.name, {})) for d in devices)
        node = NodeView(name=name, ready=True, cordoned=False, devices=devs)
        nodes.append(replace(node, **node_changes.get(name.replace("-", "_"), {})))
    return GraphSnapshot(nodes=tuple(nodes), revision=42)


def uniform(nodes: int, per_node: int, changes: dict[str, dict[str, Any]] | None = None) -> GraphSnapshot:
    """`nodes` nodes n0, n1... of `per_node` identical ascend devices, distance 1 between all."""
    changes = changes or {}
    out = []
    for n in range(nodes):
        name = f"n{n}"
        devs = tuple(
            replace(
                dev(name, "ascend", i, tuple(0 if j == i else 1 for j in range(per_node))),
                **changes.get(device_name(name, "ascend", i), {}),
            )
            for i in range(per_node)
        )
        out.append(NodeView(name=name, ready=True, cordoned=False, devices=devs))
    return GraphSnapshot(nodes=tuple(out), revision=1)


def wl(**kw: Any) -> WorkloadReq:
    base: dict[str, Any] = dict(
        workload_id="w1", name="llama3-8b", model="meta-llama/Meta-Llama-3-8B", quantization="none",
        dtype="fp16", devices_per_instance=1, memory_per_device_mb=16000,
    )  # fmt: skip
    return WorkloadReq(**{**base, **kw})


def pend(instance_id: str, workload: WorkloadReq, seq: int = 0) -> PendingInstance:
    return PendingInstance(instance_id=instance_id, workload=workload, enqueued_at=float(seq), seq=seq)


def run(graph: GraphSnapshot, *pending: PendingInstance, config: SchedulerConfig = CONFIG, **kw: Any) -> Plan:
    return schedule(graph, list(pending), kw.pop("running", []), config, now=1000.0, **kw)


def only_placement(plan: Plan) -> Placement:
    assert plan.unplaced == ()
    assert len(plan.placements) == 1
    return plan.placements[0]


def only_unplaced(plan: Plan) -> Unplaced:
    assert plan.placements == ()
    assert len(plan.unplaced) == 1
    return plan.unplaced[0]


def alloc(*names: str, to: str = "other") -> dict[str, dict[str, Any]]:
    return {n: {"allocated_to": to} for n in names}


# --- mixed server -----------------------------------------------------------------------------------


def test_plan_carries_clock_and_revision() -> None:
    plan = run(mixed_server(), pend("i1", wl()))
    assert (plan.decided_at, plan.graph_revision) == (1000.0, 42)


def test_pin_type_and_index_lands_on_that_device() -> None:
    p = only_placement(run(mixed_server(), pend("i1", wl(pin="ascend:0"))))
    assert (p.node, p.devices, p.preempts) == ("node-a", ("node-a/ascend:0",), ())


@pytest.mark.parametrize(
    ("pin", "device"),
    [
        ("node-b/nvidia:0", "node-b/nvidia:0"),
        ("ascend:3", "node-a/ascend:3"),
        ("cambricon", "node-b/cambricon:0"),
    ],
)
def test_pin_forms(pin: str, device: str) -> None:
    assert only_placement(run(mixed_server(), pend("i1", wl(pin=pin)))).devices == (device,)


def test_pinned_device_taken_reports_per_node() -> None:
    u = only_unplaced(run(mixed_server(alloc("node-a/ascend:0")), pend("i1", wl(pin="ascend:0"))))
    assert dict(u.reasons) == {"node-a": "NoFreeDevice", "node-b": "PinMismatch"}


def test_seven_devices_then_no_free_device_everywhere() -> None:
    workloads = [wl(workload_id=f"w{k}", name=f"model-{k}", memory_per_device_mb=16000 + k) for k in range(8)]
    plan = run(mixed_server(), *(pend(f"i{k}", w, seq=k) for k, w in enumerate(workloads)))
    all_seven = [f"node-a/ascend:{i}" for i in range(4)] + ["node-b/cambricon:0", "node-b/cambricon:1"]
    assert sorted(d for p in plan.placements for d in p.devices) == [*all_seven, "node-b/nvidia:0"]
    assert [p.instance_id for p in plan.placements] == [f"i{k}" for k in range(7)]
    assert [(u.instance_id, dict(u.reasons)) for u in plan.unplaced] == [
        ("i7", {"node-a": "NoFreeDevice", "node-b": "NoFreeDevice"})
    ]


def test_int8_prefers_cambricon_then_ascend() -> None:
    w = wl(quantization="int8", preferred_device_types=("cambricon", "ascend"))
    assert only_placement(run(mixed_server(), pend("i1", w))).devices == ("node-b/cambricon:0",)
    full = mixed_server(alloc("node-b/cambricon:0", "node-b/cambricon:1"))
    p = only_placement(run(full, pend("i1", w)))
    assert p.devices == ("node-a/ascend:0",)


def test_preferred_type_beats_spread_within_one_plan() -> None:
    w = wl(quantization="int8", preferred_device_types=("cambricon", "ascend"))
    plan = run(mixed_server(), *(pend(f"i{k}", w, seq=k) for k in range(3)))
    expected = ["node-b/cambricon:0", "node-b/cambricon:1", "node-a/ascend:0"]
    assert [p.devices[0] for p in plan.placements] == expected


def test_fp16_only_device_refuses_int8_with_reason() -> None:
    graph = mixed_server({f"node-b/cambricon:{i}": {"supported_dtypes": ("fp16",)} for i in range(2)})
    u = only_unplaced(run(graph, pend("i1", wl(quantization="int8", preferred_device_types=("cambricon",)))))
    assert dict(u.reasons) == {
        "node-a": "CardTypeMismatch",
        "node-b": "UnsupportedDtype (int8 not in [fp16])",
    }


def test_w8a8_accepts_int8_devices_and_fp8_needs_fp8() -> None:
    assert only_placement(run(mixed_server(), pend("i1", wl(quantization="w8a8", pin="node-b/nvidia:0"))))
    u = only_unplaced(run(mixed_server(), pend("i1", wl(quantization="fp8", pin="node-b/nvidia:0"))))
    assert dict(u.reasons) == {
        "node-a": "PinMismatch",
        "node-b": "UnsupportedDtype (fp8 not in [fp16, bf16, int8])",
    }


def test_two_devices_get_the_closest_pair() -> None:
    w = wl(devices_per_instance=2, preferred_device_types=("ascend",))
    p = only_placement(run(mixed_server(), pend("i1", w)))
    assert p.devices == ("node-a/ascend:0", "node-a/ascend:1")
    p = only_placement(run(mixed_server(alloc("node-a/ascend:0")), pend("i1", w)))
    assert p.devices == ("node-a/ascend:2", "node-a/ascend:3")


def test_multi_device_sets_never_mix_types() -> None:
    graph = mixed_server(alloc("node-b/cambricon:1"), node_a={"cordoned": True})
    u = only_unplaced(run(graph, pend("i1", wl(devices_per_instance=2))))
    assert dict(u.reasons) == {"node-a": "NodeCordoned", "node-b": "NoFreeDevice"}


def test_five_devices_unplaced_with_per_node_reasons() -> None:
    u = only_unplaced(run(mixed_server(), pend("i1", wl(devices_per_instance=5))))
    assert dict(u.reasons) == {
        "node-a": "InsufficientDevices (needs 5, 4 on node)",
        "node-b": "InsufficientDevices (needs 5, 2 on node)",
    }


def test_require_p2p_reports_no_p2p_group() -> None:
    graph = mixed_server(
        {"node-a/ascend:0": {"p2p_enabled": False}, "node-a/ascend:1": {"p2p_enabled": False}}
    )
    w = wl(devices_per_instance=3, require_p2p=True, preferred_device_types=("ascend",))
    u = only_unplaced(run(graph, pend("i1", w)))
    assert dict(u.reasons) == {"node-a": "NoP2PGroup", "node-b": "CardTypeMismatch"}
    w2 = replace(w, devices_per_instance=2)
    assert only_placement(run(graph, pend("i1", w2))).devices == ("node-a/ascend:2", "node-a/ascend:3")


def test_memory_reasons_quote_the_largest_device() -> None:
    p = only_placement(run(mixed_server(), pend("i1", wl(memory_per_device_mb=45000))))
    assert p.devices == ("node-b/cambricon:0",)
    u = only_unplaced(run(mixed_server(), pend("i1", wl(memory_per_device_mb=50000))))
    assert dict(u.reasons) == {
        "node-a": "InsufficientMemory (needs 50000 MB, 32768 free)",
        "node-b": "InsufficientMemory (needs 50000 MB, 49152 free)",
    }


def test_node_and_device_condition_reasons() -> None:
    graph = mixed_server({"node-b/nvidia:0": {"status": "Unhealthy"}}, node_a={"ready": False})
    u = only_unplaced(run(graph, pend("i1", wl(preferred_device_types=("nvidia",)))))
    assert dict(u.reasons) == {"node-a": "NodeNotReady", "node-b": "DeviceNotReady"}


def test_hot_device_excluded_and_reported() -> None:
    graph = mixed_server({"node-a/ascend:0": {"temperature_c": 91.0}})
    u = only_unplaced(run(graph, pend("i1", wl(pin="ascend:0"))))
    assert dict(u.reasons) == {"node-a": "TooHot (91 C > 85 C)", "node-b": "PinMismatch"}
    placed = run(graph, *(pend(f"i{k}", wl(preferred_device_types=("ascend",)), seq=k) for k in range(4)))
    assert sorted(p.devices[0] for p in placed.placements) == [f"node-a/ascend:{i}" for i in (1, 2, 3)]
    assert dict(placed.unplaced[0].reasons) == {"node-a": "NoFreeDevice", "node-b": "CardTypeMismatch"}


def test_device_at_the_limit_is_too_hot_and_cooler_devices_win() -> None:
    graph = uniform(1, 3, {"n0/ascend:0": {"temperature_c": 85.0}, "n0/ascend:1": {"temperature_c": 80.0}})
    assert only_placement(run(graph, pend("i1", wl()))).devices == ("n0/ascend:2",)
    u = only_unplaced(run(graph, pend("i1", wl(pin="ascend:0"))))
    assert dict(u.reasons) == {"n0": "TooHot (85 C >= 85 C)"}


def test_busy_devices_only_when_nothing_else_fits() -> None:
    busy = {device_name("n0", "ascend", i): {"utilization_pct": 95.0} for i in range(3)}
    busy["n0/ascend:3"] = {"utilization_pct": 81.0}
    busy["n1/ascend:0"] = {"utilization_pct": 10.0}
    busy["n1/ascend:1"] = {"utilization_pct": 99.0}
    graph = uniform(2, 4, busy)
    plan = run(graph, *(pend(f"i{k}", wl(), seq=k) for k in range(4)))
    # n1's idle devices go first although spread favours n0 (4 free); then the least busy of n0.
    expected = ["n1/ascend:2", "n1/ascend:3", "n1/ascend:0", "n0/ascend:3"]
    assert [p.devices[0] for p in plan.placements] == expected


def test_spread_and_binpack() -> None:
    graph = uniform(2, 4, alloc("n0/ascend:0", "n0/ascend:1"))
    spread = only_placement(run(graph, pend("i1", wl())))
    binpack = only_placement(run(graph, pend("i1", wl()), config=SchedulerConfig(policy="binpack")))
    assert (spread.devices, binpack.devices) == (("n1/ascend:0",), ("n0/ascend:2",))
    plan = run(uniform(2, 4), *(pend(f"i{k}", wl(), seq=k) for k in range(4)))
    assert [p.node for p in plan.placements] == ["n0", "n1", "n0", "n1"]
    four = [pend(f"i{k}", wl(), seq=k) for k in range(4)]
    plan = run(uniform(2, 4), *four, config=SchedulerConfig(policy="binpack"))
    assert [p.node for p in plan.placements] == ["n0", "n0", "n0", "n0"]


def test_compute_power_for_the_workload_precision() -> None:
    graph = uniform(1, 2, {"n0/ascend:1": {"bf16_tflops": 400.0}})
    assert only_placement(run(graph, pend("i1", wl(dtype="bf16")))).devices == ("n0/ascend:1",)
    assert only_placement(run(graph, pend("i1", wl(dtype="fp16")))).devices == ("n0/ascend:0",)


def test_greedy_sets_on_large_nodes_stay_on_one_node() -> None:
    rows = {
        device_name("n0", "ascend", i): {"topology_distance": tuple(abs(i - j) for j in range(16))}
        for i in range(16)
    }
    graph = uniform(1, 16, rows)
    p = only_placement(run(graph, pend("i1", wl(devices_per_instance=6))))
    assert p.devices == tuple(f"n0/ascend:{i}" for i in range(6))


def test_max_placements_stops_early() -> None:
    plan = run(uniform(2, 4), *(pend(f"i{k}", wl(), seq=k) for k in range(6)), max_placements=3)
    assert ([p.instance_id for p in plan.placements], plan.unplaced) == (["i0", "i1", "i2"], ())


def test_invalid_input_refused() -> None:
    with pytest.raises(ValueError, match="duplicate instance_id"):
        run(uniform(1, 1), pend("i1", wl()), pend("i1", wl(), seq=1))
    with pytest.raises(ValueError, match="workload w1: devices_per_instance must be >= 1"):
        wl(devices_per_instance=0)


# --- queue order in placements ----------------------------------------------------------------------


def test_contention_follows_the_weights() -> None:
    pending = [
        pend(f"{prio}-{k}", wl(priority=prio), seq=100 * i + k)
        for i, prio in enumerate(("low", "normal", "high"))
        for k in range(30)
    ]
    plan = run(uniform(1, 13), *pending)
    placed = [p.instance_id.split("-")[0] for p in plan.placements]
    assert (placed.count("high"), placed.count("normal"), placed.count("low")) == (9, 3, 1)


def test_low_is_not_starved_by_a_long_high_backlog() -> None:
    pending = [pend(f"high-{k}", wl(priority="high"), seq=k) for k in range(1000)]
    pending += [pend(f"low-{k}", wl(priority="low"), seq=1000 + k) for k in range(100)]
    placed_low = 0
    for _ in range(10):  # ten rounds of ten free devices
        plan = run(uniform(1, 10), *pending)
        done = {p.instance_id for p in plan.placements}
        placed_low += sum(1 for i in done if i.startswith("low"))
        pending = [p for p in pending if p.instance_id not in done]
    assert placed_low == 10


# --- preemption -------------------------------------------------------------------------------------


def _busy_node_a() -> tuple[GraphSnapshot, list[RunningInstance]]:
    running = [
        RunningInstance("r-low-old", wl(priority="low"), ("node-a/ascend:0",), started_at=100.0),
        RunningInstance(
            "r-low-new",
            wl(priority="low", devices_per_instance=2),
            ("node-a/ascend:1", "node-a/ascend:2"),
            200.0,
        ),
        RunningInstance("r-normal", wl(priority="normal"), ("node-a/ascend:3",), started_at=300.0),
        RunningInstance("r-high", wl(priority="high"), ("node-b/cambricon:0",), started_at=50.0),
    ]
    changes: dict[str, dict[str, Any]] = {}
    for r in running:
        changes.update(alloc(*r.devices, to=r.instance_id))
    changes.update(alloc("node-b/cambricon:1", "node-b/nvidia:0", to="unknown"))
    return mixed_server(changes), running


def test_preemption_picks_fewest_victims() -> None:
    graph, running = _busy_node_a()
    w = wl(priority="high", devices_per_instance=2, preferred_device_types=("ascend",))
    p = only_placement(run(graph, pend("h1", w), running=running))
    assert (p.devices, p.preempts) == (("node-a/ascend:1", "node-a/ascend:2"), ("r-low-new",))


def test_preemption_ties_lowest_priority_then_newest() -> None:
    graph, running = _busy_node_a()
    p = only_placement(
        run(graph, pend("h1", wl(priority="high", preferred_device_types=("ascend",))), running=running)
    )
    assert (p.devices, p.preempts) == (("node-a/ascend:1",), ("r-low-new",))
    older_first = [replace(r, started_at=1000.0) if r.instance_id == "r-low-old" else r for r in running]
    p = only_placement(run(graph, pend("h1", wl(priority="high")), running=older_first))
    assert (p.devices, p.preempts) == (("node-a/ascend:0",), ("r-low-old",))


def test_preemption_evicts_several_when_needed() -> None:
    graph, running = _busy_node_a()
    w = wl(priority="high", devices_per_instance=4, preferred_device_types=("ascend",))
    p = only_placement(run(graph, pend("h1", w), running=running))
    assert p.preempts == ("r-low-new", "r-low-old", "r-normal")
    assert p.devices == tuple(f"node-a/ascend:{i}" for i in range(4))


def test_devices_freed_by_preemption_are_not_reused_in_the_same_plan() -> None:
    graph, running = _busy_node_a()
    h1 = pend("h1", wl(priority="high", preferred_device_types=("ascend",)))
    h2 = pend("h2", wl(priority="high", pin="node-a/ascend:2"), seq=1)
    plan = run(graph, h1, h2, running=running)
    assert [(p.instance_id, p.devices, p.preempts) for p in plan.placements] == [
        ("h1", ("node-a/ascend:1",), ("r-low-new",))
    ]
    assert [(u.instance_id, dict(u.reasons)) for u in plan.unplaced] == [
        ("h2", {"node-a": "NoFreeDevice", "node-b": "PinMismatch"})
    ]


def test_no_preemption_for_normal_or_of_equal_priority() -> None:
    graph, running = _busy_node_a()
    u = only_unplaced(run(graph, pend("n1", wl(priority="normal")), running=running))
    assert dict(u.reasons) == {"node-a": "NoFreeDevice", "node-b": "NoFreeDevice"}
    u = only_unplaced(run(graph, pend("h1", wl(priority="high", pin="node-b/cambricon:0")), running=running))
    assert dict(u.reasons) == {"node-a": "PinMismatch", "node-b": "NoFreeDevice"}
    enabled = SchedulerConfig(preemption_enabled_for=("high", "normal"))
    p = only_placement(run(graph, pend("n1", wl(priority="normal")), running=running, config=enabled))
    assert p.preempts == ("r-low-new",)


# --- determinism, invariants, and the indexes agree with a brute-force scan -----------------------------


def _reference(graph: GraphSnapshot, pending: list[PendingInstance], config: SchedulerConfig) -> list[object]:
    """Greedy placement by scanning every device subset of every node for every instance, running
    every line of the filter and score tables on every device (no profiles, groups or pools)."""
    best_tflops = {m: max(tflops(d, m) for d in graph.devices()) for m in ("fp16", "bf16", "int8")}
    widest = max(len(n.devices) for n in graph.nodes)
    taken: set[str] = set()
    out: list[object] = []
    for inst in order_pending(pending, config.priority_weights):
        req = Requirement.of(inst.workload)
        best: tuple[tuple[object, ...], tuple[str, ...]] | None = None
        for node in graph.nodes:
            if any(f.check(node, config) for f in FILTERS if f.scope is Scope.NODE):
                continue
            free = [d.allocated_to is None and d.name not in taken for d in node.devices]
            conditions = [f for f in FILTERS if f.depends is Depends.CONDITION]
            ready = [not any(f.check(d, config) for f in conditions) for d in node.devices]
            free_count = sum(f and r for f, r in zip(free, ready, strict=True))
            ok = [
                pos
                for pos, d in enumerate(node.devices)
                if free[pos]
                and not any(
                    f.check(d, config) if f.depends is Depends.CONDITION else f.check(d, req)
                    for f in FILTERS
                    if f.scope is not Scope.NODE
                )
            ]
            for positions in combinations(ok, req.devices):
                devs = [node.devices[p] for p in positions]
                if len({d.device_type for d in devs}) > 1:
                    continue
                own = [
                    sum(s.weight * s.fn(d, config) for s in SCORES if s.scope is ScoreScope.DEVICE)
                    + sum(
                        s.weight * s.fn(d, req, best_tflops) for s in SCORES if s.scope is ScoreScope.PROFILE
                    )
                    for d in devs
                ]
                node_part = sum(
                    s.weight * s.fn(free_count, widest, config) for s in SCORES if s.scope is ScoreScope.NODE
                )
                score = node_part + sum(own) / len(own)
                key = (
                    max(int(is_busy(d.utilization_pct, config.min_gpu_utilization_threshold)) for d in devs),
                    req.rank_of(devs[0].device_type),
                    set_distance([d.topology_distance for d in node.devices], positions),
                    -score,
                    node.name,
                    positions,
                )
                if best is None or key < best[0]:
                    best = key, tuple(d.name for d in devs)
        if best is None:
            out.append(inst.instance_id)
        else:
            taken.update(best[1])
            out.append((inst.instance_id, best[1]))
    return out


def _mixed_random(seed: int) -> tuple[GraphSnapshot, list[PendingInstance]]:
    rng = random.Random(seed)
    nodes = []
    for n in range(8):
        name = f"n{n}"
        kinds = rng.choice((("ascend",), ("cambricon", "nvidia"), ("ascend", "nvidia")))
        types = sorted(rng.choice(kinds) for _ in range(6))
        devices = tuple(
            dev(
                name,
                t,
                types[:i].count(t),
                tuple(rng.choice((1, 2)) if j != i else 0 for j in range(6)),
                supported_dtypes=rng.choice((("fp16", "bf16", "int8"), ("fp16",))),
                hbm_memory_mb=rng.choice((32768, 65536)),
                int8_tflops=rng.choice((300.0, 600.0)),
                p2p_enabled=rng.random() < 0.8,
                status=rng.choice(("Ready",) * 9 + ("Error",)),
                utilization_pct=rng.choice((0.0, 25.0, 50.0, 87.5)),
                temperature_c=rng.choice((40.0, 70.0, 70.0, 40.0, 90.0)),
                allocated_to=rng.choice((None, None, None, None, "x")),
            )
            for i, t in enumerate(types)
        )
        nodes.append(
            NodeView(name=name, ready=rng.random() < 0.9, cordoned=rng.random() < 0.1, devices=devices)
        )
    pending = [
        pend(
            f"i{k}",
            wl(
                priority=rng.choice(("high", "normal", "low")),
                devices_per_instance=rng.choice((1, 1, 1, 2, 3)),
                memory_per_device_mb=rng.choice((16000, 16000, 40000)),
                quantization=rng.choice(("none", "none", "int8")),
                preferred_device_types=rng.choice(((), ("nvidia", "ascend"), ("cambricon",))),
                pin=rng.choice((None,) * 8 + ("ascend:0", "n3/nvidia")),
                require_p2p=rng.random() < 0.3,
            ),
            seq=k,
        )
        for k in range(30)
    ]
    return GraphSnapshot(nodes=tuple(nodes), revision=1), pending


@pytest.mark.parametrize("policy", ["spread", "binpack"])
@pytest.mark.parametrize("seed", range(12))
def test_indexes_match_brute_force_and_plans_are_deterministic(seed: int, policy: str) -> None:
    graph, pending = _mixed_random(seed)
    config = SchedulerConfig(policy=policy)
    plan = run(graph, *pending, config=config)
    got: dict[str, object] = {p.instance_id: (p.instance_id, p.devices) for p in plan.placements}
    got.update({u.instance_id: u.instance_id for u in plan.unplaced})
    ordered = [p.instance_id for p in order_pending(pending, config.priority_weights)]
    assert [got[i] for i in ordered] == _reference(graph, pending, config)

    shuffled = pending[:]
    random.Random(seed).shuffle(shuffled)
    assert run(graph, *shuffled, config=config) == plan  # same input (in any order) -> same plan
    used = [d for p in plan.placements for d in p.devices]
    assert len(used) == len(set(used))
    for p in plan.placements:
        assert all(p.node == d.split("/")[0] and graph.device(d) is not None for d in p.devices)


def _full_with_running(seed: int) -> tuple[GraphSnapshot, list[PendingInstance], list[RunningInstance]]:
    graph, pending = _mixed_random(seed)
    rng = random.Random(seed)
    running: list[RunningInstance] = []
    nodes = []
    for node in graph.nodes:  # every free device goes to a running instance of 1 or 2 devices
        devs = list(node.devices)
        free = [i for i, d in enumerate(devs) if d.allocated_to is None]
        while free:
            held = tuple(devs[free.pop(0)].name for _ in range(min(len(free), rng.choice((1, 2)))))
            prio = rng.choice(("high", "normal", "low"))
            running.append(RunningInstance(f"r{len(running)}", wl(priority=prio), held, rng.random()))
            devs = [replace(d, allocated_to=running[-1].instance_id) if d.name in held else d for d in devs]
        nodes.append(replace(node, devices=tuple(devs)))
    return GraphSnapshot(tuple(nodes), 2), pending, running


@pytest.mark.parametrize("seed", range(10))
def test_preemption_evicts_a_minimal_set_of_lower_priority_instances(seed: int) -> None:
    full, pending, running = _full_with_running(seed)
    lower = {r.instance_id: r for r in running if r.workload.priority != "high"}
    for inst in pending:
        high = replace(inst, workload=replace(inst.workload, priority="high"))
        plan = run(full, high, running=running)
        if not plan.placements:
            continue
        p = plan.placements[0]
        assert p.preempts and set(p.preempts) <= set(lower)
        assert all(set(lower[v].devices) & set(p.devices) for v in p.preempts)  # each victim is used
        assert set(p.devices) <= {d for v in p.preempts for d in lower[v].devices}
        for size in range(1, len(p.preempts)):  # no smaller set of victims on any node would do
            for node in full.nodes:
                on_node = [r for r in lower.values() if r.devices[0].startswith(node.name + "/")]
                for combo in combinations(on_node, size):
                    freed = {d for r in combo for d in r.devices}
                    opened = tuple(
                        replace(d, allocated_to=None) if d.name in freed else d for d in node.devices
                    )
                    alone = GraphSnapshot((replace(node, devices=opened),), 3)
                    assert run(alone, high).placements == ()
