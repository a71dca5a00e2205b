"""EndpointService: Request-as-a-Service definitions (controlplane/gateways/request_endpoints.py).

Gateways receive the definitions in GatewayConfig.endpoints (GatewayService.WatchGatewayConfig).
"""

from __future__ import annotations

from controlplane import keys, paging
from controlplane.api.auth import Ctx
from controlplane.api.rpc import Servicer, rpc
from controlplane.gateways import request_endpoints
from controlplane.store import EtcdStore
from kunlun_common.api import gateway_pb2, gateway_pb2_grpc
from kunlun_common.tls import Identity


class EndpointService(Servicer, gateway_pb2_grpc.EndpointServiceServicer):
    SERVICE = "kunlun.v1.EndpointService"

    def __init__(self, store: EtcdStore) -> None:
        self.store = store

    @rpc
    async def PutEndpoint(
        self, request: gateway_pb2.PutRequestEndpointRequest, context: Ctx, who: Identity
    ) -> gateway_pb2.RequestEndpoint:
        return await request_endpoints.put(self.store, request.endpoint, str(who))

    @rpc
    async def GetEndpoint(
        self, request: gateway_pb2.GetRequestEndpointRequest, context: Ctx, who: Identity
    ) -> gateway_pb2.RequestEndpoint:
        ep = await request_endpoints.get(self.store, request.name)
        assert ep is not None
        return ep

    @rpc
    async def ListEndpoints(
        self, request: gateway_pb2.ListRequestEndpointsRequest, context: Ctx, who: Identity
    ) -> gateway_pb2.ListRequestEndpointsResponse:
        paging.check_page_size(request.page_size)
        if request.page_size:
            found, nxt, revision = await paging.list_page(
                self.store,
                keys.REQUEST_ENDPOINTS,
                request,
                lambda kv: request_endpoints.decode(kv.value),
                paging.message_size,
            )
            return gateway_pb2.ListRequestEndpointsResponse(
                endpoints=found, next_page_token=nxt, revision=revision
            )
        return gateway_pb2.ListRequestEndpointsResponse(
            endpoints=await request_endpoints.list_all(self.store)
        )

    @rpc
    async def DeleteEndpoint(
        self, request: gateway_pb2.DeleteRequestEndpointRequest, context: Ctx, who: Identity
    ) -> gateway_pb2.DeleteRequestEndpointResponse:
        return gateway_pb2.DeleteRequestEndpointResponse(
            endpoint=await request_endpoints.delete(self.store, request.name)
        )
