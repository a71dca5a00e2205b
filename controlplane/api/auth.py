"""Role checks. Identity and role come only from the verified peer certificate.

Every RPC names the roles allowed to call it in PERMISSIONS; a method missing from it is refused
(default deny, and a test checks that every served method is listed). Refusals are logged with
the caller's identity.
"""

from __future__ import annotations

from typing import Any, NoReturn, TypeAlias

import grpc
import structlog

from kunlun_common.messages import Message, msg
from kunlun_common.tls import Identity, peer_identity

log = structlog.get_logger("auth")
Ctx: TypeAlias = grpc.aio.ServicerContext[Any, Any]

READERS = ("operator", "viewer", "replica")
WRITERS = ("operator",)
PERMISSIONS: dict[str, tuple[str, ...]] = {
    "/kunlun.v1.ClusterService/ListDevices": READERS,
    "/kunlun.v1.ClusterService/DescribeDevice": READERS,
    "/kunlun.v1.ClusterService/ListNodes": READERS,
    "/kunlun.v1.ClusterService/ClusterStatus": READERS,
    "/kunlun.v1.ClusterService/WhoAmI": ("operator", "viewer", "replica", "agent", "gateway"),
    "/kunlun.v1.ClusterService/DrainReplica": WRITERS,  # the replica exits; its service manager restarts it
    "/kunlun.v1.AgentService/Connect": ("agent",),
    # served by node agents, not replicas (node_agent/node_service.py enforces the same rule)
    "/kunlun.v1.NodeService/Logs": ("replica",),
    "/kunlun.v1.NodeService/Engines": ("replica",),
    "/kunlun.v1.NodeService/ToolReading": ("replica",),
    "/kunlun.v1.LedgerService/NodeEngines": READERS,
    "/kunlun.v1.LedgerService/NodeToolReading": READERS,
    "/kunlun.v1.WorkloadService/SubmitWorkload": WRITERS,
    "/kunlun.v1.WorkloadService/ListWorkloads": READERS,
    "/kunlun.v1.WorkloadService/GetWorkload": READERS,
    "/kunlun.v1.WorkloadService/ScaleWorkload": WRITERS,
    "/kunlun.v1.WorkloadService/DeleteWorkload": WRITERS,
    "/kunlun.v1.WorkloadService/CordonNode": WRITERS,
    "/kunlun.v1.WorkloadService/GetSchedulerConfig": READERS,
    "/kunlun.v1.WorkloadService/SetSchedulerConfig": WRITERS,
    "/kunlun.v1.WorkloadService/Logs": WRITERS,  # engine output may hold secrets
    "/kunlun.v1.GatewayService/CreateApiKey": WRITERS,
    "/kunlun.v1.GatewayService/ListApiKeys": READERS,
    "/kunlun.v1.GatewayService/RevokeApiKey": WRITERS,
    "/kunlun.v1.GatewayService/SetRoutingPolicy": WRITERS,
    "/kunlun.v1.GatewayService/ListRoutingPolicies": (*READERS, "gateway"),
    "/kunlun.v1.GatewayService/Heartbeat": ("gateway",),
    "/kunlun.v1.GatewayService/ListGateways": READERS,
    "/kunlun.v1.GatewayService/WatchGatewayConfig": ("gateway", "operator"),
    "/kunlun.v1.WorkloadService/WatchEndpoints": ("gateway", "operator", "viewer"),
    "/kunlun.v1.RolloutService/CreateRollout": WRITERS,
    "/kunlun.v1.RolloutService/PromoteRollout": WRITERS,
    "/kunlun.v1.RolloutService/AbortRollout": WRITERS,
    "/kunlun.v1.RolloutService/GetRollout": READERS,
    "/kunlun.v1.RolloutService/ListRollouts": READERS,
    "/kunlun.v1.TelemetryService/DeviceMetrics": (*READERS, "monitoring"),
    "/kunlun.v1.TelemetryService/Targets": (*READERS, "monitoring"),
    "/kunlun.v1.PackageService/AddTrustedKey": WRITERS,
    "/kunlun.v1.PackageService/RemoveTrustedKey": WRITERS,
    "/kunlun.v1.PackageService/ListTrustedKeys": (*READERS, "agent"),
    "/kunlun.v1.PackageService/PushPackage": WRITERS,
    "/kunlun.v1.PackageService/ListPackages": (*READERS, "agent"),
    "/kunlun.v1.PackageService/DeletePackage": WRITERS,
    # agents: only packages their node's assignments name (controlplane/package_pull.py)
    "/kunlun.v1.PackageService/PullPackage": ("operator", "replica", "agent"),
    "/kunlun.v1.PackageService/GetPackagePolicy": (*READERS, "agent"),
    "/kunlun.v1.PackageService/SetPackagePolicy": WRITERS,
    "/kunlun.v1.EndpointService/PutEndpoint": WRITERS,
    "/kunlun.v1.EndpointService/GetEndpoint": READERS,
    "/kunlun.v1.EndpointService/ListEndpoints": READERS,
    "/kunlun.v1.EndpointService/DeleteEndpoint": WRITERS,
    "/kunlun.v1.SecurityService/ListAudit": READERS,
    "/kunlun.v1.SecurityService/ListCertificates": READERS,
    "/kunlun.v1.SecurityService/RevokeCertificate": WRITERS,
    # agents and gateways fetch the list to refuse revoked replicas and scrapers themselves
    "/kunlun.v1.SecurityService/ListRevocations": (*READERS, "agent", "gateway"),
}


async def _abort(context: Ctx, code: grpc.StatusCode, text: str | Message) -> NoReturn:
    """Abort with `text` as the details; a Message also travels with its id in the trailing
    metadata (kunlun_common/messages.py), for clients that show it in their reader's language."""
    metadata = text.to_metadata() if isinstance(text, Message) else ()
    await context.abort(code, str(text), metadata)
    raise AssertionError("unreachable")  # context.abort raises


async def authorize(context: Ctx, method: str) -> Identity:
    """Return the caller's identity if its role may call `method`; abort PERMISSION_DENIED otherwise."""
    ident = peer_identity(context.auth_context())  # type: ignore[arg-type]
    if ident is None:
        log.warning("refused call without client certificate", method=method, peer=context.peer())
        await _abort(
            context,
            grpc.StatusCode.UNAUTHENTICATED,
            msg("auth.no_certificate", "a client certificate signed by the cluster CA is required"),
        )
    allowed = PERMISSIONS.get(method, ())
    if ident.role not in allowed:
        log.warning("refused call", method=method, identity=str(ident), allowed=list(allowed))
        await _abort(
            context,
            grpc.StatusCode.PERMISSION_DENIED,
            msg(
                "auth.role_refused",
                "{identity} may not call {method} (allowed roles: {roles})",
                identity=str(ident),
                method=method.rsplit("/", 1)[-1],
                roles=", ".join(allowed) or "none",
            ),
        )
    return ident


async def abort(context: Ctx, code: grpc.StatusCode, text: str | Message) -> NoReturn:
    """Abort the call with a clear message (with its id when it is a Message)."""
    await _abort(context, code, text)
