"""The one RPC wrapper: every replica RPC is authorized by name against the single role table, and
domain errors become the same gRPC status codes everywhere (checked over a real mTLS gRPC server)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from controlplane.api.agent_service import AgentService
from controlplane.api.auth import PERMISSIONS, Ctx
from controlplane.api.cluster_service import ClusterService
from controlplane.api.gateway_service import GatewayService
from controlplane.api.package_service import PackageService
from controlplane.api.rollout_service import RolloutService
from controlplane.api.rpc import Servicer, rpc, rpc_stream, status_of
from controlplane.api.workload_service import WorkloadService
from controlplane.workloads import records
from controlplane.workloads.spec import SpecError
from kunlun_common.api import (
    agent_pb2,
    cluster_pb2,
    cluster_pb2_grpc,
    gateway_pb2,
    package_pb2,
    rollout_pb2,
    workload_pb2,
    workload_pb2_grpc,
)
from kunlun_common.errors import (
    ConcurrentChange,
    ConfigError,
    InvalidInput,
    NotFoundError,
    PermanentError,
    PermissionRefused,
    TemporaryError,
)
from kunlun_common.messages import msg
from kunlun_common.pki import paths_for
from kunlun_common.tls import Identity, channel_credentials, load_tls, server_credentials

SERVED = [
    (ClusterService, cluster_pb2),
    (AgentService, agent_pb2),
    (WorkloadService, workload_pb2),
    (GatewayService, gateway_pb2),
    (RolloutService, rollout_pb2),
    (PackageService, package_pb2),
]


@pytest.mark.parametrize(("servicer", "pb"), SERVED, ids=[s.__name__ for s, _ in SERVED])
def test_every_served_method_is_wrapped_and_listed(servicer: type[Servicer], pb: object) -> None:
    (service,) = [s for s in pb.DESCRIPTOR.services_by_name.values() if s.full_name == servicer.SERVICE]  # type: ignore[attr-defined]
    for m in service.methods:
        handler = getattr(servicer, m.name)
        assert getattr(handler, "__rpc_method__", None) == m.name, f"{servicer.__name__}.{m.name} is not @rpc"
        assert f"/{service.full_name}/{m.name}" in PERMISSIONS, f"{m.name} has no line in PERMISSIONS"


def test_domain_errors_map_once() -> None:
    assert status_of(InvalidInput("x")) == grpc.StatusCode.INVALID_ARGUMENT
    assert (
        status_of(SpecError([msg("spec.name_required", "name: required")]))
        == grpc.StatusCode.INVALID_ARGUMENT
    )
    assert status_of(ConfigError("x")) == grpc.StatusCode.INVALID_ARGUMENT
    assert status_of(records.NotFound("x")) == grpc.StatusCode.NOT_FOUND
    assert status_of(PermissionRefused("x")) == grpc.StatusCode.PERMISSION_DENIED
    assert status_of(ConcurrentChange("x")) == grpc.StatusCode.ABORTED
    assert status_of(records.Conflict("x")) == grpc.StatusCode.UNAVAILABLE
    assert status_of(TemporaryError("x")) == grpc.StatusCode.UNAVAILABLE
    assert status_of(PermanentError("x")) == grpc.StatusCode.FAILED_PRECONDITION
    assert status_of(RuntimeError("x")) is None


# ------------------------------------------------------------------ a real server
class _Cluster(Servicer, cluster_pb2_grpc.ClusterServiceServicer):
    SERVICE = "kunlun.v1.ClusterService"

    @rpc
    async def WhoAmI(
        self, request: cluster_pb2.WhoAmIRequest, context: Ctx, who: Identity
    ) -> cluster_pb2.WhoAmIResponse:
        return cluster_pb2.WhoAmIResponse(identity=who.name, role=who.role)

    @rpc
    async def DescribeDevice(
        self, request: cluster_pb2.DescribeDeviceRequest, context: Ctx, who: Identity
    ) -> cluster_pb2.DescribeDeviceResponse:
        raise {"missing": NotFoundError, "bad": InvalidInput, "busy": TemporaryError}[request.name](
            f"{request.name}: the reason"
        )

    @rpc
    async def ListNodes(
        self, request: cluster_pb2.ListNodesRequest, context: Ctx, who: Identity
    ) -> cluster_pb2.ListNodesResponse:
        raise RuntimeError("a bug, not a domain error")


class _Workloads(Servicer, workload_pb2_grpc.WorkloadServiceServicer):
    SERVICE = "kunlun.v1.WorkloadService"

    def __init__(self) -> None:
        self.cleaned_up = asyncio.Event()

    @rpc_stream
    async def WatchEndpoints(
        self, request: workload_pb2.WatchEndpointsRequest, context: Ctx, who: Identity
    ) -> AsyncIterator[workload_pb2.EndpointsSnapshot]:
        try:
            yield workload_pb2.EndpointsSnapshot(endpoints=[workload_pb2.Endpoint(workload=who.name)])
            if who.role == "operator":
                raise TemporaryError("no quorum; retry")
            await asyncio.Event().wait()  # until the client goes away
        finally:
            self.cleaned_up.set()


async def test_wrapper_over_mtls(cert_dir: Path) -> None:
    server = grpc.aio.server()
    cluster_pb2_grpc.add_ClusterServiceServicer_to_server(_Cluster(), server)  # type: ignore[abstract]
    workloads = _Workloads()  # type: ignore[abstract]
    workload_pb2_grpc.add_WorkloadServiceServicer_to_server(workloads, server)
    port = server.add_secure_port(
        "127.0.0.1:0", server_credentials(load_tls(paths_for(cert_dir, "replica", "replica-1")))
    )
    await server.start()

    def channel(role: str, name: str) -> grpc.aio.Channel:
        creds = channel_credentials(load_tls(paths_for(cert_dir, role, name)))
        return grpc.aio.secure_channel(
            f"127.0.0.1:{port}", creds, options=[("grpc.ssl_target_name_override", "localhost")]
        )

    try:
        async with channel("operator", "admin") as op, channel("gateway", "gateway-1") as gw:
            stub = cluster_pb2_grpc.ClusterServiceStub(op)
            me = await stub.WhoAmI(cluster_pb2.WhoAmIRequest(), timeout=10)
            assert (me.identity, me.role) == ("admin", "operator")
            for name, code in (
                ("missing", grpc.StatusCode.NOT_FOUND),
                ("bad", grpc.StatusCode.INVALID_ARGUMENT),
                ("busy", grpc.StatusCode.UNAVAILABLE),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.DescribeDevice(cluster_pb2.DescribeDeviceRequest(name=name), timeout=10)
                assert (err.value.code(), err.value.details()) == (code, f"{name}: the reason")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.ListNodes(cluster_pb2.ListNodesRequest(), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNKNOWN  # not dressed up as a domain answer
            # default deny, by method name: a gateway may not list nodes (READERS only)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await cluster_pb2_grpc.ClusterServiceStub(gw).ListNodes(
                    cluster_pb2.ListNodesRequest(), timeout=10
                )
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "may not call ListNodes" in (err.value.details() or "")

            # streams: items, then the mapped error
            call = workload_pb2_grpc.WorkloadServiceStub(op).WatchEndpoints(
                workload_pb2.WatchEndpointsRequest(), timeout=10
            )
            got = []
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for snap in call:
                    got.append(snap.endpoints[0].workload)
            assert got == ["admin"] and err.value.code() == grpc.StatusCode.UNAVAILABLE
            await asyncio.wait_for(workloads.cleaned_up.wait(), 10)
            # a client that goes away: the handler's cleanup runs
            workloads.cleaned_up.clear()
            call = workload_pb2_grpc.WorkloadServiceStub(gw).WatchEndpoints(
                workload_pb2.WatchEndpointsRequest(), timeout=10
            )
            first = await call.read()
            assert (
                isinstance(first, workload_pb2.EndpointsSnapshot)
                and first.endpoints[0].workload == "gateway-1"
            )
            call.cancel()
            await asyncio.wait_for(workloads.cleaned_up.wait(), 10)
    finally:
        await server.stop(None)
