"""A canary rollout analysed and stopped by the leader on its own: a real control plane (3-member
etcd, 3 replicas), three gateways, a baseline without errors and a canary test engine failing 5% of
its requests; traffic goes to ONE gateway only, yet the leader (which sees every gateway's
counters through `gateway-stats/`) turns the rollout Degraded with the numbers that failed."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from controlplane.store import EtcdStore
from kunlun_common.api import workload_pb2
from tests.conftest import store_settings
from tests.sched_helpers import get, submit
from tests.test_gateway_cluster import NODE, GatewayCluster, cli, set_status, simulated_node_cluster
from tests.test_gateway_support import Engine, GatewayProc, post, start_engines, until

PY = sys.executable


@pytest.fixture(scope="module")
def rcluster() -> Iterator[GatewayCluster]:
    with simulated_node_cluster("kunlun-rollout-cluster-", "test_rollout_cluster") as c:
        yield c


@pytest.fixture(scope="module")
def cli_config(rcluster: GatewayCluster) -> Path:
    from controlplane.cli.config import ClientConfig, write_client_config
    from kunlun_common.pki import paths_for

    p = paths_for(rcluster.cert_dir, "operator", "admin")
    path = rcluster.base / "cli.yaml"
    write_client_config(path, ClientConfig(tuple(rcluster.endpoints), str(p.ca), str(p.cert), str(p.key)))
    return path


@pytest.fixture(scope="module")
async def store(rcluster: GatewayCluster) -> AsyncIterator[EtcdStore]:
    s = EtcdStore(store_settings(rcluster.cert_dir, rcluster.etcd.endpoints))
    await s.connect()
    yield s
    await s.close()


def instances(c: GatewayCluster, variant: str) -> list[workload_pb2.Instance]:
    insts = [
        i for i in get(c, "chat").instances if i.variant == variant and i.node == NODE and i.target_devices
    ]
    return sorted(insts, key=lambda i: i.ordinal)


def status_text(config: Path) -> str:
    """`kunlun-cli rollout status chat` as people read it."""
    r = subprocess.run(
        [PY, "-m", "tests.test_gateway_support", "cli", "rollout", "status", "chat"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"KUNLUN_CONFIG": str(config), "PATH": "/usr/bin:/bin"},
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


async def test_a_failing_canary_is_stopped_by_the_analysis(
    rcluster: GatewayCluster, cli_config: Path, store: EtcdStore
) -> None:
    base = rcluster.base
    engines: list[Engine] = []
    gateways: list[GatewayProc] = []
    try:
        engines = await start_engines(base / "engines", ["b0", "b1"])
        engines += await start_engines(base / "engines", ["c0"], "--error-rate", "0.05", "--seed", "7")
        gateways = [
            GatewayProc(
                base / "gw",
                f"gateway-{i}",
                f"--name=gateway-{i}",
                f"--endpoints={','.join(rcluster.endpoints)}",
                f"--cert-dir={rcluster.cert_dir}",
                "--health-interval=0",
                "--heartbeat-interval=1",
            )
            for i in (1, 2, 3)
        ]
        await asyncio.to_thread(
            submit,
            rcluster,
            name="chat",
            model="demo",
            devices_per_instance=1,
            memory_per_device_mb=1000,
            replicas=2,
        )
        baseline = await until(
            lambda: asyncio.to_thread(lambda: len(b := instances(rcluster, "")) == 2 and b),
            60,
            "chat placed",
            0.2,
        )
        for inst, e in zip(baseline, engines[:2], strict=True):
            await set_status(store, inst, "Running", e.address)

        created = await asyncio.to_thread(
            cli,
            cli_config,
            "rollout",
            "create",
            "chat",
            "--model=demo-v2",
            "--steps=50,100",
            "--interval=3s",
            "--min-requests=150",
        )
        assert created["phase"] == "Progressing" and created["canary_weight_pct"] == 50
        canary = await until(
            lambda: asyncio.to_thread(lambda: instances(rcluster, "canary")), 30, "the canary placed", 0.2
        )
        await set_status(store, canary[0], "Running", engines[2].address)
        gw = gateways[0]

        async def routable() -> bool:
            st = await gw.status()
            return len(st["workloads"].get("chat", {}).get("instances", [])) == 3

        await until(lambda: gw.ready(), 30, "gateway-1 fed")
        await until(routable, 15, "gateway-1 to route to the canary too")

        # 600 requests, about half to each version, all through gateway-1
        served: list[tuple[int, str]] = []

        async def client() -> None:
            conn = gw.connect()
            try:
                for _ in range(150):
                    r = await post(
                        conn, "/v1/completions", b'{"model": "chat", "prompt": "hi", "max_tokens": 1}'
                    )
                    served.append((r.status, r.json().get("model", "") if r.status == 200 else ""))
            finally:
                await conn.close()

        await asyncio.gather(*(client() for _ in range(4)))
        by_model = Counter(m for _, m in served)
        assert len(served) == 600 and {s for s, _ in served} <= {200, 500}, Counter(s for s, _ in served)
        assert by_model["c0"] >= 130 and by_model["b0"] + by_model["b1"] >= 250, by_model

        async def degraded() -> dict[str, Any] | None:
            r = await asyncio.to_thread(cli, cli_config, "rollout", "status", "chat")
            return r if r["phase"] == "Degraded" else None

        st = await until(degraded, 30, "the rollout to turn Degraded", 0.5)
        a = st["analysis"]
        assert a["verdict"] == "Failed" and st["canary_weight_pct"] == 0
        assert a["canary"]["errors"] > 0 and a["canary"]["requests"] >= 150
        assert a["baseline"]["errors"] == 0 and a["baseline"]["requests"] >= 150
        assert "canary error rate" in st["reason"] and f"({a['canary']['errors']}/" in st["reason"]
        # the canary goes, the baseline stays
        await until(
            lambda: asyncio.to_thread(lambda: not instances(rcluster, "canary")), 30, "canary removed", 0.2
        )
        assert [i.id for i in instances(rcluster, "")] == [i.id for i in baseline]
        text = await asyncio.to_thread(status_text, cli_config)
        assert "Degraded" in text and "P95 VS BASELINE" in text and "canary" in text, text
    finally:
        for g in gateways:
            g.stop()
        for e in engines:
            e.stop()
