"""List RPCs page (controlplane/paging.py): 40,000 devices do not fit one 4 MiB gRPC message, so
the replicas answer in pages read at one etcd revision and the CLI pages through them.

Real parts: node records written straight into the real 3-member TLS etcd (1,000 nodes x 40
devices, as agents' registrations would write them), the replicas' servicers on a real mTLS gRPC
server, and the real `kunlun-cli` as a subprocess."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from controlplane import keys, paging
from controlplane.api.cluster_service import ClusterService
from controlplane.api.endpoint_service import EndpointService
from controlplane.api.gateway_service import GatewayService
from controlplane.api.package_service import PackageService
from controlplane.api.rollout_service import RolloutService
from controlplane.api.telemetry_service import TelemetryService
from controlplane.api.workload_service import WorkloadService
from controlplane.cli.config import ClientConfig, write_client_config
from controlplane.feeds import Feeds
from controlplane.store import EtcdStore, PutOp
from kunlun_common.api import (
    cluster_pb2,
    cluster_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    package_pb2,
    package_pb2_grpc,
    rollout_pb2,
    rollout_pb2_grpc,
    telemetry_pb2,
    telemetry_pb2_grpc,
    types_pb2,
    workload_pb2,
    workload_pb2_grpc,
)
from kunlun_common.pki import paths_for
from kunlun_common.tls import channel_credentials, load_tls, server_credentials

NODES = 1000
DEVICES = 40
GRPC_DEFAULT_LIMIT = 4 * 1024 * 1024


def node_name(i: int) -> str:
    return f"pg-{i:04d}"


def node_record(i: int, name: str = "") -> types_pb2.Node:
    name = name or node_name(i)
    return types_pb2.Node(
        name=name,
        address=f"10.0.{i // 250}.{i % 250}",
        agent_version="0.1.0",
        agent_pid=1000 + i,
        devices=[
            types_pb2.Device(
                name=f"{name}/ascend:{d}",
                node=name,
                device_type="ascend",
                index=d,
                model="Ascend910B3",
                hbm_memory_mb=65536,
                total_memory_mb=65536,
                fp16_tflops=313.0,
                bf16_tflops=313.0,
                int8_tflops=626.0,
                supported_dtypes=["fp16", "bf16", "int8"],
                status=types_pb2.DEVICE_STATUS_READY,
                status_reason="healthy (npu-smi: OK)",
                plugin="ascend",
            )
            for d in range(DEVICES)
        ],
    )


async def write_nodes(store: EtcdStore) -> None:
    """The records registrations write: node, liveness (even nodes only: odd ones are NotReady),
    one telemetry snapshot."""
    ops: list[PutOp] = []
    for i in range(NODES):
        ops.append(PutOp(keys.node(node_name(i)), keys.encode_message(node_record(i))))
        if i % 2 == 0:
            ops.append(PutOp(keys.alive(node_name(i)), keys.encode({"replica": "r-1", "lease": 1})))
    ops.append(
        PutOp(
            keys.telemetry(node_name(2)),
            keys.encode({"at_ms": 1, "devices": {f"{node_name(2)}/ascend:3": {"utilization_pct": 75.0}}}),
        )
    )
    for at in range(0, len(ops), 100):  # etcd takes at most 128 operations per transaction
        result = await store.txn([], ops[at : at + 100])
        assert result.succeeded


async def clear_nodes(store: EtcdStore) -> None:
    for prefix in (keys.NODES, keys.ALIVE, keys.TELEMETRY, keys.ALLOC, keys.INSTANCES):
        await store.delete(prefix, prefix=True)


class Server:
    """The replica's list servicers on a real mTLS gRPC server."""

    def __init__(self, store: EtcdStore, cert_dir: Path) -> None:
        self.server = grpc.aio.server()
        feeds = Feeds(None)
        tls = load_tls(paths_for(cert_dir, "replica", "replica-1"))
        cluster_pb2_grpc.add_ClusterServiceServicer_to_server(
            ClusterService(store, None, None, "replica-1"),  # type: ignore[arg-type]
            self.server,
        )
        gateway_pb2_grpc.add_GatewayServiceServicer_to_server(
            GatewayService(store, feeds, "replica-1"), self.server
        )
        gateway_pb2_grpc.add_EndpointServiceServicer_to_server(EndpointService(store), self.server)
        package_pb2_grpc.add_PackageServiceServicer_to_server(PackageService(store, feeds), self.server)
        rollout_pb2_grpc.add_RolloutServiceServicer_to_server(RolloutService(store), self.server)
        telemetry_pb2_grpc.add_TelemetryServiceServicer_to_server(
            TelemetryService(store, None, "replica-1"),  # type: ignore[arg-type]
            self.server,
        )
        workload_pb2_grpc.add_WorkloadServiceServicer_to_server(
            WorkloadService(store, feeds, tls), self.server
        )
        self.port = self.server.add_secure_port("127.0.0.1:0", server_credentials(tls))
        self.cert_dir = cert_dir

    def channel(self) -> grpc.aio.Channel:
        creds = channel_credentials(load_tls(paths_for(self.cert_dir, "operator", "admin")))
        return grpc.aio.secure_channel(f"127.0.0.1:{self.port}", creds)


@pytest.fixture
async def server(store: EtcdStore, cert_dir: Path) -> AsyncIterator[Server]:
    s = Server(store, cert_dir)
    await s.server.start()
    try:
        yield s
    finally:
        await s.server.stop(None)


async def cli(server: Server, tmp_path: Path, *args: str) -> Any:
    p = paths_for(server.cert_dir, "operator", "admin")
    cfg = tmp_path / "client.yaml"
    if not cfg.exists():
        write_client_config(
            cfg, ClientConfig((f"127.0.0.1:{server.port}",), str(p.ca), str(p.cert), str(p.key))
        )
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "controlplane.cli.main",
        "-o",
        "json",
        *args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={"KUNLUN_CONFIG": str(cfg), "PATH": "/usr/bin:/bin"},
    )
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, err.decode()
    return json.loads(out)


async def test_forty_thousand_devices_list_completely_in_pages(
    store: EtcdStore, server: Server, tmp_path: Path
) -> None:
    # the old, unpaged answer cannot carry these devices: over gRPC's default 4 MiB limit
    unpaged = cluster_pb2.ListDevicesResponse(
        devices=[d for i in range(NODES) for d in node_record(i).devices]
    )
    assert unpaged.ByteSize() > GRPC_DEFAULT_LIMIT
    await clear_nodes(store)
    try:
        await write_nodes(store)
        async with server.channel() as ch:
            stub = cluster_pb2_grpc.ClusterServiceStub(ch)
            first = await stub.ListDevices(cluster_pb2.ListDevicesRequest(page_size=1000), timeout=60)
            assert len(first.devices) == 1000 and first.next_page_token and first.revision > 0
            assert first.ByteSize() < GRPC_DEFAULT_LIMIT // 2
            # a byte budget cuts pages of big records: 500 whole nodes would pass 1 MiB
            nodes_page = await stub.ListNodes(cluster_pb2.ListNodesRequest(page_size=500), timeout=60)
            assert 0 < len(nodes_page.nodes) < 500
            assert nodes_page.ByteSize() <= paging.MAX_PAGE_BYTES + 10_000
        # a node that registers after the CLI's first page does not show in its listing: every
        # page is read at the first one's revision (the CLI asks 500 devices a page, so its
        # pages also stop inside nodes and resume there)
        await store.put(keys.node("pg-zzzz"), keys.encode_message(node_record(0, "pg-zzzz")))
        devices = (await cli(server, tmp_path, "device", "list"))["items"]
        names = [d["name"] for d in devices]
        expected = [f"{node_name(i)}/ascend:{d}" for i in range(NODES) for d in range(DEVICES)]
        assert names == [*expected, *(f"pg-zzzz/ascend:{d}" for d in range(DEVICES))]
        by_name = {d["name"]: d for d in devices}
        assert by_name[f"{node_name(2)}/ascend:3"]["utilization_pct"] == pytest.approx(75.0)
        assert by_name[f"{node_name(1)}/ascend:0"]["status"] == "Unavailable"  # odd nodes: NotReady
        assert by_name[f"{node_name(0)}/ascend:0"]["status"] == "Ready"

        nodes = (await cli(server, tmp_path, "node", "list"))["items"]
        assert [n["name"] for n in nodes] == [node_name(i) for i in range(NODES)] + ["pg-zzzz"]
        assert [n["status"] for n in nodes[:4]] == ["Ready", "NotReady", "Ready", "NotReady"]
        assert all(n["devices"] == DEVICES for n in nodes)
        one = (await cli(server, tmp_path, "device", "list", "--node", node_name(999)))["items"]
        assert [d["name"] for d in one] == [f"{node_name(999)}/ascend:{d}" for d in range(DEVICES)]
        described = await cli(server, tmp_path, "node", "describe", node_name(3))
        assert described["name"] == node_name(3) and len(described["device_names"]) == DEVICES
    finally:
        await clear_nodes(store)


async def test_pages_stop_inside_a_node_and_resume_there(store: EtcdStore, server: Server) -> None:
    await clear_nodes(store)
    try:
        ops = [PutOp(keys.node(node_name(i)), keys.encode_message(node_record(i))) for i in range(3)]
        assert (await store.txn([], ops)).succeeded
        async with server.channel() as ch:
            stub = cluster_pb2_grpc.ClusterServiceStub(ch)
            for node, size in (("", 7), ("", 40), ("", 41), (node_name(1), 7), (node_name(1), 40)):
                got: list[str] = []
                token, pages = "", 0
                while True:
                    resp = await stub.ListDevices(
                        cluster_pb2.ListDevicesRequest(node=node, page_size=size, page_token=token),
                        timeout=30,
                    )
                    assert len(resp.devices) <= size
                    got += [d.name for d in resp.devices]
                    pages += 1
                    token = resp.next_page_token
                    if not token:
                        break
                nodes = [1] if node else [0, 1, 2]
                assert got == [f"{node_name(i)}/ascend:{d}" for i in nodes for d in range(DEVICES)], (
                    node,
                    size,
                )
                assert pages <= -(-len(got) // size) + 1
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.ListDevices(
                    cluster_pb2.ListDevicesRequest(node="pg-none", page_size=5), timeout=30
                )
            assert err.value.code() == grpc.StatusCode.NOT_FOUND

            # the device metrics page the same way, each page with its devices' holders
            inst = workload_pb2.Instance(
                id="w1-0-9",
                workload_id="w1",
                workload="chat",
                phase="Running",
                node=node_name(1),
                target_devices=[f"{node_name(1)}/ascend:5", f"{node_name(1)}/ascend:6"],
            )
            await store.put(keys.instance(inst.id), keys.encode_message(inst))
            for d in inst.target_devices:
                await store.put(keys.alloc(d), keys.encode({"instance": inst.id}))
            tele = telemetry_pb2_grpc.TelemetryServiceStub(ch)
            whole = await tele.DeviceMetrics(telemetry_pb2.DeviceMetricsRequest(), timeout=30)
            for flt in ("", "workload==chat", "node=~pg-0002"):
                rows: list[telemetry_pb2.DeviceMetric] = []
                total, token = 0, ""
                for _ in range(100):
                    page = await tele.DeviceMetrics(
                        telemetry_pb2.DeviceMetricsRequest(filter=flt, page_size=7, page_token=token),
                        timeout=30,
                    )
                    assert page.total <= 7
                    rows += page.devices
                    total += page.total
                    token = page.next_page_token
                    if not token:
                        break
                assert total == whole.total == 3 * DEVICES
                unpaged = await tele.DeviceMetrics(telemetry_pb2.DeviceMetricsRequest(filter=flt), timeout=30)
                assert list(rows) == list(unpaged.devices), flt
                assert rows, flt
            held = [(r.device, r.instance, r.workload) for r in whole.devices if r.instance]
            assert held == [(d, "w1-0-9", "chat") for d in inst.target_devices]
    finally:
        await clear_nodes(store)


async def test_record_listings_page_skip_left_out_records_and_cut_at_a_megabyte(
    store: EtcdStore, server: Server
) -> None:
    """API keys (revoked ones left out unless asked for) through the generic one-record-one-item
    page; big records (1 KiB names x 300) make the byte budget cut a page."""
    await store.delete(keys.GATEWAY_KEYS, prefix=True)
    try:
        ops = [
            PutOp(
                keys.gateway_key(f"k{i:03d}"),
                keys.encode({"id": f"k{i:03d}", "name": "x" * 4000, "revoked_at_ms": 5 if i % 3 == 0 else 0}),
            )
            for i in range(300)
        ]
        for at in range(0, len(ops), 100):
            assert (await store.txn([], ops[at : at + 100])).succeeded
        async with server.channel() as ch:
            stub = gateway_pb2_grpc.GatewayServiceStub(ch)

            async def listing(size: int, revoked: bool) -> tuple[list[str], list[int]]:
                ids: list[str] = []
                lens: list[int] = []
                token = ""
                for _ in range(1000):
                    resp = await stub.ListApiKeys(
                        gateway_pb2.ListApiKeysRequest(
                            include_revoked=revoked, page_size=size, page_token=token
                        ),
                        timeout=30,
                    )
                    ids += [k.id for k in resp.keys]
                    lens.append(len(resp.keys))
                    token = resp.next_page_token
                    if not token:
                        return ids, lens
                raise AssertionError("the listing did not end")

            valid = [f"k{i:03d}" for i in range(300) if i % 3]
            ids, lens = await listing(7, False)
            assert ids == valid and max(lens) <= 7
            ids, lens = await listing(1000, True)
            assert ids == [f"k{i:03d}" for i in range(300)]
            assert len(lens) >= 2 and max(lens) * 4000 <= paging.MAX_PAGE_BYTES  # cut by bytes, not count
    finally:
        await store.delete(keys.GATEWAY_KEYS, prefix=True)


LISTS: list[tuple[str, Callable[[grpc.aio.Channel], Any], Callable[..., Any]]] = [
    ("ListNodes", lambda ch: cluster_pb2_grpc.ClusterServiceStub(ch).ListNodes, cluster_pb2.ListNodesRequest),
    (
        "ListDevices",
        lambda ch: cluster_pb2_grpc.ClusterServiceStub(ch).ListDevices,
        cluster_pb2.ListDevicesRequest,
    ),
    (
        "ListApiKeys",
        lambda ch: gateway_pb2_grpc.GatewayServiceStub(ch).ListApiKeys,
        gateway_pb2.ListApiKeysRequest,
    ),
    (
        "ListGateways",
        lambda ch: gateway_pb2_grpc.GatewayServiceStub(ch).ListGateways,
        gateway_pb2.ListGatewaysRequest,
    ),
    (
        "ListRoutingPolicies",
        lambda ch: gateway_pb2_grpc.GatewayServiceStub(ch).ListRoutingPolicies,
        gateway_pb2.ListRoutingPoliciesRequest,
    ),
    (
        "ListEndpoints",
        lambda ch: gateway_pb2_grpc.EndpointServiceStub(ch).ListEndpoints,
        gateway_pb2.ListRequestEndpointsRequest,
    ),
    (
        "ListPackages",
        lambda ch: package_pb2_grpc.PackageServiceStub(ch).ListPackages,
        package_pb2.ListPackagesRequest,
    ),
    (
        "ListRollouts",
        lambda ch: rollout_pb2_grpc.RolloutServiceStub(ch).ListRollouts,
        rollout_pb2.ListRolloutsRequest,
    ),
    (
        "DeviceMetrics",
        lambda ch: telemetry_pb2_grpc.TelemetryServiceStub(ch).DeviceMetrics,
        telemetry_pb2.DeviceMetricsRequest,
    ),
    (
        "ListWorkloads",
        lambda ch: workload_pb2_grpc.WorkloadServiceStub(ch).ListWorkloads,
        workload_pb2.ListWorkloadsRequest,
    ),
]


async def test_bad_page_requests_are_refused_naming_the_field(server: Server) -> None:
    future = paging.PageToken(10**15, "x").encode()  # a revision etcd has not reached
    forged = paging.PageToken(5, "x").encode()[:-3] + "!!!"
    async with server.channel() as ch:
        for name, method, request in LISTS:
            for size, token, field in (
                (1001, "", "page_size"),
                (-1, "", "page_size"),
                (5, "not-a-token!", "page_token"),
                (5, forged, "page_token"),
                (5, "eyJyIjowLCJhIjoiIn0", "page_token"),  # {"r":0,"a":""}
                (5, future, "page_token"),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await method(ch)(request(page_size=size, page_token=token), timeout=30)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, size, token)
                assert field in (err.value.details() or ""), (name, err.value.details())
