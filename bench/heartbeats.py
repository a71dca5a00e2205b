"""Heartbeat capacity: N simulated agents (8 devices each, all in this process) against 3 replicas.

Each simulated agent holds its own mTLS stream (its own agent certificate) and sends a heartbeat
with 8 device samples every second, like kunlun-agent. Measured over a window once all are
registered: CPU of the replicas and of etcd, etcd writes/s (revision growth: lease refreshes do not
count as writes), heartbeat round-trip p50/p99 and missed heartbeats (no ack within 3 s).
Usage: python -m bench.heartbeats [--nodes 1000] [--window 30]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

import grpc

from bench.common import cpu_seconds, pct, temp_cluster
from controlplane.store import EtcdStore, StoreSettings
from devcluster.cluster import LocalCluster
from kunlun_common.api import agent_pb2, agent_pb2_grpc, types_pb2
from kunlun_common.pki import issue, paths_for
from kunlun_common.tls import channel_credentials, load_tls

_EOF = grpc.aio.EOF  # type: ignore[attr-defined]


class SimAgent:
    def __init__(self, node: str, endpoint: str, creds: grpc.ChannelCredentials) -> None:
        self.node = node
        self.endpoint = endpoint
        self.creds = creds
        self.sent: dict[int, float] = {}
        self.rtts: list[float] = []
        self.registered = asyncio.Event()
        self.measuring = False
        self.sent_in_window = 0

    def devices(self) -> list[types_pb2.Device]:
        return [
            types_pb2.Device(
                name=f"{self.node}/ascend:{i}",
                node=self.node,
                device_type="ascend",
                index=i,
                model="910B",
                hbm_memory_mb=32768,
                status=types_pb2.DEVICE_STATUS_READY,
            )
            for i in range(8)
        ]

    def samples(self) -> list[agent_pb2.DeviceSample]:
        return [
            agent_pb2.DeviceSample(
                name=f"{self.node}/ascend:{i}",
                status=types_pb2.DEVICE_STATUS_READY,
                telemetry=types_pb2.DeviceTelemetry(
                    utilization_pct=random.uniform(0, 5),
                    temperature_c=40 + random.random(),
                    memory_used_mb=1000,
                ),
            )
            for i in range(8)
        ]

    async def run(self) -> None:
        async with grpc.aio.secure_channel(self.endpoint, self.creds) as ch:
            call = agent_pb2_grpc.AgentServiceStub(ch).Connect()  # type: ignore[call-arg]
            await call.write(
                agent_pb2.AgentMessage(
                    register=agent_pb2.RegisterNode(
                        node=self.node, address="127.0.0.1", devices=self.devices()
                    )
                )
            )
            first = await call.read()
            assert first is not _EOF
            self.registered.set()
            reader = asyncio.create_task(self._read(call))
            await asyncio.sleep(random.random())  # spread heartbeats over the second
            seq = 0
            try:
                while True:
                    seq += 1
                    self.sent[seq] = time.monotonic()
                    if self.measuring:
                        self.sent_in_window += 1
                    await call.write(
                        agent_pb2.AgentMessage(heartbeat=agent_pb2.Heartbeat(seq=seq, samples=self.samples()))
                    )
                    await asyncio.sleep(1.0)
            finally:
                reader.cancel()

    async def _read(
        self, call: grpc.aio.StreamStreamCall[agent_pb2.AgentMessage, agent_pb2.ReplicaMessage]
    ) -> None:
        while True:
            msg = await call.read()
            if msg is _EOF or not isinstance(msg, agent_pb2.ReplicaMessage):
                return
            t = self.sent.pop(msg.heartbeat_ack.seq, None)
            if t is not None and self.measuring:
                self.rtts.append(time.monotonic() - t)


async def measure(cluster: LocalCluster, n: int, window: float) -> None:
    eps = cluster.endpoints
    print(f"issuing {n} agent certificates ...", flush=True)
    creds = []
    for i in range(n):
        issue(cluster.cert_dir, "agent", f"sim-{i:05d}")
        creds.append(channel_credentials(load_tls(paths_for(cluster.cert_dir, "agent", f"sim-{i:05d}"))))
    agents = [SimAgent(f"sim-{i:05d}", eps[i % len(eps)], creds[i]) for i in range(n)]
    tasks = [asyncio.create_task(a.run()) for a in agents]
    t0 = time.monotonic()
    await asyncio.wait_for(asyncio.gather(*(a.registered.wait() for a in agents)), 600)
    print(f"{n} agents registered in {time.monotonic() - t0:.1f}s; warming up 5s ...", flush=True)
    await asyncio.sleep(5)
    p = paths_for(cluster.cert_dir, "replica", "replica-1")
    store = EtcdStore(StoreSettings(cluster.etcd.endpoints, str(p.ca), str(p.cert), str(p.key)))
    rev0 = await store.revision()
    pids = {name: proc.pid for name, proc in cluster.replicas.items()}
    etcd_pids = {m.name: m.proc.pid for m in cluster.etcd.members}
    cpu0 = {k: cpu_seconds(v) for k, v in {**pids, **etcd_pids}.items()}
    for a in agents:
        a.measuring = True
    start = time.monotonic()
    await asyncio.sleep(window)
    for a in agents:
        a.measuring = False
    elapsed = time.monotonic() - start
    rev1 = await store.revision()
    cpu1 = {k: cpu_seconds(v) for k, v in {**pids, **etcd_pids}.items()}
    await store.close()
    rtts = [r for a in agents for r in a.rtts]
    sent = sum(a.sent_in_window for a in agents)
    now = time.monotonic()
    missed = sum(1 for a in agents for t in a.sent.values() if now - t > 3.0)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    rcpu = {k: (cpu1[k] - cpu0[k]) / elapsed * 100 for k in pids}
    ecpu = {k: (cpu1[k] - cpu0[k]) / elapsed * 100 for k in etcd_pids}
    print(f"\nheartbeat capacity: {n} agents x 8 devices, 1 heartbeat/s each, window {elapsed:.0f}s")
    print(f"  heartbeats sent {sent} ({sent / elapsed:.0f}/s), acked in window {len(rtts)}")
    print(f"  heartbeat round trip p50 {pct(rtts, 50) * 1000:.1f} ms  p99 {pct(rtts, 99) * 1000:.1f} ms")
    print(f"  missed heartbeats (no ack within 3 s): {missed}")
    print(f"  etcd writes/s: {(rev1 - rev0) / elapsed:.1f}  (vs {sent / elapsed:.0f} heartbeats/s)")
    print(
        "  replica CPU %: "
        + ", ".join(f"{k} {v:.0f}" for k, v in rcpu.items())
        + f"  (total {sum(rcpu.values()):.0f})"
    )
    print(
        "  etcd CPU %:    "
        + ", ".join(f"{k} {v:.0f}" for k, v in ecpu.items())
        + f"  (total {sum(ecpu.values()):.0f})"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=200)
    ap.add_argument("--window", type=float, default=30.0)
    a = ap.parse_args()
    with temp_cluster(node_lease_ttl_s=10) as cluster:
        asyncio.run(measure(cluster, a.nodes, a.window))


if __name__ == "__main__":
    main()
