"""Helpers for the scheduler scenarios against a real local cluster."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc

from chaos.invariants import AllocEvent
from controlplane import keys
from controlplane.store import EtcdStore, WatchEvent
from devcluster.cluster import LocalCluster
from devcluster.procs import wait_for
from kunlun_common.api import workload_pb2, workload_pb2_grpc
from tests.conftest import store_settings


def call(
    cluster: LocalCluster,
    fn: Callable[[workload_pb2_grpc.WorkloadServiceStub], Callable[..., object]],
    req: object,
) -> object:
    last: Exception | None = None
    for name, addr in cluster.replica_addrs.items():
        if not cluster.replicas[name].alive():
            continue
        with cluster.channel(addr) as ch:
            try:
                return fn(workload_pb2_grpc.WorkloadServiceStub(ch))(req, timeout=10)
            except grpc.RpcError as e:
                if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
                last = e
    raise RuntimeError(f"no replica answered: {last}")


def submit(cluster: LocalCluster, **fields: object) -> workload_pb2.Workload:
    spec = workload_pb2.WorkloadSpec(**fields)  # type: ignore[arg-type]
    resp = call(cluster, lambda s: s.SubmitWorkload, workload_pb2.SubmitWorkloadRequest(spec=spec))
    assert isinstance(resp, workload_pb2.SubmitWorkloadResponse)
    return resp.workload


def get(cluster: LocalCluster, name: str) -> workload_pb2.WorkloadSummary:
    resp = call(cluster, lambda s: s.GetWorkload, workload_pb2.GetWorkloadRequest(name=name))
    assert isinstance(resp, workload_pb2.WorkloadSummary)
    return resp


def targets(cluster: LocalCluster, name: str) -> list[str]:
    return sorted(d for i in get(cluster, name).instances for d in i.target_devices)


def placed(cluster: LocalCluster, name: str, n: int = 1) -> bool:
    """n instances hold devices (whatever their engines are doing on the node)."""
    s = get(cluster, name)
    return sum(1 for i in s.instances if i.target_devices and i.node) == n


def workloads(cluster: LocalCluster) -> list[workload_pb2.WorkloadSummary]:
    resp = call(cluster, lambda s: s.ListWorkloads, workload_pb2.ListWorkloadsRequest())
    assert isinstance(resp, workload_pb2.ListWorkloadsResponse)
    return list(resp.workloads)


def delete_all(cluster: LocalCluster) -> None:
    for w in workloads(cluster):
        call(cluster, lambda s: s.DeleteWorkload, workload_pb2.DeleteWorkloadRequest(name=w.workload.id))
    wait_for(lambda: not workloads(cluster), 60, "every workload deleted")
    wait_for(lambda: not allocations(cluster), 30, "every allocation freed")


def set_config(cluster: LocalCluster, yaml_text: str) -> None:
    call(cluster, lambda s: s.SetSchedulerConfig, workload_pb2.SchedulerConfigText(yaml=yaml_text))


def _store(cluster: LocalCluster) -> EtcdStore:
    return EtcdStore(store_settings(cluster.cert_dir, cluster.etcd.endpoints))


def allocations(cluster: LocalCluster) -> dict[str, str]:
    async def read() -> dict[str, str]:
        s = _store(cluster)
        try:
            kvs, _ = await s.get_prefix(keys.ALLOC)
            return {keys.alloc_device(kv.key): str(keys.decode(kv.value)["instance"]) for kv in kvs}
        finally:
            await s.close()

    return asyncio.run(read())


def alloc_history(cluster: LocalCluster) -> list[AllocEvent]:
    """Every allocation change over the whole etcd history (not only the final state)."""

    async def read() -> list[AllocEvent]:
        s = _store(cluster)
        try:
            end = await s.revision()
            await s.put(keys.ROOT + "test/history-end", b"x")  # inside the replicas' etcd permission
            out: list[AllocEvent] = []
            async with asyncio.timeout(60):
                async for ev in s.watch_prefix(keys.ROOT, 1):
                    if not isinstance(ev, WatchEvent):
                        raise AssertionError("history was compacted; cannot check it whole")
                    if ev.kv.key.startswith(keys.ALLOC):
                        inst = str(keys.decode(ev.kv.value)["instance"]) if ev.kind == "put" else ""
                        out.append(
                            AllocEvent(
                                ev.kv.mod_revision, keys.alloc_device(ev.kv.key), ev.kind, inst, ev.kv.version
                            )
                        )
                    if ev.kv.mod_revision > end:
                        break
            return out
        finally:
            await s.close()

    return asyncio.run(read())
