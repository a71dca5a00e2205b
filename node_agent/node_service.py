"""The agent's own gRPC NodeService: what must come from the node itself (instance logs), for replicas.

mTLS with the agent's certificate (its SANs: the node name, 127.0.0.1, localhost; replicas dial the
advertised `RegisterNode.node_service` address and check the node name). A caller must present a
certificate of the replica CA (role `replica`): the TLS layer trusts no other issuer; anything else is refused.

`Logs(instance_id, tail, follow)`: the engine's lines from the supervisor's rotating log files
(`executor/logfiles.py`): the last `tail` lines (0: all kept), then, with `follow`, every new line
until the caller cancels or the instance is removed from the node. Lines come whole, in order, each
exactly once, in chunks of at most CHUNK_LINES.

`ToolReading(node)`: every vendor tool of the node runs now (in a thread, through the in-process
plugin's adapter, whatever plugin serves the devices) and its parsed figures and raw output come back,
so an operator can hold the platform's telemetry against the tool's own reading (`kunlun-cli verify`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, NoReturn

import grpc
import structlog

from kunlun_common import tls
from kunlun_common.api import agent_pb2, agent_pb2_grpc
from kunlun_common.errors import ConfigError
from kunlun_common.reload import LiveTls
from kunlun_common.revocation import RevokedSerials
from node_agent.assignment_check import id_problem
from node_agent.executor import ledger
from node_agent.executor.logfiles import LogFollower, LogSettings
from node_agent.plugins.vendor_plugin import ToolSample, VendorPlugin

log = structlog.get_logger("node-service")
CHUNK_LINES = 1000
MAX_RAW_OUTPUT = 64_000
ALLOWED_ROLES = ("replica",)
Ctx = grpc.aio.ServicerContext[Any, Any]


async def _abort(context: Ctx, code: grpc.StatusCode, msg: str) -> NoReturn:
    await context.abort(code, msg)
    raise AssertionError("unreachable")  # context.abort raises


class NodeServiceServicer(agent_pb2_grpc.NodeServiceServicer):
    def __init__(
        self,
        node: str,
        instance_dir: Callable[[str], Path | None],
        ledger_file: Path | None = None,
        poll_s: float = 0.2,
        plugins: Callable[[], list[VendorPlugin]] | None = None,
        revoked: RevokedSerials | None = None,
    ) -> None:
        self.node = node
        self.revoked = revoked
        self.instance_dir = instance_dir
        self.ledger_file = ledger_file
        self.plugins = plugins or (lambda: [])
        self.poll_s = poll_s
        self.log_file = LogSettings().file_name

    async def _refuse_revoked(self, context: Ctx) -> None:
        if self.revoked is not None and self.revoked.fetches == 0:
            # a fresh agent cannot tell a revoked certificate yet (revocation.first_fetch)
            await _abort(
                context,
                grpc.StatusCode.UNAVAILABLE,
                "this agent has not fetched the revocation list yet; retry in a few seconds",
            )
        cert = tls.peer_certificate(context.auth_context())  # type: ignore[arg-type]
        if cert is not None and self.revoked is not None and self.revoked.revoked(cert):
            log.warning(
                "refused revoked certificate", identity=str(tls.identity_of(cert)), peer=context.peer()
            )
            await _abort(
                context,
                grpc.StatusCode.UNAUTHENTICATED,
                f"certificate serial {cert.serial_number:x} ({tls.identity_of(cert)}) was revoked",
            )

    async def Logs(self, request: agent_pb2.LogsRequest, context: Ctx) -> AsyncIterator[agent_pb2.LogChunk]:
        ident = tls.peer_identity(context.auth_context())  # type: ignore[arg-type]
        if ident is None or ident.role not in ALLOWED_ROLES:
            log.warning("refused Logs call", identity=str(ident), peer=context.peer())
            await _abort(
                context,
                grpc.StatusCode.PERMISSION_DENIED,
                f"{ident or 'a caller without certificate'} may not read logs on node {self.node} "
                f"(allowed roles: {', '.join(ALLOWED_ROLES)})",
            )
        await self._refuse_revoked(context)
        problem = id_problem("instance_id", request.instance_id)
        if problem:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, problem)
        d = self.instance_dir(request.instance_id)
        if d is None:
            await _abort(
                context,
                grpc.StatusCode.NOT_FOUND,
                f"instance {request.instance_id!r} has no logs on node {self.node} (not started here yet?)",
            )
        follower = LogFollower(d / self.log_file, self.poll_s)
        try:
            lines = await asyncio.to_thread(follower.snapshot, max(0, request.tail))
            for i in range(0, len(lines), CHUNK_LINES):
                yield agent_pb2.LogChunk(lines=lines[i : i + CHUNK_LINES], instance_id=request.instance_id)
            if not request.follow:
                return
            async for batch in follower.follow(alive=d):
                for i in range(0, len(batch), CHUNK_LINES):
                    yield agent_pb2.LogChunk(
                        lines=batch[i : i + CHUNK_LINES], instance_id=request.instance_id
                    )
        finally:
            follower.close()

    async def Engines(self, request: agent_pb2.EnginesRequest, context: Ctx) -> agent_pb2.EnginesResponse:
        """The node's engine ledger (`executor/ledger.py`), oldest first (the last `tail` if > 0)."""
        ident = tls.peer_identity(context.auth_context())  # type: ignore[arg-type]
        if ident is None or ident.role not in ALLOWED_ROLES:
            log.warning("refused Engines call", identity=str(ident), peer=context.peer())
            await _abort(
                context,
                grpc.StatusCode.PERMISSION_DENIED,
                f"{ident or 'a caller without certificate'} may not read the engine ledger of node "
                f"{self.node} (allowed roles: {', '.join(ALLOWED_ROLES)})",
            )
        await self._refuse_revoked(context)
        if request.node and request.node != self.node:
            await _abort(
                context,
                grpc.StatusCode.NOT_FOUND,
                f"this agent serves node {self.node}, not {request.node!r}",
            )
        if self.ledger_file is None:
            return agent_pb2.EnginesResponse()
        entries = await asyncio.to_thread(ledger.read, self.ledger_file, max(0, request.tail))
        out = agent_pb2.EnginesResponse()
        for e in entries:
            try:
                out.items.add(
                    event=str(e["event"]),
                    node=str(e.get("node", "")),
                    instance=str(e.get("instance", "")),
                    devices=[str(d) for d in e.get("devices", [])],
                    pid=int(e.get("pid", 0)),
                    wall_ms=int(e.get("wall_ms", 0)),
                    mono_ns=int(e.get("mono_ns", 0)),
                    boot_id=str(e.get("boot_id", "")),
                    cause=str(e.get("cause", "")),
                )
            except (TypeError, ValueError):
                continue
        return out

    async def ToolReading(
        self, request: agent_pb2.ToolReadingRequest, context: Ctx
    ) -> agent_pb2.ToolReadingResponse:
        """Run every vendor tool of the node now; what each printed, parsed and raw."""
        ident = tls.peer_identity(context.auth_context())  # type: ignore[arg-type]
        if ident is None or ident.role not in ALLOWED_ROLES:
            log.warning("refused ToolReading call", identity=str(ident), peer=context.peer())
            await _abort(
                context,
                grpc.StatusCode.PERMISSION_DENIED,
                f"{ident or 'a caller without certificate'} may not run the vendor tools of node "
                f"{self.node} (allowed roles: {', '.join(ALLOWED_ROLES)})",
            )
        await self._refuse_revoked(context)
        if request.node and request.node != self.node:
            await _abort(
                context,
                grpc.StatusCode.NOT_FOUND,
                f"this agent serves node {self.node}, not {request.node!r}",
            )
        out = agent_pb2.ToolReadingResponse()
        for plugin in self.plugins():
            sample = await asyncio.to_thread(plugin.poll)
            out.readings.append(tool_reading(plugin, sample))
        return out


def tool_reading(plugin: VendorPlugin, sample: ToolSample) -> agent_pb2.ToolReading:
    """One sample of `plugin`'s tool as the wire message (unavailable figures: -1)."""
    names = {d.device_id: plugin.config.device_name(d) for d in plugin.decls}
    reading = agent_pb2.ToolReading(
        device_type=plugin.device_type,
        command=list(sample.command),
        raw_output=sample.raw_output[:MAX_RAW_OUTPUT],
        error=str(sample.error) if sample.error is not None else "",
        sampled_at_unix_ms=sample.sampled_at_ms,
        duration_s=sample.duration_s,
    )
    for o in sample.observed:
        reading.devices.add(
            name=names.get(o.index, ""),
            index=o.index,
            model=o.model,
            memory_total_mb=-1 if o.memory_total_mb is None else o.memory_total_mb,
            memory_used_mb=-1 if o.memory_used_mb is None else o.memory_used_mb,
            utilization_pct=-1.0 if o.utilization_pct is None else o.utilization_pct,
            health=o.health,
        )
    return reading


class NodeServiceServer:
    """The NodeService gRPC server of one agent."""

    def __init__(self, material: tls.TlsMaterial | LiveTls, servicer: NodeServiceServicer) -> None:
        self.live = material if isinstance(material, LiveTls) else LiveTls(material)
        """The agent's certificate; a reload (SIGHUP) reaches new connections."""
        self.servicer = servicer
        self.server: grpc.aio.Server | None = None
        self.port = 0

    async def start(self, listen: str) -> int:
        """Listen on `listen` (host:port, port 0 picks a free one); return the port."""
        server = grpc.aio.server()
        agent_pb2_grpc.add_NodeServiceServicer_to_server(self.servicer, server)
        try:
            port = server.add_secure_port(listen, self.live.server_credentials(clients="replica"))
        except RuntimeError as e:
            raise ConfigError(f"node service: cannot listen on {listen} ({e}); is the port in use?") from None
        if not port:
            raise ConfigError(f"node service: cannot listen on {listen}; is the address on this host?")
        await server.start()
        self.server, self.port = server, port
        log.info("node service listening", listen=listen, port=port)
        return port

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(grace=1.0)
            self.server = None
