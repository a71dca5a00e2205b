"""TelemetryService: the cluster-wide device view (`telemetry metrics|top`) and the Prometheus scrape
targets (`telemetry targets`). Both read what the replicas already hold; no node is polled."""

from __future__ import annotations

import asyncio

from controlplane import keys, paging, telemetry
from controlplane.api.auth import Ctx
from controlplane.api.rpc import Servicer, rpc
from controlplane.nodes import NodeSessions
from controlplane.store import EtcdStore
from kunlun_common.api import cluster_pb2, gateway_pb2, telemetry_pb2, telemetry_pb2_grpc, types_pb2
from kunlun_common.tls import Identity


def _address_ok(address: str) -> bool:
    host, sep, port = address.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536 and len(address) <= 255)


class TelemetryService(Servicer, telemetry_pb2_grpc.TelemetryServiceServicer):
    SERVICE = "kunlun.v1.TelemetryService"

    def __init__(self, store: EtcdStore, sessions: NodeSessions, replica_name: str) -> None:
        self.store = store
        self.sessions = sessions
        self.replica_name = replica_name

    @rpc
    async def DeviceMetrics(
        self, request: telemetry_pb2.DeviceMetricsRequest, context: Ctx, who: Identity
    ) -> telemetry_pb2.DeviceMetricsResponse:
        conditions = telemetry.parse_filter(request.filter)  # FilterError is an InvalidInput
        paging.check_page_size(request.page_size)
        if request.page_size:
            rows, nxt, revision = await telemetry.device_metrics_page(self.store, self.sessions, request)
            return telemetry_pb2.DeviceMetricsResponse(
                devices=[r for r in rows if telemetry.matches(r, conditions)],
                total=len(rows),
                answered_by=self.replica_name,
                next_page_token=nxt,
                revision=revision,
            )
        nodes, instances = await telemetry.cluster_view(self.store, self.sessions)
        rows = telemetry.device_metrics(nodes, telemetry.holders_of(instances))
        return telemetry_pb2.DeviceMetricsResponse(
            devices=[r for r in rows if telemetry.matches(r, conditions)],
            total=len(rows),
            answered_by=self.replica_name,
        )

    @rpc
    async def Targets(
        self, request: telemetry_pb2.TargetsRequest, context: Ctx, who: Identity
    ) -> telemetry_pb2.TargetsResponse:
        (rkvs, _), (nkvs, _), (gkvs, _) = await asyncio.gather(
            self.store.get_prefix(keys.REPLICAS),
            self.store.get_prefix(keys.NODES),
            self.store.get_prefix(keys.GATEWAYS),
        )
        out: list[telemetry_pb2.ScrapeTarget] = []
        for kv in rkvs:
            r = cluster_pb2.ReplicaInfo()
            keys.decode_message(kv.value, r)
            if _address_ok(r.metrics_address):
                out.append(telemetry_pb2.ScrapeTarget(job="replica", address=r.metrics_address, name=r.name))
        for kv in nkvs:
            n = types_pb2.Node()
            keys.decode_message(kv.value, n)
            # a NotReady node stays a target: its exporter being down is what the alert should see
            if _address_ok(n.metrics_address):
                out.append(telemetry_pb2.ScrapeTarget(job="agent", address=n.metrics_address, name=n.name))
        for kv in gkvs:
            g = gateway_pb2.GatewayInfo()
            keys.decode_message(kv.value, g)
            if _address_ok(g.metrics_address):
                out.append(telemetry_pb2.ScrapeTarget(job="gateway", address=g.metrics_address, name=g.name))
        out.sort(key=lambda t: (t.job, t.name))
        return telemetry_pb2.TargetsResponse(targets=out)
