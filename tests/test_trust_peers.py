"""Every connection authenticates both ends: an agent talks only to replicas (the replica CA, the
endpoint's host in the certificate), a NodeService answers only replicas, and what a replica sends
is checked before it becomes a path. Real gRPC servers and the agent's real link code."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from kunlun_common import tls
from kunlun_common.api import agent_pb2, agent_pb2_grpc
from kunlun_common.pki import issue, paths_for
from node_agent.assignment_check import assignment_problems, safe_assignments
from node_agent.connection import ReplicaLink
from node_agent.node_service import NodeServiceServer, NodeServiceServicer

TEMPLATE = agent_pb2.Assignment(instance_id="w-evil-0", workload_id="w-evil", devices=["node-a/nvidia:0"])


class Replica(agent_pb2_grpc.AgentServiceServicer):
    """Answers an agent like a replica would, and pushes one assignment."""

    def __init__(self) -> None:
        self.calls = 0

    async def Connect(self, request_iterator: Any, context: Any) -> AsyncIterator[agent_pb2.ReplicaMessage]:
        self.calls += 1
        async for msg in request_iterator:
            kind = msg.WhichOneof("kind")
            if kind == "register":
                yield agent_pb2.ReplicaMessage(
                    register_ack=agent_pb2.RegisterAck(replica="r", lease_ttl_seconds=10)
                )
                yield agent_pb2.ReplicaMessage(
                    assignments=agent_pb2.Assignments(items=[TEMPLATE], revision=1)
                )
            elif kind == "heartbeat":
                yield agent_pb2.ReplicaMessage(heartbeat_ack=agent_pb2.HeartbeatAck(seq=msg.heartbeat.seq))


async def _serve(material: tls.TlsMaterial, servicer: Replica) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    agent_pb2_grpc.add_AgentServiceServicer_to_server(servicer, server)
    port = server.add_secure_port("127.0.0.1:0", tls.server_credentials(material))
    await server.start()
    return server, f"127.0.0.1:{port}"


async def _link_to(cert_dir: Path, posing: tls.TlsMaterial) -> tuple[Replica, Replica, str, list[Any]]:
    """Start the posing server and a genuine replica; let node-a's real link try the poser first."""
    fake, real = Replica(), Replica()
    s1, ep1 = await _serve(posing, fake)
    s2, ep2 = await _serve(tls.load_tls(paths_for(cert_dir, "replica", "replica-1")), real)
    got: list[Any] = []
    link = ReplicaLink(
        [ep1, ep2],
        tls.load_tls(paths_for(cert_dir, "agent", "node-a")),
        register=lambda: agent_pb2.RegisterNode(),
        samples=list,
        on_assignments=got.append,
        connect_timeout_s=5.0,
    )
    task = asyncio.create_task(link.run())
    try:
        await asyncio.wait_for(link.registered.wait(), 30)
        connected = link.connected_to
    finally:
        # servers first: cancelling the link while its stream is open does not return (seen here)
        await s1.stop(None)
        await s2.stop(None)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert connected == ep2
    return fake, real, connected, got


async def test_agent_certificate_posing_as_a_replica_is_refused(cert_dir: Path) -> None:
    posing = tls.load_tls(paths_for(cert_dir, "agent", "node-b"))
    fake, real, _, _ = await _link_to(cert_dir, posing)
    assert fake.calls == 0, "the agent opened a stream to another agent posing as a replica"
    assert real.calls >= 1


async def test_gateway_certificate_posing_as_a_replica_is_refused(cert_dir: Path) -> None:
    fake, _, _, _ = await _link_to(cert_dir, tls.load_tls(paths_for(cert_dir, "gateway", "gateway-1")))
    assert fake.calls == 0


async def test_replica_certificate_for_another_host_is_refused(cert_dir: Path) -> None:
    far = issue(cert_dir, "replica", "replica-far", hosts=("10.255.0.1", "cp-far.example"))
    fake, _, _, _ = await _link_to(cert_dir, tls.load_tls(far))
    assert fake.calls == 0, "a replica certificate without 127.0.0.1 was accepted for 127.0.0.1"


async def test_the_genuine_replica_is_accepted_and_its_assignments_applied(cert_dir: Path) -> None:
    _, real, _, got = await _link_to(cert_dir, tls.load_tls(paths_for(cert_dir, "agent", "node-b")))
    assert real.calls >= 1
    assert [a.instance_id for a in got[0].items] == [TEMPLATE.instance_id]


@pytest.mark.parametrize(
    "bad_id", ["../../etc", "..", ".", "/abs", "a/b", "", "x" * 200, "w-1\x00", "w 1", ".hidden"]
)
def test_assignment_ids_that_would_become_bad_paths_are_dropped(bad_id: str) -> None:
    bad = agent_pb2.Assignment(instance_id=bad_id, workload_id="w-1")
    good = agent_pb2.Assignment(instance_id="w-1-0", workload_id="w-1", devices=["node-a/ascend:0"])
    assert assignment_problems(bad)
    assert not assignment_problems(good)
    out = safe_assignments(agent_pb2.Assignments(items=[bad, good], revision=7))
    assert [a.instance_id for a in out.items] == ["w-1-0"] and out.revision == 7
    assert assignment_problems(agent_pb2.Assignment(instance_id="w-1-0", workload_id=bad_id))


@pytest.mark.parametrize(
    ("role", "name", "allowed"),
    [
        ("replica", "replica-2", True),
        ("agent", "node-b", False),
        ("operator", "admin", False),
        ("gateway", "gateway-1", False),
        ("viewer", "viewer", False),
    ],
)
async def test_node_service_answers_only_replicas(
    cert_dir: Path, tmp_path: Path, role: str, name: str, allowed: bool
) -> None:
    (tmp_path / "w-1-0").mkdir()
    servicer = NodeServiceServicer("node-a", lambda i: tmp_path / i if (tmp_path / i).is_dir() else None)
    server = NodeServiceServer(tls.load_tls(paths_for(cert_dir, "agent", "node-a")), servicer)
    port = await server.start("127.0.0.1:0")
    caller = tls.load_tls(paths_for(cert_dir, role, name))
    creds = tls.channel_credentials(caller, server_role="agent")
    try:
        async with grpc.aio.secure_channel(
            f"127.0.0.1:{port}", creds, options=[("grpc.ssl_target_name_override", "node-a")]
        ) as ch:
            stub = agent_pb2_grpc.NodeServiceStub(ch)
            try:
                async for _ in stub.Logs(agent_pb2.LogsRequest(instance_id="w-1-0"), timeout=5):
                    pass
                outcome = "ok"
            except grpc.aio.AioRpcError as e:
                outcome = e.code().name
            if allowed:
                with pytest.raises(grpc.aio.AioRpcError) as bad:
                    async for _ in stub.Logs(agent_pb2.LogsRequest(instance_id="../x"), timeout=5):
                        pass
                assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        await server.stop()
    assert (outcome == "ok") == allowed, outcome
    if not allowed:
        assert outcome == "UNAVAILABLE"  # refused in the TLS handshake


def test_certs_init_gives_each_server_its_own_host_names(tmp_path: Path) -> None:
    import argparse

    from cryptography import x509

    from controlplane.cli.certs_cmd import certs_init

    d = tmp_path / "certs"
    args = argparse.Namespace(
        dir=str(d),
        nodes=None,
        replicas=None,
        hosts=None,
        host=["replica-1=10.0.0.11,cp1.example"],
        output="json",
    )
    assert certs_init(args) == 0
    cert = x509.load_pem_x509_certificate(paths_for(d, "replica", "replica-1").cert.read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    names = [str(n.value) for n in sans]
    assert names == ["10.0.0.11", "cp1.example", "replica-1"]
    other = x509.load_pem_x509_certificate(paths_for(d, "replica", "replica-2").cert.read_bytes())
    assert "127.0.0.1" in [
        str(n.value) for n in other.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    ]
    viewer = x509.load_pem_x509_certificate(paths_for(d, "viewer", "viewer").cert.read_bytes())
    assert [
        str(n.value) for n in viewer.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    ] == ["viewer"]
