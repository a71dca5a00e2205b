"""Heartbeat capacity: N simulated agents (8 devices each) against 3 replicas.

Each simulated agent holds its own mTLS stream (its own agent certificate) and sends a heartbeat
with 8 device samples every second, like kunlun-agent. The agents run in several load-generator
processes (`--procs`, default: one per 250 agents, at least 2) so that the generator is not the
bottleneck. Measured over a window once all are registered: CPU of the replicas and of etcd, etcd
writes/s (revision growth: lease refreshes do not count as writes), heartbeat round-trip p50/p99,
missed heartbeats (sent in the window and not acked within 3 s; those missed earlier, during the
registration storm and the warm-up, are counted apart) and the registration time of all agents.
`--period 5` makes each agent beat every 5 s: on this 2-core machine, 5,000 agents at 1 Hz need more
CPU for the load generator alone than it has, and 5,000 at 0.2 Hz carry the heartbeat rate of
1,000 at 1 Hz (registration storm, memory and streams of 5,000 agents).
Usage: python -m bench.heartbeats [--nodes 1000] [--window 30] [--procs 4] [--period 1] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
from typing import Any

import grpc

from bench.common import cpu_seconds, pct, rss_mb, temp_cluster
from controlplane.store import EtcdStore, StoreSettings
from devcluster.cluster import LocalCluster
from kunlun_common.api import agent_pb2, agent_pb2_grpc, types_pb2
from kunlun_common.pki import etcd_client_paths, issue, paths_for
from kunlun_common.tls import channel_credentials, load_tls

_EOF = grpc.aio.EOF  # type: ignore[attr-defined]
MISSED_AFTER_S = 3.0


class SimAgent:
    """A simulated kunlun-agent: registers 8 devices, heartbeats every `period` seconds."""

    period = 1.0

    def __init__(self, node: str, endpoint: str, creds: grpc.ChannelCredentials) -> None:
        self.wlock = asyncio.Lock()  # one write at a time on the stream (heartbeats, reports)
        self.node = node
        self.endpoint = endpoint
        self.creds = creds
        self.sent: dict[int, tuple[float, bool]] = {}  # seq -> (sent at, sent in the window)
        self.late_in_window = 0
        self.rtts: list[float] = []
        self.registered = asyncio.Event()
        self.measuring = False
        self.sent_in_window = 0
        self.seq = 0
        self.register_retries = 0

    def devices(self) -> list[types_pb2.Device]:
        return [
            types_pb2.Device(
                name=f"{self.node}/ascend:{i}",
                node=self.node,
                device_type="ascend",
                index=i,
                model="910B",
                hbm_memory_mb=32768,
                supported_dtypes=["fp16", "bf16", "int8"],
                fp16_tflops=280.0,
                bf16_tflops=280.0,
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
        """Connect, register and heartbeat; like kunlun-agent, a refused or broken stream is retried
        with jittered backoff (a registration the replica could not store under load is refused
        UNAVAILABLE, and a real agent simply tries again)."""
        attempt = 0
        while True:
            try:
                await self._session()
            except (grpc.aio.AioRpcError, ConnectionError):
                pass
            if not self.registered.is_set():
                self.register_retries += 1
            attempt += 1
            await asyncio.sleep(min(5.0, 0.2 * 2 ** min(attempt, 5)) * random.uniform(0.5, 1.0))

    async def _session(self) -> None:
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
            if first is _EOF:
                return
            self.registered.set()
            reader = asyncio.create_task(self._read(call))
            await asyncio.sleep(random.random() * self.period)  # spread heartbeats over the period
            try:
                while not reader.done():
                    self.seq += 1
                    self.sent[self.seq] = (time.monotonic(), self.measuring)
                    if self.measuring:
                        self.sent_in_window += 1
                    async with self.wlock:
                        await call.write(
                            agent_pb2.AgentMessage(
                                heartbeat=agent_pb2.Heartbeat(seq=self.seq, samples=self.samples())
                            )
                        )
                    await asyncio.sleep(self.period)
            finally:
                reader.cancel()

    async def _read(
        self, call: grpc.aio.StreamStreamCall[agent_pb2.AgentMessage, agent_pb2.ReplicaMessage]
    ) -> None:
        while True:
            msg = await call.read()
            if msg is _EOF or not isinstance(msg, agent_pb2.ReplicaMessage):
                return
            sent = self.sent.pop(msg.heartbeat_ack.seq, None)
            if sent is not None and sent[1]:
                rtt = time.monotonic() - sent[0]
                self.rtts.append(rtt)
                if rtt > MISSED_AFTER_S:
                    self.late_in_window += 1


async def _line(reader: asyncio.StreamReader | None = None) -> str:
    if reader is not None:
        return (await reader.readline()).decode().strip()
    line: str = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    return line.strip()


async def worker(cert_dir: str, endpoints: list[str], first: int, count: int, period: float = 1.0) -> None:
    """A load-generator process: agents `first`..`first+count-1`, driven over stdin/stdout."""
    SimAgent.period = period
    names = [f"sim-{i:05d}" for i in range(first, first + count)]
    creds = []
    for n in names:
        issue(cert_dir, "agent", n)
        creds.append(channel_credentials(load_tls(paths_for(cert_dir, "agent", n))))
    print("ready", flush=True)
    await _line()  # "go": register now
    agents = [
        SimAgent(n, endpoints[(first + j) % len(endpoints)], c)
        for j, (n, c) in enumerate(zip(names, creds, strict=True))
    ]
    t0 = time.monotonic()
    tasks = [asyncio.create_task(a.run()) for a in agents]
    await asyncio.gather(*(a.registered.wait() for a in agents))
    print(f"registered {time.monotonic() - t0:.3f}", flush=True)
    await _line()  # "start"
    for a in agents:
        a.measuring = True
    await _line()  # "stop"
    for a in agents:
        a.measuring = False
    await asyncio.sleep(MISSED_AFTER_S)  # the window's last heartbeats get their time to be acked
    result = {
        "rtts": [r for a in agents for r in a.rtts],
        "sent": sum(a.sent_in_window for a in agents),
        "missed": sum(a.late_in_window + sum(1 for _, w in a.sent.values() if w) for a in agents),
        "missed_before": sum(1 for a in agents for _, w in a.sent.values() if not w),
        "register_retries": sum(a.register_retries for a in agents),
    }
    print("result " + json.dumps(result), flush=True)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def measure(
    cluster: LocalCluster,
    n: int,
    window: float,
    procs: int,
    register_within_s: float = 300.0,
    period: float = 1.0,
) -> dict[str, Any]:
    eps = cluster.endpoints
    procs = max(1, min(procs, n))
    print(f"starting {procs} load-generator processes for {n} agents ...", flush=True)
    workers = []
    per = -(-n // procs)
    for w in range(procs):
        first, count = w * per, min(per, n - w * per)
        if count <= 0:
            break
        workers.append(
            await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "bench.heartbeats",
                "--worker",
                str(cluster.cert_dir),
                ",".join(eps),
                str(first),
                str(count),
                str(period),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                limit=1 << 30,
            )
        )

    async def tell(word: str) -> None:
        for p in workers:
            assert p.stdin is not None
            p.stdin.write(word.encode() + b"\n")
            await p.stdin.drain()

    async def hear(prefix: str) -> list[str]:
        out = []
        for p in workers:
            assert p.stdout is not None
            while True:
                line = await _line(p.stdout)
                if not line:
                    raise RuntimeError("a load-generator process ended early")
                if line.startswith(prefix):
                    out.append(line[len(prefix) :].strip())
                    break
        return out

    try:
        await asyncio.wait_for(hear("ready"), 600)
        t0 = time.monotonic()
        await tell("go")
        try:
            await asyncio.wait_for(hear("registered"), register_within_s)
        except TimeoutError:
            raise RuntimeError(
                f"the {n} agents did not all register within {register_within_s:.0f}s"
            ) from None
        registration_s = time.monotonic() - t0
        print(f"{n} agents registered in {registration_s:.1f}s; warming up 5s ...", flush=True)
        await asyncio.sleep(5)
        p = etcd_client_paths(cluster.cert_dir)
        store = EtcdStore(StoreSettings(cluster.etcd.endpoints, str(p.ca), str(p.cert), str(p.key)))
        rev0 = await store.revision()
        pids = {name: proc.pid for name, proc in cluster.replicas.items()}
        etcd_pids = {m.name: m.proc.pid for m in cluster.etcd.members}
        gen_pids = {f"generator-{i}": p.pid for i, p in enumerate(workers)}
        cpu0 = {k: cpu_seconds(v) for k, v in {**pids, **etcd_pids, **gen_pids}.items()}
        await tell("start")
        start = time.monotonic()
        await asyncio.sleep(window)
        await tell("stop")
        elapsed = time.monotonic() - start
        rev1 = await store.revision()
        cpu1 = {k: cpu_seconds(v) for k, v in {**pids, **etcd_pids, **gen_pids}.items()}
        rss = {k: rss_mb(v) for k, v in pids.items()}
        await store.close()
        results = [json.loads(r) for r in await asyncio.wait_for(hear("result"), 120)]
    finally:
        for proc in workers:
            if proc.returncode is None:
                proc.kill()
            await proc.wait()
    rtts = [r for res in results for r in res["rtts"]]
    sent = sum(res["sent"] for res in results)
    missed = sum(res["missed"] for res in results)
    missed_before = sum(res["missed_before"] for res in results)
    retries = sum(res["register_retries"] for res in results)
    rcpu = {k: (cpu1[k] - cpu0[k]) / elapsed * 100 for k in pids}
    ecpu = {k: (cpu1[k] - cpu0[k]) / elapsed * 100 for k in etcd_pids}
    gcpu = sum((cpu1[k] - cpu0[k]) / elapsed * 100 for k in gen_pids)
    print(
        f"\nheartbeat capacity: {n} agents x 8 devices, 1 heartbeat every {period:g} s each, "
        f"window {elapsed:.0f}s"
    )
    print(
        f"  registration of all agents: {registration_s:.1f} s  ({len(workers)} load-generator processes, "
        f"{retries} registrations retried after a refusal)"
    )
    print(f"  heartbeats sent in the window {sent} ({sent / elapsed:.0f}/s), of them acked {len(rtts)}")
    print(f"  heartbeat round trip p50 {pct(rtts, 50) * 1000:.1f} ms  p99 {pct(rtts, 99) * 1000:.1f} ms")
    print(
        f"  missed heartbeats (no ack within {MISSED_AFTER_S:.0f} s): {missed} in the window "
        f"({missed_before} before it: registration storm and warm-up)"
    )
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
    hb_per_s = sent / elapsed if elapsed > 0 else float("nan")
    print(
        f"  replica CPU per heartbeat: {sum(rcpu.values()) * 10 / hb_per_s:.2f} ms "
        f"(with etcd {(sum(rcpu.values()) + sum(ecpu.values())) * 10 / hb_per_s:.2f} ms)"
    )
    print("  replica RSS MiB: " + ", ".join(f"{k} {v:.0f}" for k, v in rss.items()))
    total = sum(rcpu.values()) + sum(ecpu.values()) + gcpu
    cores = os.cpu_count() or 1
    print(
        f"  load generators CPU %: {gcpu:.0f}; all measured processes {total:.0f} % of {cores * 100} % "
        f"({cores} cores){'  <- the machine is saturated: figures are what it allows' if total > cores * 85 else ''}"
    )
    return {
        "agents": n,
        "window_s": elapsed,
        "registration_s": registration_s,
        "register_retries": retries,
        "generators_cpu_pct": gcpu,
        "sent": sent,
        "acked": len(rtts),
        "missed": missed,
        "missed_before": missed_before,
        "p50_ms": pct(rtts, 50) * 1000,
        "p99_ms": pct(rtts, 99) * 1000,
        "replica_cpu_pct": sum(rcpu.values()),
        "etcd_cpu_pct": sum(ecpu.values()),
        "etcd_writes_per_s": (rev1 - rev0) / elapsed,
        "replica_cpu_ms_per_heartbeat": sum(rcpu.values()) * 10 / hb_per_s,
        "replica_rss_mb": rss,
    }


def run(
    nodes: int, window: float, procs: int = 0, register_within_s: float = 300.0, period: float = 1.0
) -> dict[str, Any]:
    """One measurement in its own temporary cluster (also used by bench.check)."""
    # SIGTERM (e.g. from `timeout`) ends the run through the cleanup below, not around it
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with temp_cluster(node_lease_ttl_s=10) as cluster:
        procs = procs or max(2, -(-nodes // 250))
        return asyncio.run(measure(cluster, nodes, window, procs, register_within_s, period))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _, _, cert_dir, eps, first, count, period = sys.argv
        asyncio.run(worker(cert_dir, eps.split(","), int(first), int(count), float(period)))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=200)
    ap.add_argument("--window", type=float, default=30.0)
    ap.add_argument(
        "--procs", type=int, default=0, help="load-generator processes (default: 1 per 250 agents, >= 2)"
    )
    ap.add_argument("--register-within", type=float, default=300.0, help="seconds allowed for registration")
    ap.add_argument("--period", type=float, default=1.0, help="seconds between an agent's heartbeats")
    ap.add_argument("--json", action="store_true", help="also print the figures as one JSON line")
    a = ap.parse_args()
    figures = run(a.nodes, a.window, a.procs, a.register_within, a.period)
    if a.json:
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
