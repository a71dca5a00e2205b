"""Decision throughput and latency of the pure scheduler (`schedule()`; no etcd, no I/O).

For each cluster size (nodes x 8 devices, four device types) it queues single-device instances of
40 workloads (mixed priorities, preferred types, precisions and memory) and prints:

- schedule(): one call deciding the whole queue: wall time, decisions/s and placements/s;
- per decision: p50/p99/max of `PlanBuilder.decide()` over the same queue (the index is built once
  per call and reported apart, as is the weighted-fair ordering of the queue);
- commit-sized: one `schedule(max_placements=50)` call, index build and ordering included, i.e.
  what the leader pays to recompute after a rejected commit.

Usage: python -m bench.scheduler_decisions [--nodes 100 1000] [--queue 10000] [--seed 1]
"""

from __future__ import annotations

import argparse
import math
import random
import time
from collections.abc import Sequence

from controlplane.scheduler import (
    DeviceView,
    GraphSnapshot,
    NodeView,
    PendingInstance,
    Placement,
    PlanBuilder,
    SchedulerConfig,
    WorkloadReq,
    order_pending,
    schedule,
)
from kunlun_common.names import device_name
from kunlun_common.states import DeviceState

DEVICES_PER_NODE = 8
# type, model, HBM MB, dtypes, fp16, bf16, int8 TFLOPS
KINDS = (
    ("ascend", "910B", 65536, ("fp16", "bf16", "int8"), 320.0, 320.0, 640.0),
    ("cambricon", "MLU370", 49152, ("fp16", "bf16", "int8"), 96.0, 96.0, 256.0),
    ("hygon", "K100", 65536, ("fp16", "bf16", "int8"), 196.0, 196.0, 392.0),
    ("nvidia", "A100", 81920, ("fp16", "bf16", "int8", "fp8"), 312.0, 312.0, 624.0),
)


def build_graph(nodes: int, rng: random.Random) -> GraphSnapshot:
    """`nodes` nodes of 8 devices of one type each; a few busy, hot, unhealthy or cordoned."""
    rows = [tuple(0 if i == j else (1 if i // 4 == j // 4 else 2) for j in range(8)) for i in range(8)]
    out = []
    for n in range(nodes):
        name = f"node-{n:04d}"
        kind, model, hbm, dtypes, fp16, bf16, int8 = KINDS[n % len(KINDS)]
        devices = tuple(
            DeviceView(
                name=device_name(name, kind, i),
                node=name,
                device_type=kind,
                index=i,
                model=model,
                hbm_memory_mb=hbm,
                supported_dtypes=dtypes,
                fp16_tflops=fp16,
                bf16_tflops=bf16,
                int8_tflops=int8,
                p2p_enabled=True,
                topology_distance=rows[i],
                status=DeviceState.READY if rng.random() > 0.03 else DeviceState.UNHEALTHY,
                utilization_pct=90.0 if rng.random() < 0.1 else rng.uniform(0, 60),
                temperature_c=90.0 if rng.random() < 0.02 else rng.uniform(35, 80),
            )
            for i in range(DEVICES_PER_NODE)
        )
        out.append(NodeView(name=name, ready=True, cordoned=n % 50 == 49, devices=devices))
    return GraphSnapshot(nodes=tuple(out), revision=1)


def build_queue(size: int, rng: random.Random) -> list[PendingInstance]:
    """`size` single-device instances of 40 workloads."""
    prefs: Sequence[tuple[str, ...]] = (
        (),
        ("ascend",),
        ("cambricon", "ascend"),
        ("nvidia", "hygon"),
        ("hygon",),
    )
    workloads = [
        WorkloadReq(
            workload_id=f"w{k}",
            name=f"model-{k}",
            model=f"org/model-{k}",
            quantization=rng.choice(("none", "none", "int8", "w8a8")),
            dtype=rng.choice(("fp16", "bf16")),
            devices_per_instance=1,
            memory_per_device_mb=rng.choice((16000, 24000, 32000, 40000)),
            priority=rng.choices(("high", "normal", "low"), (2, 5, 3))[0],
            preferred_device_types=prefs[k % len(prefs)],
        )
        for k in range(40)
    ]
    return [
        PendingInstance(
            instance_id=f"inst-{i:05d}", workload=rng.choice(workloads), enqueued_at=float(i), seq=i
        )
        for i in range(size)
    ]


def _pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..1), as bench.common.pct."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1))]


def bench(nodes: int, queue: int, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    graph = build_graph(nodes, rng)
    pending = build_queue(queue, rng)
    config = SchedulerConfig()

    start = time.perf_counter()
    plan = schedule(graph, pending, [], config, now=0.0)
    full = time.perf_counter() - start
    decided = len(plan.placements) + len(plan.unplaced)

    start = time.perf_counter()
    ordered = order_pending(pending, config.priority_weights)
    order_s = time.perf_counter() - start
    start = time.perf_counter()
    builder = PlanBuilder(graph, [], config)
    index_s = time.perf_counter() - start
    latencies: list[float] = []
    place_lat: list[float] = []
    for inst in ordered:
        t0 = time.perf_counter_ns()
        outcome = builder.decide(inst)
        latencies.append((time.perf_counter_ns() - t0) / 1e6)
        if isinstance(outcome, Placement):
            place_lat.append(latencies[-1])
    assert len(place_lat) == len(plan.placements)

    start = time.perf_counter()
    schedule(graph, pending, [], config, now=0.0, max_placements=config.max_placements_per_commit)
    commit_s = time.perf_counter() - start

    print(f"{nodes} nodes x {DEVICES_PER_NODE} devices, {queue} queued single-device instances")
    print(
        f"  schedule(all):   {full * 1000:8.1f} ms  {decided / full:9.0f} decisions/s  "
        f"{len(plan.placements) / full:9.0f} placements/s  ({len(plan.placements)} placed, "
        f"{len(plan.unplaced)} unplaced)"
    )
    print(
        f"  per decision:    p50 {_pct(latencies, 0.5):.3f} ms  p99 {_pct(latencies, 0.99):.3f} ms  "
        f"max {max(latencies):.3f} ms  (index build {index_s * 1000:.1f} ms, WFQ order {order_s * 1000:.1f} ms)"
    )
    print(
        f"  placed only:     p50 {_pct(place_lat, 0.5):.3f} ms  p99 {_pct(place_lat, 0.99):.3f} ms  "
        f"({len(place_lat) / (sum(place_lat) / 1000):.0f} placements/s of decision time)"
    )
    print(f"  schedule(max_placements={config.max_placements_per_commit}): {commit_s * 1000:8.1f} ms")
    return {"decisions_per_s": decided / full, "commit_sized_ms": commit_s * 1000}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--queue", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    for nodes in args.nodes:
        bench(nodes, args.queue, args.seed)


if __name__ == "__main__":
    main()
