"""The exporter's cost per scrape: an agent's registry with N simulated devices (default 1000) and
some instances, scraped over real HTTPS with a `monitoring` certificate, and rendered directly.

Prints CPU seconds of this process per scrape (event-loop copy + text rendering in the worker
thread + TLS), wall time, the body size and the number of samples. Usage:

    .venv/bin/python -m bench.metrics_scrape [--devices 1000] [--scrapes 50]
"""

from __future__ import annotations

import argparse
import asyncio
import ssl
import tempfile
import time
from pathlib import Path

from bench.common import pct
from kunlun_common.api import agent_pb2, types_pb2
from kunlun_common.metrics_http import MetricsServer
from kunlun_common.pki import CLUSTER_CA, ClusterCerts, init_cluster_certs, paths_for
from kunlun_common.tls import load_tls
from node_agent.metrics import AgentMetrics

TYPES = ("ascend", "cambricon", "hygon", "nvidia")


def devices(n: int) -> list[types_pb2.Device]:
    out = []
    now_ms = int(time.time() * 1000)
    for i in range(n):
        node = f"node-{i // 8:03d}"
        t = TYPES[(i // 8) % 4]
        d = types_pb2.Device(
            name=f"{node}/{t}:{i % 8}",
            node=node,
            device_type=t,
            index=i % 8,
            hbm_memory_mb=65536,
            status=types_pb2.DEVICE_STATUS_READY,
        )
        d.telemetry.CopyFrom(
            types_pb2.DeviceTelemetry(
                utilization_pct=(i * 7) % 100,
                memory_used_mb=(i * 997) % 65536,
                temperature_c=40 + i % 40,
                power_w=100 + i % 300,
                sampled_at_unix_ms=now_ms,
                health="OK",
            )
        )
        out.append(d)
    return out


def instances(n: int) -> list[agent_pb2.InstanceStatus]:
    return [
        agent_pb2.InstanceStatus(
            instance_id=f"inst-{i}",
            workload_id=f"wl-{i % 20}",
            phase="Running",
            restarts=i % 3,
            prepare_seconds=1.5,
            first_token_ms=120.0,
        )
        for i in range(n)
    ]


async def run(n_devices: int, scrapes: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        init_cluster_certs(tmp, ClusterCerts(nodes=("node-000",), replicas=(), gateways=(), etcd_members=()))
        material = load_tls(paths_for(tmp, "agent", "node-000"), expect_roles=("agent",))
        devs, insts = devices(n_devices), instances(n_devices // 8)
        m = AgentMetrics("node-000", lambda: devs, lambda: insts, process_collector=True)
        server = MetricsServer("127.0.0.1:0", material, m.registry, m.prepare)
        address = await server.start()
        p = paths_for(tmp, "monitoring", "prometheus")
        ctx = ssl.create_default_context(cafile=str(Path(tmp) / CLUSTER_CA))
        ctx.load_cert_chain(str(p.cert), str(p.key))

        # direct rendering: the exporter's own work
        body = await server.render()
        samples = sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))
        cpu, wall = [], []
        for _ in range(scrapes):
            c0, w0 = time.process_time(), time.perf_counter()
            await server.render()
            cpu.append(time.process_time() - c0)
            wall.append(time.perf_counter() - w0)

        # over HTTPS (TLS handshake per scrape, as Prometheus does with connection: close); the
        # client runs in a thread of this process, so its CPU is included: an upper bound
        def fetch() -> int:
            import urllib.request

            with urllib.request.urlopen(f"https://{address}/metrics", context=ctx, timeout=30) as r:
                return len(r.read())

        https_cpu = []
        for _ in range(max(5, scrapes // 5)):
            c0 = time.process_time()
            await asyncio.to_thread(fetch)
            https_cpu.append(time.process_time() - c0)
        await server.stop()
    print(
        f"exporter with {n_devices} devices and {len(insts)} instances: {samples} samples, {len(body)} bytes"
    )
    print(
        f"render (copy on the loop + text in a thread): CPU per scrape p50 {pct(cpu, 50) * 1000:.1f} ms, "
        f"p95 {pct(cpu, 95) * 1000:.1f} ms; wall p50 {pct(wall, 50) * 1000:.1f} ms ({scrapes} scrapes)"
    )
    print(
        f"over HTTPS incl. TLS handshake and the client: CPU per scrape p50 {pct(https_cpu, 50) * 1000:.1f} ms "
        f"({len(https_cpu)} scrapes); at a 15 s scrape interval: "
        f"{pct(cpu, 50) / 15 * 100:.2f} % of one core for rendering"
    )


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.metrics_scrape")
    ap.add_argument("--devices", type=int, default=1000)
    ap.add_argument("--scrapes", type=int, default=50)
    a = ap.parse_args()
    asyncio.run(run(a.devices, a.scrapes))


if __name__ == "__main__":
    main()
