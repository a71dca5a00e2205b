"""kunlun-gateway against a real control plane: 3-member etcd, 3 replicas serving GatewayService,
a simulated node whose instances are made Running by writing their status (pointing at test
engines started here), the CLI for keys and policies, registration, and failover between replicas.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from controlplane import keys
from controlplane.cli.client import Client
from controlplane.cli.config import load_client_config
from controlplane.cli.gateway_cmd import live_gateways
from controlplane.feeds import encode_status
from controlplane.store import EtcdStore
from devcluster.cluster import ClusterSpec, LocalCluster
from devcluster.procs import ManagedProcess, wait_for
from gateway.httpclient import HttpConnection
from kunlun_common.api import agent_pb2, workload_pb2
from tests.conftest import FAST_TMP, LOG_KEEP, store_settings
from tests.sched_helpers import get, submit
from tests.test_gateway_support import Engine, GatewayProc, post, start_engines, until

PY = sys.executable
NODE = "node-g"


class GatewayCluster(LocalCluster):
    """A local cluster whose replicas also serve GatewayService, and no real agents."""

    def replica_argv(self, name: str, address: str) -> list[str]:
        argv = super().replica_argv(name, address)
        return [argv[0], "-m", "tests.test_gateway_support", "replica", *argv[3:]]


@contextlib.contextmanager
def simulated_node_cluster(prefix: str, keep_as: str) -> Iterator[GatewayCluster]:
    """Real etcd + 3 replicas (serving GatewayService) + one simulated agent that runs nothing.

    Logs are kept under $TMPDIR/kunlun-test-logs/<keep_as>/ after it stops.
    """
    base = Path(tempfile.mkdtemp(prefix=prefix, dir=FAST_TMP))
    c = GatewayCluster(ClusterSpec(base_dir=base, node_configs=(), extra_nodes=(NODE,), gateways=0))
    try:
        c.start()
        agent = ManagedProcess(
            f"agent-{NODE}",
            [PY, "-m", "tests.test_gateway_support", "agent", NODE, ",".join(c.endpoints), str(c.cert_dir)],
            base / "agents" / NODE / "agent.log",
        )
        agent.start()
        c.agents[NODE] = agent
        wait_for(lambda: c.node_ready(NODE), 60, f"simulated node {NODE} to be Ready")
        yield c
    finally:
        c.stop()
        keep = LOG_KEEP / keep_as
        shutil.rmtree(keep, ignore_errors=True)
        for log in [*base.glob("replicas/*.log"), *base.glob("agents/*/agent.log"), *base.glob("gw/*.log")]:
            dest = keep / log.relative_to(base)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(log, dest)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def gcluster() -> Iterator[GatewayCluster]:
    with simulated_node_cluster("kunlun-gw-cluster-", "test_gateway_cluster") as c:
        yield c


@pytest.fixture(scope="module")
def cli_config(gcluster: GatewayCluster) -> Path:
    from controlplane.cli.config import ClientConfig, write_client_config
    from kunlun_common.pki import paths_for

    p = paths_for(gcluster.cert_dir, "operator", "admin")
    path = gcluster.base / "cli.yaml"
    write_client_config(path, ClientConfig(tuple(gcluster.endpoints), str(p.ca), str(p.cert), str(p.key)))
    return path


def cli(config: Path, *args: str) -> Any:
    r = subprocess.run(
        [PY, "-m", "tests.test_gateway_support", "cli", *args, "-o", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"KUNLUN_CONFIG": str(config), "PATH": "/usr/bin:/bin"},
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
async def engines(gcluster: GatewayCluster) -> AsyncIterator[list[Engine]]:
    es = await start_engines(gcluster.base / "engines", ["c0", "c1"])
    yield es
    for e in es:
        e.stop()


@pytest.fixture(scope="module")
async def store(gcluster: GatewayCluster) -> AsyncIterator[EtcdStore]:
    s = EtcdStore(store_settings(gcluster.cert_dir, gcluster.etcd.endpoints))
    await s.connect()
    yield s
    await s.close()


@pytest.fixture(scope="module")
async def chat(gcluster: GatewayCluster, engines: list[Engine]) -> list[workload_pb2.Instance]:
    """Workload `chat` with 2 instances placed on the simulated node (not Running yet)."""
    await asyncio.to_thread(
        submit,
        gcluster,
        name="chat",
        model="demo",
        devices_per_instance=1,
        memory_per_device_mb=1000,
        replicas=2,
    )

    def placed() -> list[workload_pb2.Instance] | None:
        insts = [i for i in get(gcluster, "chat").instances if i.node == NODE and i.target_devices]
        return sorted(insts, key=lambda i: i.ordinal) if len(insts) == 2 else None

    result: list[workload_pb2.Instance] = await until(
        lambda: asyncio.to_thread(placed), 60, "chat to be placed", 0.2
    )
    return result


async def set_status(store: EtcdStore, inst: workload_pb2.Instance, phase: str, endpoint: str = "") -> None:
    st = agent_pb2.InstanceStatus(
        instance_id=inst.id, phase=phase, endpoint=endpoint, workload_id=inst.workload_id
    )
    await store.put(keys.instance_status(inst.id), encode_status(inst.node, st))


@pytest.fixture(scope="module")
async def gw(gcluster: GatewayCluster) -> AsyncIterator[GatewayProc]:
    g = GatewayProc(
        gcluster.base / "gw",
        "gateway-1",
        "--name=gateway-1",
        f"--endpoints={','.join(gcluster.endpoints)}",
        f"--cert-dir={gcluster.cert_dir}",
        "--require-api-key",
        "--health-interval=0",
        "--heartbeat-interval=1",
    )
    yield g
    g.stop()


async def instances_seen(gw: GatewayProc, workload: str) -> dict[str, dict[str, Any]]:
    st = await gw.status()
    return {i["instance_id"]: i for i in st["workloads"].get(workload, {}).get("instances", [])}


async def test_gateway_serves_what_the_control_plane_says(
    gcluster: GatewayCluster,
    cli_config: Path,
    store: EtcdStore,
    chat: list[workload_pb2.Instance],
    engines: list[Engine],
    gw: GatewayProc,
) -> None:
    created = await asyncio.to_thread(cli, cli_config, "gateway", "keys", "create", "team-a")
    secret = created["secret"]
    assert secret.startswith("kl-") and created["name"] == "team-a" and "hash" not in created
    listed = (await asyncio.to_thread(cli, cli_config, "gateway", "keys", "list"))["items"]
    assert [k["id"] for k in listed] == [created["id"]] and secret not in json.dumps(listed)
    gw.key = secret
    await until(lambda: gw.ready(), 30, "the gateway to be fed")

    # not Running yet: 503 that names the workload and why
    conn = HttpConnection("127.0.0.1", gw.port)
    try:
        body = b'{"model": "chat", "prompt": "hi"}'
        r = await post(conn, "/v1/completions", body, gw.headers())
        assert r.status == 503 and "'chat'" in r.json()["error"]["message"], r.body

        for inst, e in zip(chat, engines, strict=True):
            await set_status(store, inst, "Running", e.address)
        await until(lambda: _count(gw, "chat", 2), 10, "both instances routable")
        got: Counter[str] = Counter()
        for _ in range(10):
            r = await post(conn, "/v1/completions", body, gw.headers())
            assert r.status == 200, r.body
            got[r.json()["model"]] += 1
        assert got == {"c0": 5, "c1": 5}

        # the control plane drops an instance: the gateway stops using it at once
        await set_status(store, chat[1], "Failed")
        await until(lambda: _count(gw, "chat", 1), 5, "the failed instance removed")
        for _ in range(6):
            r = await post(conn, "/v1/completions", body, gw.headers())
            assert r.json()["model"] == "c0"

        # routing policy set by an operator reaches the gateway
        pol = await asyncio.to_thread(
            cli, cli_config, "gateway", "policy", "set", "chat", "least_outstanding"
        )
        assert pol["policy"] == "least_outstanding" and pol["updated_by"] == "operator:admin"

        async def policy() -> bool:
            return bool((await gw.status())["workloads"]["chat"]["policy"] == "least_outstanding")

        await until(policy, 5, "the policy to reach the gateway")
        pols = (await asyncio.to_thread(cli, cli_config, "gateway", "policy", "list"))["items"]
        assert [(p["workload"], p["policy"]) for p in pols] == [("chat", "least_outstanding")]

        # registration: listed while alive, with its address and pid
        gws = (await asyncio.to_thread(cli, cli_config, "gateway", "list"))["items"]
        me = next(g for g in gws if g["name"] == "gateway-1")
        assert (
            me["address"] == gw.address and me["pid"] == gw.proc.pid and me["replica"].startswith("replica-")
        )
        client = Client(load_client_config(cli_config))
        assert [g["name"] for g in await asyncio.to_thread(live_gateways, client)] == ["gateway-1"]

        # a revoked key is refused within moments
        await asyncio.to_thread(cli, cli_config, "gateway", "keys", "revoke", created["id"])

        async def refused() -> bool:
            return (await post(conn, "/v1/completions", body, gw.headers())).status == 401

        await until(refused, 5, "the revoked key to be refused")
        revoked = (await asyncio.to_thread(cli, cli_config, "gateway", "keys", "list", "--all"))["items"]
        assert revoked[0]["revoked"] and revoked[0]["revoked_by"] == "operator:admin"
    finally:
        await conn.close()


async def test_request_endpoint_defined_by_cli_is_served_by_the_gateway(
    gcluster: GatewayCluster,
    cli_config: Path,
    store: EtcdStore,
    chat: list[workload_pb2.Instance],
    engines: list[Engine],
    gw: GatewayProc,
) -> None:
    """Request-as-a-Service end to end: `endpoint create` validated at the API, stored, pushed to
    the gateway, served with validation both ways; describe/list/delete; delete stops serving."""
    await set_status(store, chat[0], "Running", engines[0].address)
    d = gcluster.base / "raas"
    d.mkdir(exist_ok=True)
    ins = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
    outs = {
        "type": "object",
        "properties": {"summary": {"type": "string", "maxLength": 20}},
        "required": ["summary"],
    }
    (d / "in.json").write_text(json.dumps(ins))
    (d / "out.json").write_text(json.dumps(outs))
    (d / "bad.json").write_text(json.dumps({"type": "objekt"}))
    (d / "prompt.txt").write_text("Summarize: {text}")
    base_args = ["--input-schema", str(d / "in.json"), "--output-schema", str(d / "out.json")]

    def cli_fails(*args: str) -> str:
        r = subprocess.run(
            [PY, "-m", "tests.test_gateway_support", "cli", *args],
            capture_output=True,
            text=True,
            timeout=60,
            env={"KUNLUN_CONFIG": str(cli_config), "PATH": "/usr/bin:/bin"},
        )
        assert r.returncode != 0, r.stdout
        return r.stderr

    err = await asyncio.to_thread(cli_fails, "endpoint", "create", "sum", "--workload", "nope", *base_args)
    assert "workload: 'nope' does not exist" in err, err
    err = await asyncio.to_thread(
        cli_fails, "endpoint", "create", "sum", "--workload", "chat",
        "--input-schema", str(d / "bad.json"), "--output-schema", str(d / "out.json"),
    )  # fmt: skip
    assert "input_schema: not a valid JSON Schema" in err, err
    err = await asyncio.to_thread(
        cli_fails, "endpoint", "create", "Bad_Name", "--workload", "chat", *base_args
    )
    assert "name: 'Bad_Name' is not a valid name" in err, err

    made = await asyncio.to_thread(
        cli, cli_config, "endpoint", "create", "sum", "--workload", "chat", *base_args,
        "--prompt-template", str(d / "prompt.txt"),
    )  # fmt: skip
    assert made["version"] == 1 and made["updated_by"] == "operator:admin" and made["input_schema"] == ins
    again = await asyncio.to_thread(
        cli, cli_config, "endpoint", "create", "sum", "--workload", "chat", *base_args
    )
    assert again["version"] == 2 and again["prompt_template"] == ""
    listed = (await asyncio.to_thread(cli, cli_config, "endpoint", "list"))["items"]
    assert [(e["name"], e["workload"], e["version"]) for e in listed] == [("sum", "chat", 2)]
    described = await asyncio.to_thread(cli, cli_config, "endpoint", "describe", "sum")
    assert described["output_schema"] == outs

    created = await asyncio.to_thread(cli, cli_config, "gateway", "keys", "create", "raas")
    gw.key = created["secret"]
    conn = HttpConnection("127.0.0.1", gw.port)
    try:

        async def served() -> Any:
            r = await post(conn, "/v1/endpoints/sum", b'{"text": "the quick brown fox"}', gw.headers())
            return r if r.status == 200 else None

        r = await until(served, 15, "the endpoint to reach the gateway and answer")
        summary = r.json()["summary"]
        assert isinstance(summary, str) and len(summary) <= 20, r.body
        r = await post(conn, "/v1/endpoints/sum", b'{"text": 5}', gw.headers())
        assert r.status == 400 and "$.text" in r.json()["error"]["message"], r.body

        gone = await asyncio.to_thread(cli, cli_config, "endpoint", "delete", "sum")
        assert gone["name"] == "sum"

        async def not_found() -> bool:
            r = await post(conn, "/v1/endpoints/sum", b'{"text": "x"}', gw.headers())
            return r.status == 404

        await until(not_found, 15, "the deleted endpoint to stop being served")
    finally:
        await conn.close()
        await asyncio.to_thread(cli, cli_config, "gateway", "keys", "revoke", created["id"])


async def test_gateway_fails_over_when_its_replica_dies(
    gcluster: GatewayCluster,
    cli_config: Path,
    store: EtcdStore,
    chat: list[workload_pb2.Instance],
    engines: list[Engine],
    gw: GatewayProc,
) -> None:
    created = await asyncio.to_thread(cli, cli_config, "gateway", "keys", "create", "team-b")
    gw.key = created["secret"]
    await until(lambda: gw.ready(), 30, "the gateway to be fed")
    feed = (await gw.status())["feed"]
    victim = next(n for n, a in gcluster.replica_addrs.items() if a == feed["connected_to"])
    gcluster.replicas[victim].kill()
    try:
        await set_status(store, chat[1], "Running", engines[1].address)

        async def followed() -> bool:
            f = (await gw.status())["feed"]
            return bool(f["connected_to"] not in ("", feed["connected_to"])) and await _count(gw, "chat", 2)

        await until(followed, 15, "the gateway to follow another replica")
        # registered again through the new replica
        gws = (await asyncio.to_thread(cli, cli_config, "gateway", "list"))["items"]
        me = next(g for g in gws if g["name"] == "gateway-1")
        await until(
            lambda: asyncio.to_thread(_registered_elsewhere, cli_config, victim), 15, "registration elsewhere"
        )
        assert me["pid"] == gw.proc.pid
    finally:
        gcluster.restart_replica(victim)
        wait_for(lambda: gcluster.replica_serving(victim), 60, f"{victim} back")


def _registered_elsewhere(config: Path, victim: str) -> bool:
    gws = cli(config, "gateway", "list")["items"]
    return any(g["name"] == "gateway-1" and g["replica"] != victim for g in gws)


async def test_dead_gateway_leaves_the_list(
    gcluster: GatewayCluster, cli_config: Path, gw: GatewayProc
) -> None:
    def listed() -> bool:
        return any(g["name"] == "gateway-1" for g in cli(cli_config, "gateway", "list")["items"])

    await until(lambda: asyncio.to_thread(listed), 15, "gateway-1 listed")
    gw.proc.kill()
    await until(lambda: asyncio.to_thread(lambda: not listed()), 20, "gateway-1 to leave the list", 0.5)


async def _count(gw: GatewayProc, workload: str, n: int) -> bool:
    return len(await instances_seen(gw, workload)) == n
