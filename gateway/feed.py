"""The gateway's link to the control plane: one replica at a time, with failover.

On one replica, over one mTLS channel (certificate of role `gateway`), three things run together:
- `WorkloadService.WatchEndpoints`: a full snapshot of the routable instances on every change,
  applied at once (an instance that leaves the snapshot stops getting requests immediately);
- `GatewayService.WatchGatewayConfig`: API key hashes, routing policies, workload states;
- `GatewayService.Heartbeat` every `heartbeat_interval_s`: keeps the gateway listed
  (`/kunlun/v1/gateways/<name>`, lease-bound), carries the cumulative traffic counters per
  workload and version (`stats.py`, for the rollout analysis) and proves the replica still answers (and still
  reaches etcd) within `feed_timeout_s`.
If any of them fails (replica killed, paused, cut off from etcd, stream closed), the gateway moves to
the next replica, which sends full snapshots again. The last snapshot stays in use meanwhile: losing
the control plane never stops the data plane. A replica without GatewayService (older release) still
feeds endpoints; then policies are the defaults and, if keys are required, requests get 503.
Before each session the gateway checks the certificate the replica presents against its revocation
list (`server_check.py`), and leaves a replica whose certificate is revoked during the session.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
import zlib
from collections.abc import Callable

import grpc
import structlog

from gateway.auth import ApiKeys
from gateway.backends import Registry
from gateway.settings import GatewaySettings
from kunlun_common import tls
from kunlun_common.api import gateway_pb2, gateway_pb2_grpc, types_pb2, workload_pb2, workload_pb2_grpc
from kunlun_common.clock import now_ms
from kunlun_common.retry import backoff_delay
from kunlun_common.revocation import RevokedSerials
from kunlun_common.server_check import checked_server

log = structlog.get_logger("gateway.feed")
_EOF = grpc.aio.EOF  # type: ignore[attr-defined]
_FAILOVER_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}


class FeedError(Exception):
    """This replica cannot feed us now; try the next one."""


class ControlPlaneFeed:
    def __init__(
        self,
        settings: GatewaySettings,
        material: tls.TlsMaterial,
        registry: Registry,
        keys: ApiKeys,
        version: str,
        on_change: Callable[[], None] | None = None,
        on_profiling: Callable[[types_pb2.ProfilingSettings], None] | None = None,
        revoked: RevokedSerials | None = None,
    ) -> None:
        self.settings = settings
        self.endpoints = list(settings.endpoints)
        self.material = material
        self.creds = tls.channel_credentials(material)
        self.revoked = revoked
        self.server_serial = ""
        self.registry = registry
        self.keys = keys
        self.on_change = on_change
        self.on_profiling = on_profiling
        self.info = gateway_pb2.GatewayInfo(
            name=settings.name,
            address=settings.advertise_address,
            pid=os.getpid(),
            started_at_unix_ms=now_ms(),
            version=version,
        )
        self.connected_to = ""
        self.replica_name = ""
        self.sessions = 0
        self.snapshots = 0
        self.configs = 0
        self.config_revision = -1
        self.config_supported = True
        self.registered = False

    def status(self) -> dict[str, object]:
        return {
            "connected_to": self.connected_to,
            "replica_serial": self.server_serial,
            "replica": self.replica_name,
            "sessions": self.sessions,
            "snapshots": self.snapshots,
            "configs": self.configs,
            "config_revision": self.config_revision,
            "registered": self.registered,
            "revision": self.registry.revision,
        }

    async def run(self) -> None:
        """Stay fed by some replica, forever. Gateways start at different replicas (by name)."""
        n = len(self.endpoints)
        i = zlib.crc32(self.settings.name.encode()) % n
        failures = 0
        while True:
            ep = self.endpoints[i % n]
            started = time.monotonic()
            try:
                await self._session(ep)
            except asyncio.CancelledError:
                raise
            except (FeedError, grpc.aio.AioRpcError, TimeoutError, OSError) as e:
                reason = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)
                log.warning(
                    "replica feed lost; trying the next replica", replica=ep, reason=reason or repr(e)
                )
            self.connected_to = ""
            self.registered = False
            if time.monotonic() - started > 10:
                failures = 0
            i += 1
            failures += 1
            if failures % n == 0:
                await asyncio.sleep(backoff_delay(failures // n, 0.2, 3.0))

    def reload(self, material: tls.TlsMaterial) -> None:
        """New client certificate (SIGHUP): used from the next session on."""
        self.material = material
        self.creds = tls.channel_credentials(material)

    async def _session(self, ep: str) -> None:
        self.server_serial = ""
        if self.revoked is not None:
            self.server_serial = await checked_server(
                ep, self.material, self.revoked.serials, connect_timeout_s=self.settings.feed_timeout_s
            )
        channel = grpc.aio.secure_channel(
            ep,
            self.creds,
            options=[
                # no name override: the replica's certificate must carry the endpoint's host
                ("grpc.keepalive_time_ms", 10000),
                ("grpc.keepalive_timeout_ms", 3000),
            ],
        )
        tasks: list[asyncio.Task[None]] = []
        call = workload_pb2_grpc.WorkloadServiceStub(channel).WatchEndpoints(
            workload_pb2.WatchEndpointsRequest()
        )
        try:
            first = await asyncio.wait_for(call.read(), self.settings.feed_timeout_s)
            if first is _EOF or not isinstance(first, workload_pb2.EndpointsSnapshot):
                raise FeedError(f"{ep} closed the endpoints stream at once")
            self._apply(first)
            self.connected_to = ep
            self.sessions += 1
            log.info("fed by replica", replica=ep, endpoints=len(first.endpoints), revision=first.revision)
            gw = gateway_pb2_grpc.GatewayServiceStub(channel)
            tasks = [
                asyncio.create_task(self._endpoints(call, ep), name="gateway-endpoints"),
                asyncio.create_task(self._config(gw), name="gateway-config"),
                asyncio.create_task(self._heartbeat(gw), name="gateway-heartbeat"),
            ]
            if self.revoked is not None:
                tasks.append(
                    asyncio.create_task(
                        self.revoked.wait_revoked(ep, self.server_serial), name="gateway-replica-revoked"
                    )
                )
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                t.result()
            raise FeedError(f"{ep} ended a stream")
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            call.cancel()
            await channel.close(None)

    def _apply(self, snap: workload_pb2.EndpointsSnapshot) -> None:
        self.registry.apply_endpoints(snap.endpoints, snap.revision)
        self.snapshots += 1
        if self.on_change is not None:
            self.on_change()

    async def _endpoints(
        self,
        call: grpc.aio.UnaryStreamCall[workload_pb2.WatchEndpointsRequest, workload_pb2.EndpointsSnapshot],
        ep: str,
    ) -> None:
        while True:
            snap = await call.read()
            if snap is _EOF or not isinstance(snap, workload_pb2.EndpointsSnapshot):
                raise FeedError(f"{ep} closed the endpoints stream")
            self._apply(snap)

    async def _config(self, gw: gateway_pb2_grpc.GatewayServiceAsyncStub) -> None:
        call = gw.WatchGatewayConfig(gateway_pb2.WatchGatewayConfigRequest())
        try:
            while True:
                cfg = await call.read()
                if cfg is _EOF or not isinstance(cfg, gateway_pb2.GatewayConfig):
                    break
                self.registry.apply_config(cfg)
                self.keys.set(list(cfg.key_hashes))
                if self.on_profiling is not None:
                    self.on_profiling(cfg.profiling)
                self.configs += 1
                self.config_revision = cfg.revision
                self.config_supported = True
        except grpc.aio.AioRpcError as e:
            if e.code() in _FAILOVER_CODES:
                raise
            self._unsupported("WatchGatewayConfig", e)
            await asyncio.Event().wait()
        finally:
            call.cancel()
        raise FeedError("the config stream ended")

    def _unsupported(self, what: str, e: grpc.aio.AioRpcError) -> None:
        if e.code() == grpc.StatusCode.UNIMPLEMENTED:
            self.config_supported = False
            log.warning(
                f"replica does not serve GatewayService.{what}: default policies; no API keys; not listed",
                replica=self.connected_to,
            )
        else:
            log.error(f"{what} refused", code=e.code().name, detail=e.details())

    async def _heartbeat(self, gw: gateway_pb2_grpc.GatewayServiceAsyncStub) -> None:
        s = self.settings
        ttl = max(3, math.ceil(3 * s.heartbeat_interval_s))
        lease = 0
        while True:
            req = gateway_pb2.GatewayHeartbeatRequest(
                info=self.info, lease=lease, ttl_s=ttl, stats=self.registry.stats.snapshot()
            )
            try:
                resp = await gw.Heartbeat(req, timeout=s.feed_timeout_s)
            except grpc.aio.AioRpcError as e:
                if e.code() in _FAILOVER_CODES:
                    raise FeedError(f"heartbeat not answered: {e.code().name}: {e.details()}") from None
                self._unsupported("Heartbeat", e)
                await asyncio.Event().wait()
                return
            if resp.lease != lease:
                log.info("registered", replica=resp.replica, lease=f"{resp.lease:x}", ttl_s=resp.ttl_s)
            lease = resp.lease
            self.replica_name = resp.replica
            self.registered = True
            await asyncio.sleep(s.heartbeat_interval_s)
