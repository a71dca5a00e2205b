"""Scheduler throughput with fenced commits on a real 3-member TLS etcd, graph only (no processes).

For 100 and 1000 simulated nodes x 8 devices and 10,000 queued single-device workloads, the real
leader code (SchedulerLoop: graph cache, pure plan, packed fenced commits) places everything;
committed placements per second are counted from the allocation keys read back from etcd. In the
same run it measures the raw fenced compare-and-set rate on the same cluster (one placement per
transaction, one at a time and 32 in flight) — the physical limit for one commit per decision.
Usage: python -m bench.scheduler_throughput [--nodes 100,1000] [--workloads 10000]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
import time
from pathlib import Path

from bench.common import pct
from controlplane import keys
from controlplane.cache import GraphCache
from controlplane.election import Fence
from controlplane.scheduler.leader import SchedulerLoop
from controlplane.store import Compare, EtcdStore, PutOp, StoreSettings
from devcluster.etcd_cluster import build_etcd_cluster
from devcluster.procs import wait_for
from kunlun_common.api import types_pb2, workload_pb2
from kunlun_common.clock import now_ms
from kunlun_common.pki import ClusterCerts, etcd_client_paths, init_cluster_certs
from kunlun_common.states import InstancePhase


def node_record(i: int) -> types_pb2.Node:
    name = f"n{i:04d}"
    devs = [
        types_pb2.Device(
            name=f"{name}/ascend:{d}",
            node=name,
            device_type="ascend",
            index=d,
            model="910B",
            hbm_memory_mb=32768,
            supported_dtypes=["fp16", "bf16", "int8"],
            bf16_tflops=320,
            topology_distance=[0 if d == e else 1 if d // 2 == e // 2 else 2 for e in range(8)],
            p2p_enabled=True,
            status=types_pb2.DEVICE_STATUS_READY,
        )
        for d in range(8)
    ]
    return types_pb2.Node(name=name, address="127.0.0.1", devices=devs, ready=True)


async def batched(store: EtcdStore, ops: list[PutOp], per_txn: int = 120, in_flight: int = 16) -> None:
    gate = asyncio.Semaphore(in_flight)

    async def one(chunk: list[PutOp]) -> None:
        async with gate:
            await store.txn([], chunk)

    await asyncio.gather(*(one(ops[i : i + per_txn]) for i in range(0, len(ops), per_txn)))


async def raw_cas_rate(store: EtcdStore, fence: Fence, n: int, in_flight: int, tag: str) -> float:
    gate = asyncio.Semaphore(in_flight)

    async def one(i: int) -> None:
        k = f"/bench-cas/{tag}/{i}"
        async with gate:
            await fence.txn([Compare.absent(k)], [PutOp(k, b"x"), PutOp(k + "-i", b"y")])

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    return n / (time.perf_counter() - t0)


async def scenario(store: EtcdStore, fence: Fence, nodes: int, workloads: int) -> dict[str, float]:
    await store.delete(keys.NODES, prefix=True)
    for p in (keys.ALIVE, keys.WORKLOADS, keys.WORKLOAD_NAMES, keys.INSTANCES, keys.ALLOC, keys.TELEMETRY):
        await store.delete(p, prefix=True)
    ops: list[PutOp] = []
    for i in range(nodes):
        n = node_record(i)
        ops.append(PutOp(keys.node(n.name), keys.encode_message(n)))
        ops.append(PutOp(keys.alive(n.name), keys.encode({"replica": "bench"})))
    await batched(store, ops)
    ops = []
    now = now_ms()
    for i in range(workloads):
        wid = f"w-{i:06d}"
        spec = workload_pb2.WorkloadSpec(
            name=f"wl{i}",
            model="m",
            engine="sglang",
            quantization="none",
            dtype="bf16",
            devices_per_instance=1,
            replicas=1,
            priority=("high", "normal", "low")[i % 3],
        )
        w = workload_pb2.Workload(id=wid, spec=spec, generation=1, created_at_unix_ms=now)
        inst = workload_pb2.Instance(
            id=f"{wid}-0",
            workload_id=wid,
            workload=spec.name,
            phase=InstancePhase.PENDING,
            seq=i,
            enqueued_at_unix_ms=now,
            generation=1,
        )
        ops.append(PutOp(keys.workload(wid), keys.encode_message(w)))
        ops.append(PutOp(keys.instance(inst.id), keys.encode_message(inst)))
    await batched(store, ops)
    cache = GraphCache(store)
    await cache.start()
    loop = SchedulerLoop(store, "bench")
    target = min(nodes * 8, workloads)
    t0 = time.perf_counter()
    tick_ms: list[float] = []
    ticks = 0
    try:
        while True:
            ts = time.perf_counter()
            rev = await loop.tick(fence, cache)
            tick_ms.append((time.perf_counter() - ts) * 1000)
            ticks += 1
            if rev:
                await cache.wait_for_revision(rev, 30)
            allocs = sum(1 for k in cache.kvs if k.startswith(keys.ALLOC))
            if allocs >= target or ticks > 200:
                break
        elapsed = time.perf_counter() - t0
    finally:
        await cache.stop()
    kvs, _ = await store.get_prefix(keys.ALLOC)
    committed = len(kvs)
    return {
        "placed": committed,
        "seconds": elapsed,
        "rate": committed / elapsed,
        "ticks": ticks,
        "tick_p50": pct(tick_ms, 50),
        "tick_p99": pct(tick_ms, 99),
    }


async def main_async(
    node_counts: list[int], workloads: int, endpoints: tuple[str, ...], cert_dir: Path
) -> dict[str, float]:
    """Prints the figures; returns the raw CAS rates and, per node count, the placement rate."""
    figures: dict[str, float] = {}
    p = etcd_client_paths(cert_dir)
    store = EtcdStore(StoreSettings(endpoints, str(p.ca), str(p.cert), str(p.key), request_timeout_s=10.0))
    lease = await store.lease_grant(60)
    res = await store.create(keys.LEADER, keys.encode({"name": "bench"}), lease)
    fence = Fence(store, "bench", res.revision)

    async def keep() -> None:
        while True:
            await asyncio.sleep(10)
            await store.lease_keepalive(lease)

    keeper = asyncio.create_task(keep())
    try:
        r1 = await raw_cas_rate(store, fence, 1000, 1, "one")
        r32 = await raw_cas_rate(store, fence, 3000, 32, "many")
        print(
            f"raw fenced CAS (1 placement per txn): {r1:.0f}/s one at a time, {r32:.0f}/s with 32 in flight"
        )
        figures.update(cas_one=r1, cas_32=r32)
        for n in node_counts:
            res_ = await scenario(store, fence, n, workloads)
            figures[f"placements_per_s_{n}"] = res_["rate"]
            print(
                f"{n} nodes x 8 devices, {workloads} queued: {res_['placed']:.0f} placements committed in {res_['seconds']:.2f}s = "
                f"{res_['rate']:.0f}/s ({res_['rate'] / r1:.1f}x the one-at-a-time CAS rate, {res_['rate'] / r32:.1f}x the "
                f"32-in-flight rate); {res_['ticks']:.0f} ticks, tick p50 {res_['tick_p50']:.0f} ms p99 {res_['tick_p99']:.0f} ms",
                flush=True,
            )
        print("per-decision latency of the pure placement function: python -m bench.scheduler_decisions")
    finally:
        keeper.cancel()
        await store.close()
    return figures


def run(node_counts: list[int], workloads: int) -> dict[str, float]:
    """One measurement on its own temporary etcd cluster (also used by bench.check)."""
    base = Path(tempfile.mkdtemp(prefix="kunlun-bench-", dir="/dev/shm"))
    try:
        init_cluster_certs(base / "certs", ClusterCerts())
        cluster = build_etcd_cluster(base / "etcd", base / "certs")
        cluster.start()
        try:
            from tests.conftest import _etcd_ready

            wait_for(lambda: _etcd_ready(base / "certs", cluster.endpoints), 60, "etcd")
            return asyncio.run(main_async(node_counts, workloads, cluster.endpoints, base / "certs"))
        finally:
            cluster.stop()
    finally:
        shutil.rmtree(base, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", default="100,1000")
    ap.add_argument("--workloads", type=int, default=10000)
    a = ap.parse_args()
    run([int(x) for x in a.nodes.split(",")], a.workloads)


if __name__ == "__main__":
    main()
