"""Leases and reports are bound to their owner: a gateway refreshes only the lease granted to it, an
agent's report counts only for instances assigned to its node. Real gRPC, real etcd."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from controlplane.api.gateway_service import GatewayService
from controlplane.feeds import Feeds
from controlplane.report_owner import MAX_REPORTED, owned_report
from controlplane.store import EtcdStore
from kunlun_common import tls
from kunlun_common.api import agent_pb2, gateway_pb2, gateway_pb2_grpc, workload_pb2
from kunlun_common.pki import paths_for


@pytest.fixture
async def gateway_api(store: EtcdStore, cert_dir: Path) -> AsyncIterator[str]:
    server = grpc.aio.server()
    gateway_pb2_grpc.add_GatewayServiceServicer_to_server(
        GatewayService(store, Feeds(store), "replica-1"), server
    )
    port = server.add_secure_port(
        "127.0.0.1:0", tls.server_credentials(tls.load_tls(paths_for(cert_dir, "replica", "replica-1")))
    )
    await server.start()
    yield f"127.0.0.1:{port}"
    await server.stop(None)


async def _heartbeat(address: str, cert_dir: Path, gateway: str, lease: int) -> int:
    creds = tls.channel_credentials(tls.load_tls(paths_for(cert_dir, "gateway", gateway)))
    async with grpc.aio.secure_channel(address, creds) as ch:
        resp = await gateway_pb2_grpc.GatewayServiceStub(ch).Heartbeat(
            gateway_pb2.GatewayHeartbeatRequest(
                info=gateway_pb2.GatewayInfo(name=gateway, address="127.0.0.1:1"), lease=lease, ttl_s=5
            ),
            timeout=10,
        )
    return int(resp.lease)


async def test_gateway_heartbeat_refreshes_only_its_own_lease(
    gateway_api: str, cert_dir: Path, store: EtcdStore
) -> None:
    own = await _heartbeat(gateway_api, cert_dir, "gateway-1", 0)
    assert await _heartbeat(gateway_api, cert_dir, "gateway-1", own) == own  # its own: refreshed
    # another gateway naming gateway-1's lease gets a lease of its own; gateway-1's is not touched
    theirs = await _heartbeat(gateway_api, cert_dir, "gateway-2", own)
    assert theirs != own
    # a lease nobody granted to a gateway (the leader's, a node's: ids are guessable)
    foreign = await store.lease_grant(30)
    try:
        assert await _heartbeat(gateway_api, cert_dir, "gateway-3", foreign) != foreign
    finally:
        await store.lease_revoke(foreign)


async def test_gateway_that_moved_keeps_its_lease_on_another_replica(
    store: EtcdStore, cert_dir: Path, gateway_api: str
) -> None:
    own = await _heartbeat(gateway_api, cert_dir, "gateway-2", 0)
    server = grpc.aio.server()
    gateway_pb2_grpc.add_GatewayServiceServicer_to_server(
        GatewayService(store, Feeds(store), "replica-2"), server
    )
    port = server.add_secure_port(
        "127.0.0.1:0", tls.server_credentials(tls.load_tls(paths_for(cert_dir, "replica", "replica-2")))
    )
    await server.start()
    try:  # the other replica finds the lease on the gateway's own record in etcd
        assert await _heartbeat(f"127.0.0.1:{port}", cert_dir, "gateway-2", own) == own
    finally:
        await server.stop(None)


def _feeds_with(instances: dict[str, str]) -> Feeds:
    f = Feeds(None)
    for iid, node in instances.items():
        f.index.instances[iid] = workload_pb2.Instance(id=iid, node=node)
    return f


def test_report_for_another_nodes_instance_is_refused() -> None:
    feeds = _feeds_with({"w-1-0": "node-a", "w-1-1": "node-b"})
    report = agent_pb2.InstanceReport(
        instances=[
            agent_pb2.InstanceStatus(instance_id="w-1-0"),  # node-a's
            agent_pb2.InstanceStatus(instance_id="w-1-1"),  # its own
            agent_pb2.InstanceStatus(instance_id="made-up-1"),  # nobody's: would be a new key
        ]
    )
    out = owned_report(feeds, "node-b", report)
    assert [st.instance_id for st in out.instances] == ["w-1-1"]


def test_report_size_is_bounded() -> None:
    feeds = _feeds_with({f"w-{i}": "node-a" for i in range(MAX_REPORTED + 50)})
    report = agent_pb2.InstanceReport(
        instances=[agent_pb2.InstanceStatus(instance_id=f"w-{i}") for i in range(MAX_REPORTED + 50)]
    )
    assert len(owned_report(feeds, "node-a", report).instances) == MAX_REPORTED
