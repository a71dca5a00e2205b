"""LedgerService: a node's engine ledger and its vendor tools' own reading, read through its agent's
NodeService (for operators).

The ledger is node-local (`<agent state dir>/ledger/engines.jsonl`); this replica dials the node's
advertised NodeService with its replica certificate and returns what the agent read.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

from controlplane.api.auth import Ctx, abort
from controlplane.api.rpc import Servicer, rpc
from controlplane.feeds import Feeds
from kunlun_common.api import agent_pb2, agent_pb2_grpc
from kunlun_common.errors import InvalidInput, NotFoundError
from kunlun_common.messages import msg
from kunlun_common.names import valid_node_name
from kunlun_common.tls import Identity, TlsMaterial, channel_credentials

MAX_TAIL = 100_000
CALL_TIMEOUT_S = 10.0
TOOL_TIMEOUT_S = 30.0
T = TypeVar("T")


class LedgerService(Servicer, agent_pb2_grpc.LedgerServiceServicer):
    SERVICE = "kunlun.v1.LedgerService"

    def __init__(self, feeds: Feeds, material: TlsMaterial) -> None:
        self.feeds = feeds
        self.tls = material

    @rpc
    async def NodeEngines(
        self, request: agent_pb2.EnginesRequest, context: Ctx, who: Identity
    ) -> agent_pb2.EnginesResponse:
        if not valid_node_name(request.node):
            raise InvalidInput(
                msg(
                    "node.name_invalid",
                    "node: {node!r} is not a valid node name (lowercase letters, digits, '-')",
                    node=request.node,
                )
            )
        if not 0 <= request.tail <= MAX_TAIL:
            raise InvalidInput(
                msg(
                    "ledger.tail_range",
                    "tail: expected 0..{max}, found {found}",
                    max=MAX_TAIL,
                    found=request.tail,
                )
            )
        resp: agent_pb2.EnginesResponse = await self._call(
            request.node, context, lambda stub: stub.Engines(request, timeout=CALL_TIMEOUT_S)
        )
        return resp

    @rpc
    async def NodeToolReading(
        self, request: agent_pb2.ToolReadingRequest, context: Ctx, who: Identity
    ) -> agent_pb2.ToolReadingResponse:
        if not valid_node_name(request.node):
            raise InvalidInput(
                msg(
                    "node.name_invalid",
                    "node: {node!r} is not a valid node name (lowercase letters, digits, '-')",
                    node=request.node,
                )
            )
        resp: agent_pb2.ToolReadingResponse = await self._call(
            request.node, context, lambda stub: stub.ToolReading(request, timeout=TOOL_TIMEOUT_S)
        )
        return resp

    async def _call(
        self, node: str, context: Ctx, fn: Callable[[agent_pb2_grpc.NodeServiceAsyncStub], Awaitable[T]]
    ) -> T:
        """Call the node's NodeService with this replica's certificate, checking the node's name."""
        address = self.feeds.node_service(node)
        if not address:
            raise NotFoundError(
                msg(
                    "node.no_node_service",
                    "node {node} is unknown or does not serve its NodeService (agent not registered)",
                    node=node,
                )
            )
        async with grpc.aio.secure_channel(
            address,
            channel_credentials(self.tls, server_role="agent"),
            options=[("grpc.ssl_target_name_override", node)],
        ) as ch:
            try:
                stub = agent_pb2_grpc.NodeServiceStub(ch)
                return await fn(stub)
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.UNAVAILABLE:
                    said = msg(
                        "node.unavailable",
                        "node {node}: {details} (retry once the agent is back)",
                        node=node,
                        details=e.details(),
                    )
                else:
                    said = msg("node.error", "node {node}: {details}", node=node, details=e.details())
                await abort(context, e.code(), said)
