"""End-to-end submit throughput: workloads through the gRPC API until every instance is placed and
its agent acknowledged it.

N simulated nodes x 8 devices hold real AgentService streams (mTLS, one per node, spread over the
3 replicas); each acknowledges an assignment by reporting the instance Running, like kunlun-agent
once its engine is up. C concurrent clients (an operator certificate) submit W single-instance
workloads spread over the 3 replicas. Timed from the first submit until every instance was
received by its node's agent. In the same run it measures the raw fenced-style compare-and-set
rate of the same etcd (one transaction at a time) and the etcd revisions written per workload, and
prints the target `0.5 x CAS rate / transactions per workload` beside the figure, with Nomad's C2M
(about 1,500 placements/s) and kube-scheduler's basic benchmark (680-810 pods/s) for scale.
Usage: python -m bench.e2e_submit [--nodes 1250] [--workloads 10000] [--clients 64]
(each workload's instance takes one device: 10,000 workloads need 1,250 nodes x 8)
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from typing import Any

import grpc

from bench.common import rss_mb, temp_cluster
from bench.heartbeats import _EOF, SimAgent
from controlplane import keys
from controlplane.store import Compare, EtcdStore, PutOp, StoreSettings
from devcluster.cluster import LocalCluster
from kunlun_common.api import agent_pb2, workload_pb2, workload_pb2_grpc
from kunlun_common.pki import etcd_client_paths, issue, paths_for
from kunlun_common.states import InstancePhase
from kunlun_common.tls import channel_credentials, load_tls


class PlacingAgent(SimAgent):
    """A simulated agent that acknowledges each new assignment by reporting the instance Running."""

    period = 3.0  # heartbeats keep the node lease; fewer of them leave the CPU to the placements

    def __init__(
        self, node: str, endpoint: str, creds: grpc.ChannelCredentials, acked: dict[str, float]
    ) -> None:
        super().__init__(node, endpoint, creds)
        self.acked = acked
        self.done: asyncio.Event | None = None
        self.want = 0

    def samples(self) -> list[agent_pb2.DeviceSample]:
        return []

    async def _read(
        self, call: grpc.aio.StreamStreamCall[agent_pb2.AgentMessage, agent_pb2.ReplicaMessage]
    ) -> None:
        while True:
            msg = await call.read()
            if msg is _EOF or not isinstance(msg, agent_pb2.ReplicaMessage):
                return
            if msg.WhichOneof("kind") != "assignments":
                continue
            new = [a.instance_id for a in msg.assignments.items if a.instance_id not in self.acked]
            if not new:
                continue
            now = time.monotonic()
            for iid in new:
                self.acked[iid] = now
            report = agent_pb2.InstanceReport(
                instances=[
                    agent_pb2.InstanceStatus(instance_id=a.instance_id, phase=InstancePhase.RUNNING)
                    for a in msg.assignments.items
                ]
            )
            async with self.wlock:
                await call.write(agent_pb2.AgentMessage(report=report))
            if self.done is not None and len(self.acked) >= self.want:
                self.done.set()


async def cas_rate(store: EtcdStore, n: int) -> float:
    """Raw compare-and-set transactions per second, one at a time (a compare and two puts, like a
    fenced single-placement commit)."""
    t0 = time.perf_counter()
    for i in range(n):
        k = f"{keys.ROOT}bench-cas/{i}"  # inside the replicas' etcd permission; no consumer reads it
        res = await store.txn(
            [Compare.absent(k), Compare.absent(k + "-i")], [PutOp(k, b"x"), PutOp(k + "-i", b"y")]
        )
        assert res.succeeded
    rate = n / (time.perf_counter() - t0)
    await store.delete(keys.ROOT + "bench-cas/", prefix=True)
    return rate


async def measure(
    cluster: LocalCluster, nodes: int, workloads: int, clients: int, within_s: float
) -> dict[str, Any]:
    eps = cluster.endpoints
    p = etcd_client_paths(cluster.cert_dir)
    store = EtcdStore(StoreSettings(cluster.etcd.endpoints, str(p.ca), str(p.cert), str(p.key)))
    cas = await cas_rate(store, 300)
    print(f"raw CAS (compare + 2 puts, one at a time): {cas:.0f}/s", flush=True)
    print(f"issuing {nodes} agent certificates ...", flush=True)
    acked: dict[str, float] = {}
    agents = []
    for i in range(nodes):
        name = f"sim-{i:05d}"
        issue(cluster.cert_dir, "agent", name)
        creds = channel_credentials(load_tls(paths_for(cluster.cert_dir, "agent", name)))
        agents.append(PlacingAgent(name, eps[i % len(eps)], creds, acked))
    done = asyncio.Event()
    for a in agents:
        a.done, a.want = done, workloads
    tasks = [asyncio.create_task(a.run()) for a in agents]
    t0 = time.monotonic()
    await asyncio.wait_for(asyncio.gather(*(a.registered.wait() for a in agents)), 600)
    print(f"{nodes} agents registered in {time.monotonic() - t0:.1f}s", flush=True)
    op_creds = channel_credentials(load_tls(issue(cluster.cert_dir, "operator", "bench")))
    channels = [
        grpc.aio.secure_channel(ep, op_creds, options=[("grpc.ssl_target_name_override", "localhost")])
        for ep in eps
    ]
    stubs = [workload_pb2_grpc.WorkloadServiceStub(ch) for ch in channels]
    rev0 = await store.revision()
    next_i = 0
    failures: list[str] = []

    async def client(c: int) -> None:
        nonlocal next_i
        while next_i < workloads:
            i = next_i
            next_i += 1
            spec = workload_pb2.WorkloadSpec(name=f"w{i:05d}", model="bench-model", replicas=1)
            try:
                await stubs[(c + i) % len(stubs)].SubmitWorkload(
                    workload_pb2.SubmitWorkloadRequest(spec=spec), timeout=30
                )
            except grpc.aio.AioRpcError as e:
                failures.append(f"w{i:05d}: {e.code().name} {e.details()}")

    start = time.monotonic()
    try:
        await asyncio.gather(*(client(c) for c in range(clients)))
        submitted = time.monotonic() - start
        print(f"{workloads} workloads submitted in {submitted:.1f}s ({len(failures)} refused)", flush=True)
        try:
            await asyncio.wait_for(done.wait(), within_s)
        except TimeoutError:
            print(f"not every instance was acknowledged within {within_s:.0f}s", flush=True)
        last = max(acked.values(), default=start)
        elapsed = last - start
        rev1 = await store.revision()
        rss = {name: rss_mb(proc.pid) for name, proc in cluster.replicas.items()}
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for ch in channels:
            await ch.close(None)
        await store.close()
    rate = len(acked) / elapsed if elapsed > 0 else float("nan")
    per_workload = (rev1 - rev0) / max(1, workloads)
    target = 0.5 * cas / per_workload
    print(
        f"\ne2e submit: {nodes} nodes x 8 devices, {workloads} workloads, {clients} clients over {len(eps)} replicas"
    )
    print(f"  acknowledged by agents: {len(acked)} of {workloads} instances in {elapsed:.1f}s = {rate:.0f}/s")
    print(
        f"  etcd revisions per workload: {per_workload:.2f} (every write: submit, instance, placement, status, heartbeats)"
    )
    print(
        f"  target 0.5 x CAS {cas:.0f}/s / {per_workload:.2f} = {target:.0f}/s: {'met' if rate >= target else 'NOT met'}"
    )
    print("  for scale: Nomad C2M about 1,500 placements/s; kube-scheduler basic benchmark 680-810 pods/s")
    print("  replica RSS MB: " + ", ".join(f"{k} {v:.0f}" for k, v in rss.items()))
    if failures:
        print(f"  first refusal: {failures[0]}")
    return {
        "nodes": nodes,
        "workloads": workloads,
        "acked": len(acked),
        "seconds": elapsed,
        "rate": rate,
        "cas_per_s": cas,
        "revisions_per_workload": per_workload,
        "target": target,
        "refused": len(failures),
        "replica_rss_mb": rss,
    }


def run(nodes: int, workloads: int, clients: int = 64, within_s: float = 300.0) -> dict[str, Any]:
    """One measurement on its own temporary cluster (also used by bench.check)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with temp_cluster(node_lease_ttl_s=10) as cluster:
        return asyncio.run(measure(cluster, nodes, workloads, clients, within_s))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=1250)
    ap.add_argument("--workloads", type=int, default=10000)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--within", type=float, default=300.0, help="seconds allowed after the last submit")
    a = ap.parse_args()
    if a.workloads > a.nodes * 8:
        # each workload's one instance takes one device: the rest could never be placed
        ap.error(
            f"--workloads {a.workloads} needs {a.workloads} devices but --nodes {a.nodes} x 8 has "
            f"{a.nodes * 8}; use --nodes {-(-a.workloads // 8)} or fewer workloads"
        )
    run(a.nodes, a.workloads, a.clients, a.within)


if __name__ == "__main__":
    main()
