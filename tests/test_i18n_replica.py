"""Errors that replicas send, in the CLI reader's language: a real replica (one kunlun-platform
process on a real 3-member TLS etcd) sends its errors with a message id, and the real kunlun-cli
under LANG=zh_CN.UTF-8 prints them in Chinese, in English otherwise; `-o json` stays English; a
server that sends no id (an older replica) or an id with a template this CLI does not know is shown
with its English text. The refusals a replica sends an agent carry ids too."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from controlplane.api.auth import Ctx
from controlplane.cli.client import Client, CliError
from controlplane.cli.config import ClientConfig, write_client_config
from devcluster.cluster import ClusterSpec, LocalCluster
from kunlun_common.api import cluster_pb2, cluster_pb2_grpc
from kunlun_common.messages import msg
from kunlun_common.pki import paths_for
from kunlun_common.tls import load_tls, server_credentials

ROOT = Path(__file__).resolve().parent.parent
FAST_TMP = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None


@pytest.fixture(scope="module")
def replica() -> Iterator[LocalCluster]:
    """etcd and a single replica: enough for the replicas' errors, without agents or gateways."""
    base = Path(tempfile.mkdtemp(prefix="kunlun-i18n-", dir=FAST_TMP))
    c = LocalCluster(
        ClusterSpec(
            base_dir=base, replicas=1, node_configs=(), gateways=0, metrics=False, extra_nodes=("node-x",)
        )
    )
    try:
        base.mkdir(parents=True, exist_ok=True)
        c.make_certs()
        c.start_etcd()
        c.start_replicas()
        yield c
    finally:
        c.stop()
        shutil.rmtree(base, ignore_errors=True)


def _config(c: LocalCluster, role: str, name: str) -> Path:
    p = paths_for(c.cert_dir, role, name)
    path = c.base / f"client-{name}.yaml"
    write_client_config(path, ClientConfig(tuple(c.endpoints), str(p.ca), str(p.cert), str(p.key)))
    return path


def _cli(config: Path, lang: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LANG", "LC_", "KUNLUN_"))}
    env.update(LANG=lang, KUNLUN_CONFIG=str(config), COLUMNS="200")
    return subprocess.run(
        [sys.executable, "-m", "controlplane.cli.main", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=False,
    )


def test_replica_errors_in_chinese_and_english(replica: LocalCluster) -> None:
    admin = _config(replica, "operator", "admin")
    (ep,) = replica.endpoints
    zh = _cli(admin, "zh_CN.UTF-8", "workload", "describe", "nosuch")
    assert zh.returncode == 1, zh.stderr
    assert (
        zh.stderr.strip()
        == f"kunlun-cli: {ep}: 未找到: 未找到工作负载 'nosuch'；请查看 `kunlun-cli workload list`"
    )
    en = _cli(admin, "C.UTF-8", "workload", "describe", "nosuch")
    assert en.returncode == 1, en.stderr
    assert en.stderr.strip() == (
        f"kunlun-cli: {ep}: not found: workload 'nosuch' not found; see `kunlun-cli workload list`"
    )
    # refused by role (the @rpc wrapper's authorization), with the caller's identity as a value
    viewer = _config(replica, "viewer", "viewer")
    denied = _cli(viewer, "zh_CN.UTF-8", "workload", "delete", "nosuch")
    assert denied.returncode == 1, denied.stderr
    assert (
        "权限不足: " in denied.stderr and "无权调用 DeleteWorkload（允许的角色：operator）" in denied.stderr
    )
    # JSON output stays English, whatever the language
    out = _cli(admin, "zh_CN.UTF-8", "-o", "json", "workload", "list")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"items": []}


class _OldReplica(cluster_pb2_grpc.ClusterServiceServicer):
    """A server as replicas were before message ids (and one from a version with other wording)."""

    async def DescribeDevice(
        self, request: cluster_pb2.DescribeDeviceRequest, context: Ctx
    ) -> cluster_pb2.DescribeDeviceResponse:
        if request.name == "old":
            await context.abort(grpc.StatusCode.NOT_FOUND, "device 'old' not found")
        m = msg("device.not_found", "there is no device {name!r} (reworded)", name=request.name)
        await context.abort(grpc.StatusCode.NOT_FOUND, str(m), m.to_metadata())
        raise AssertionError("unreachable")


async def test_errors_without_a_known_id_stay_english(
    cert_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = grpc.aio.server()
    cluster_pb2_grpc.add_ClusterServiceServicer_to_server(_OldReplica(), server)  # type: ignore[abstract]
    port = server.add_secure_port(
        "127.0.0.1:0", server_credentials(load_tls(paths_for(cert_dir, "replica", "replica-1")))
    )
    await server.start()
    monkeypatch.setenv("LANGUAGE", "zh_CN")
    p = paths_for(cert_dir, "operator", "admin")
    client = Client(ClientConfig((f"127.0.0.1:{port}",), str(p.ca), str(p.cert), str(p.key)), timeout_s=10)

    def describe(name: str) -> str:
        with pytest.raises(CliError) as err:
            client.call(lambda s: s.DescribeDevice, cluster_pb2.DescribeDeviceRequest(name=name))
        return str(err.value)

    try:
        old = await asyncio.to_thread(describe, "old")
        assert old == f"127.0.0.1:{port}: 未找到: device 'old' not found"
        reworded = await asyncio.to_thread(describe, "x")
        assert reworded == f"127.0.0.1:{port}: 未找到: there is no device 'x' (reworded)"
    finally:
        await server.stop(None)


def test_validation_errors_from_the_replica_in_chinese(replica: LocalCluster) -> None:
    """Spec and scheduler-config validation: every problem of the list translated, English unchanged."""
    admin = _config(replica, "operator", "admin")
    (ep,) = replica.endpoints
    bad = ("workload", "submit", "--name", "Bad_Name", "--model", "m", "--replicas", "5000")
    zh = _cli(admin, "zh_CN.UTF-8", *bad)
    assert zh.returncode == 1, zh.stderr
    assert zh.stderr.strip() == (
        f"kunlun-cli: {ep}: 参数无效: 无效的工作负载规格：\n"
        "  name：'Bad_Name' 不是有效的名称；请使用小写字母、数字、'-' 和 '.'，最多 63 个字符\n"
        "  replicas：应为 0..1000，实际为 5000"
    )
    en = _cli(admin, "C.UTF-8", *bad)
    assert en.stderr.strip() == (
        f"kunlun-cli: {ep}: invalid argument: invalid workload spec:\n"
        "  name: 'Bad_Name' is not a valid name; use lowercase letters, digits, '-' and '.', at most 63\n"
        "  replicas: expected 0..1000, found 5000"
    )
    zh = _cli(admin, "zh_CN.UTF-8", "device", "describe", "nosuch")
    assert zh.stderr.strip() == (
        f"kunlun-cli: {ep}: 参数无效: name：无效的设备名称 'nosuch'：应为 <node>/<type>:<index>，例如 node-a/ascend:0"
    ), zh.stderr
    en = _cli(admin, "C.UTF-8", "device", "describe", "nosuch")
    assert en.stderr.strip() == (
        f"kunlun-cli: {ep}: invalid argument: name: invalid device name 'nosuch': expected "
        "<node>/<type>:<index>, e.g. node-a/ascend:0"
    ), en.stderr
    cfg = replica.base / "scheduler_config.yaml"
    cfg.write_text("policy: spreed\nmax_placements_per_commit: 0\n")
    zh = _cli(admin, "zh_CN.UTF-8", "scheduler", "config", "set", "-f", str(cfg))
    assert zh.returncode == 1, zh.stderr
    assert zh.stderr.startswith(
        f"kunlun-cli: {ep}: 参数无效: scheduler_config.yaml：2 个问题：\n  - policy："
    ), zh.stderr
    assert (
        "\n  - max_placements_per_commit：应为 1 到 64 的整数（每个事务 128 个 etcd 操作，每次放置 2 个），实际为 0"
        in zh.stderr
    )


def test_a_registration_refusal_carries_its_id(
    replica: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An agent whose registration names another node than its certificate: refused with the English
    text as before in the details and every problem's id in the metadata, translated one by one."""
    from kunlun_common import tls
    from kunlun_common.api import agent_pb2, agent_pb2_grpc, types_pb2
    from kunlun_common.i18n import localize
    from kunlun_common.messages import from_metadata

    (ep,) = replica.endpoints
    creds = tls.channel_credentials(tls.load_tls(paths_for(replica.cert_dir, "agent", "node-x")))
    device = types_pb2.Device(name="node-y/npu:0", node="node-z", device_type="npu", index=0)
    register = agent_pb2.RegisterNode(node="node-y", devices=[device])
    with grpc.secure_channel(ep, creds) as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            next(iter(stub.Connect(iter([agent_pb2.AgentMessage(register=register)]), timeout=30)))
    e = err.value
    assert e.code() == grpc.StatusCode.PERMISSION_DENIED, e.details()
    english = (
        "node: the agent certificate is for node 'node-x' but the registration names 'node-y'; the "
        "certificate decides which node an agent may speak for; devices[0].device_type: expected one of "
    )
    assert (e.details() or "").startswith(english), e.details()
    assert (e.details() or "").endswith("found 'npu'; devices[0].node: expected 'node-y', found 'node-z'")
    m = from_metadata(e.trailing_metadata())
    assert m is not None and m.id == "registration.refused" and str(m) == e.details()
    monkeypatch.setenv("LANGUAGE", "zh_CN")
    zh = localize(m)
    assert zh.startswith(
        "node：agent 证书属于节点 'node-x'，但注册信息写的是 'node-y'；agent 可以代表哪个节点由证书决定; "
        "devices[0].device_type：应为 "
    ), zh
    assert zh.endswith("之一，实际为 'npu'; devices[0].node：应为 'node-y'，实际为 'node-z'"), zh


def test_a_device_reason_from_a_real_agent_in_chinese_and_english(replica: LocalCluster) -> None:
    """A real kunlun-agent whose stand-in npu-smi reports chip 0 as another model with less memory and
    lacks chip 1: the replica stores each device's English reason with its message (at registration,
    and from a heartbeat when chip 1 comes back with a health warning), and `device describe` shows it
    in the reader's language (`-o json`: English as stored)."""
    from devcluster.procs import wait_for
    from node_agent.plugins.standin.state import SimChip, write_state

    state = replica.base / "node-x-state.json"
    write_state(state, [SimChip("ascend", 0, "910A", 16384)])
    config = replica.base / "node-x.yaml"
    config.write_text(
        "schema_version: 1\nnode:\n  name: node-x\n  address: 127.0.0.1\n  simulated: true\n"
        f"  simulator_state: {state}\n  health_interval_seconds: 0.5\n"
        "devices:\n  - device_type: ascend\n    device_ids: [0, 1]\n    model: 910B\n"
        "    hbm_memory_mb: 32768\n    supported_dtypes: [fp16]\n    topology_distance: [[0, 1], [1, 0]]\n"
    )
    admin = _config(replica, "operator", "admin")

    def reason_of(name: str) -> str:
        return next((d.status_reason for d in replica.devices() if d.name == name), "")

    agent = replica.start_agent(config, "node-x")
    try:
        wait_for(lambda: reason_of("node-x/ascend:1").startswith("ascend:1 declared"), 60, "node-x's devices")
        missing = _cli(admin, "zh_CN.UTF-8", "device", "describe", "node-x/ascend:1")
        assert missing.stdout.endswith(
            "\n\nError：ascend:1 已声明，但 npu-smi 没有找到它（它报告的索引：0）\n"
        )
        write_state(
            state,
            [SimChip("ascend", 0, "910A", 16384), SimChip("ascend", 1, "910B", 32768, health="Warning")],
        )
        wait_for(lambda: reason_of("node-x/ascend:1") == "npu-smi reports health Warning", 60, "a heartbeat")
        back = _cli(admin, "zh_CN.UTF-8", "device", "describe", "node-x/ascend:1")
        assert back.returncode == 0, back.stderr
        assert [line for line in back.stdout.splitlines() if line.startswith("状态原因")] == [
            "状态原因            npu-smi 报告健康状态为 Warning"
        ], back.stdout
    finally:
        agent.stop()
    zh = _cli(admin, "zh_CN.UTF-8", "device", "describe", "node-x/ascend:0")
    en = _cli(admin, "C.UTF-8", "device", "describe", "node-x/ascend:0")
    assert zh.returncode == en.returncode == 0, (zh.stderr, en.stderr)
    zh_reason = (
        "ascend:0：声明的型号为 '910B'，npu-smi 报告为 '910A'; ascend:0：声明 32768 MB，npu-smi 报告 16384 MB"
    )
    en_reason = (
        "ascend:0: declared model '910B', npu-smi reports '910A'; ascend:0: declared 32768 MB, npu-smi reports "
        "16384 MB"
    )
    assert [line for line in zh.stdout.splitlines() if line.startswith("状态原因")] == [
        f"状态原因            {zh_reason}"
    ], zh.stdout
    assert zh.stdout.endswith(f"\n节点地址            127.0.0.1\n\nError：{zh_reason}\n"), zh.stdout
    assert [line for line in en.stdout.splitlines() if line.startswith("Status reason")] == [
        f"Status reason       {en_reason}"
    ], en.stdout
    assert en.stdout.endswith(f"\nNode address        127.0.0.1\n\nError: {en_reason}\n"), en.stdout
    out = _cli(admin, "zh_CN.UTF-8", "-o", "json", "device", "describe", "node-x/ascend:0")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["status_reason"] == en_reason
