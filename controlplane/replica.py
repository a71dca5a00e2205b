"""One control-plane replica: API server, registration, election and leader-only loops."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path

import grpc
import structlog
from cryptography import x509
from grpc_health.v1 import _async as health_aio  # the asyncio health servicer
from grpc_health.v1 import health_pb2, health_pb2_grpc

from controlplane import audit, keys, telemetry
from controlplane.api.agent_service import AgentService
from controlplane.api.cluster_service import ClusterService
from controlplane.api.drain import DrainState
from controlplane.api.endpoint_service import EndpointService
from controlplane.api.gateway_service import GatewayService
from controlplane.api.guard import CallGuard
from controlplane.api.ledger_service import LedgerService
from controlplane.api.package_service import PackageService
from controlplane.api.rollout_service import RolloutService
from controlplane.api.security_service import SecurityService
from controlplane.api.telemetry_service import TelemetryService
from controlplane.api.workload_service import WorkloadService
from controlplane.certs_state import Revocations, SeenCertificates
from controlplane.election import Elector, Fence
from controlplane.failpoints import Failpoints, watch_hold
from controlplane.feeds import Feeds
from controlplane.fencing import node_problems, registered_nodes, stored_config
from controlplane.lifecycle import NodeLifecycle
from controlplane.liveness import AliveKeys
from controlplane.metrics import LeaderView, ReplicaMetrics, rollout_rows
from controlplane.nodes import NodeSessions
from controlplane.profiling_feed import close_profiler
from controlplane.rollout import RolloutLoop
from controlplane.scheduler.leader import SchedulerLoop
from controlplane.settings import ReplicaSettings
from controlplane.store import EtcdStore, StoreSettings
from controlplane.watch_lag import WatchLag
from kunlun_common import tls
from kunlun_common.api import (
    agent_pb2_grpc,
    cluster_pb2,
    cluster_pb2_grpc,
    gateway_pb2_grpc,
    package_pb2_grpc,
    rollout_pb2_grpc,
    security_pb2_grpc,
    telemetry_pb2_grpc,
    workload_pb2_grpc,
)
from kunlun_common.clock import now_ms
from kunlun_common.errors import ConfigError, KunlunError, TemporaryError
from kunlun_common.messages import msg, msg_list
from kunlun_common.metrics_http import MetricsServer
from kunlun_common.profiling import Profiler, ProfilerCollector
from kunlun_common.reload import LiveTls
from kunlun_common.retry import backoff_delay
from kunlun_common.version import version
from kunlun_common.wire_limits import replica_server_options

log = structlog.get_logger("replica")
VERSION = version()
DRAIN_STREAMS_WAIT_S = 5.0
"""A drain waits at most this long for the streams it ended to close before answering."""


class Replica:
    def __init__(self, settings: ReplicaSettings) -> None:
        self.settings = settings
        self.etcd_wait_s = settings.etcd_wait_s
        own = settings.cert_paths()
        cert = own.cert
        self.tls = tls.load_tls(own, expect_roles=("replica",))
        self.live_tls = LiveTls(self.tls, expect_roles=("replica",))
        etcd_paths = settings.etcd_cert_paths()
        if self.tls.identity.name != settings.name:
            raise ConfigError(
                msg(
                    "replica.cert_name",
                    "{cert}: certificate is for replica {cert_name!r} but this replica is named {name!r}; "
                    "use the certificate issued for {name!r}",
                    cert=str(cert),
                    cert_name=self.tls.identity.name,
                    name=settings.name,
                )
            )
        self.store = EtcdStore(
            StoreSettings(
                endpoints=settings.etcd_endpoints,
                ca_path=str(etcd_paths.ca),
                cert_path=str(etcd_paths.cert),
                key_path=str(etcd_paths.key),
                server_name=settings.etcd_server_name,
            )
        )
        self.sessions = NodeSessions(self.store, settings)
        self.feeds = Feeds(self.store)
        self.feeds.cache.listen([keys.ALIVE], AliveKeys(self.sessions, self.feeds.cache))
        self.lifecycle = NodeLifecycle(self.store)
        self.scheduler = SchedulerLoop(self.store, settings.name)
        self.rollouts = RolloutLoop(self.store, settings.name)
        self.elector = Elector(
            self.store,
            settings.name,
            settings.advertise_address,
            settings.election,
            loops=[self._lifecycle_loop, self.scheduler.run, self.rollouts.run, self._audit_retention],
        )
        self.revocations = Revocations(self.store)
        self.seen = SeenCertificates(self.store)
        self.guard = CallGuard(self.revocations, self.seen, audit.AuditLog(self.store, settings.name))
        self.metrics = ReplicaMetrics(settings.name)
        self.store.observer = self.metrics.etcd_observed
        self.scheduler.metrics = self.metrics
        self.metrics.leader_state = lambda: (
            self.elector.is_leader,
            self.elector.fence.epoch if self.elector.fence is not None and self.elector.is_leader else 0,
            self.elector.terms,
        )
        self.metrics.collector.etcd_quota_bytes = settings.etcd_quota_bytes
        self.metrics.leader_view = self._leader_view
        self.watch_lag = WatchLag(self.store, self.feeds.cache, settings.name, settings.watch_heartbeat_s)
        self.metrics.watch_lag = self.watch_lag.lag_s
        self.profiler = Profiler(settings.profiling, f"replica.{settings.name}")
        """Run-time profiling, switched by the scheduler settings (controlplane/profiling_feed.py)."""
        self.metrics.registry.register(ProfilerCollector(self.profiler))
        self.metrics_server: MetricsServer | None = None
        self.server: grpc.aio.Server | None = None
        self.health = health_aio.HealthServicer()
        self._tasks: list[asyncio.Task[None]] = []
        self._lease = 0
        self.metrics_address = ""
        self.stopped = asyncio.Event()
        self.drain_state = DrainState(settings.name)
        self.exit_requested = asyncio.Event()
        """Set by a drain once it is done: `serve` stops the replica and the process exits 0."""
        self._drain: asyncio.Future[cluster_pb2.DrainReplicaResponse] | None = None

    async def _leader_view(self) -> LeaderView:
        (nodes, spreads), members = await asyncio.gather(
            telemetry.nodes_and_spreads(self.store, self.sessions), self.store.member_statuses()
        )
        return LeaderView(
            etcd=[(m.name or m.endpoint, m.healthy, m.db_size_bytes) for m in members],
            rollouts=rollout_rows(self.rollouts.current),
            nodes=[(n.name, n.ready) for n in nodes],
            spreads=spreads,
        )

    async def _audit_retention(self, fence: Fence) -> None:
        await audit.retention_loop(self.store, self.settings.audit)

    async def _lifecycle_loop(self, fence: Fence) -> None:
        await self.lifecycle.run(fence)

    async def _wait_for_etcd(self) -> None:
        start = time.monotonic()
        attempt = 0
        while True:
            try:
                await self.store.revision()
                return
            except TemporaryError as e:
                waited = time.monotonic() - start
                delay = backoff_delay(attempt, 0.5, 5.0)
                attempt += 1
                log.warning(
                    "waiting for etcd",
                    endpoints=list(self.settings.etcd_endpoints),
                    error=str(e)[:200],
                    waited_s=round(waited, 1),
                    retry_in=round(delay, 1),
                )
                if self.etcd_wait_s and waited > self.etcd_wait_s:
                    raise TemporaryError(
                        msg(
                            "replica.etcd_unreachable",
                            "etcd at {endpoints} unreachable or without quorum for {waited:.0f}s ({error}); "
                            "start etcd (make demo does) or fix etcd_endpoints",
                            endpoints=", ".join(self.settings.etcd_endpoints),
                            waited=waited,
                            error=str(e),
                        )
                    ) from None
                await asyncio.sleep(delay)

    async def _wait_for_restore(self) -> None:
        """Never act on a half-restored cluster: wait while `kunlun-cli cluster restore` writes
        (it creates keys.RESTORING first and deletes it last; an interrupted restore leaves it, and
        the operator finishes with `restore --force`)."""
        logged = -1e9
        while (kv := await self.store.get(keys.RESTORING)) is not None:
            if time.monotonic() - logged >= 10.0:
                logged = time.monotonic()
                log.warning(
                    "a restore from backup is writing this cluster's keys; waiting until it finishes "
                    "(if it was interrupted: run `kunlun-cli cluster restore FILE --force` again)",
                    key=keys.RESTORING,
                    marker=kv.value.decode(errors="replace")[:200],
                )
            await asyncio.sleep(1.0)

    async def _check_fencing(self) -> None:
        """Refuse to start when a registered node's self-fencing is too slow for our node lease TTL
        and the stored grace (controlplane/fencing.py)."""
        grace = (await stored_config(self.store)).node_not_ready_grace_seconds
        problems = node_problems(await registered_nodes(self.store), grace, self.settings.node_lease_ttl_s)
        if problems:
            raise ConfigError(
                msg_list(
                    "replica.settings.node_lease_fencing",
                    "node_lease_ttl_s: {parts}",
                    problems,
                    bullet="",
                    sep="; ",
                )
            )

    async def _register(self) -> None:
        self._lease = await self.store.lease_grant(self.settings.replica_lease_ttl_s)
        info = cluster_pb2.ReplicaInfo(
            name=self.settings.name,
            address=self.settings.advertise_address,
            pid=os.getpid(),
            started_at_unix_ms=now_ms(),
            version=VERSION,
            metrics_address=self.metrics_address,
        )
        await self.store.put(keys.replica(self.settings.name), keys.encode_message(info), self._lease)
        self._info = info

    async def _keep_registered(self) -> None:
        period = self.settings.replica_lease_ttl_s / 3
        while True:
            await asyncio.sleep(period)
            try:
                ttl = await self.store.lease_keepalive(self._lease)
                if ttl <= 0:
                    log.warning("replica lease lost; registering again")
                    await self._register()
            except KunlunError as e:
                log.warning("replica lease refresh failed", error=str(e))

    async def start(self) -> None:
        await self.store.connect()
        await self._wait_for_etcd()
        await self._wait_for_restore()
        await self._check_fencing()
        if self.settings.metrics_listen:
            self.metrics_server = MetricsServer(
                self.settings.metrics_listen, self.tls, self.metrics.registry, self.metrics.prepare
            )
            self.metrics_address = await self.metrics_server.start()
        await self._register()
        await self.feeds.start()
        server = grpc.aio.server(
            options=[
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.min_ping_interval_without_data_ms", 5000),
                *replica_server_options(),  # the agent channel's limits, mirrored by the agents
            ],
        )
        cluster = ClusterService(self.store, self.sessions, self.elector, self.settings.name, self.drain)
        agent = AgentService(self.sessions, self.feeds, self.settings.name, self.settings.node_lease_ttl_s)
        workload = WorkloadService(self.store, self.feeds, self.tls)
        gateway = GatewayService(self.store, self.feeds, self.settings.name)
        rollout = RolloutService(self.store)
        telemetry_svc = TelemetryService(self.store, self.sessions, self.settings.name)
        package = PackageService(
            self.store,
            self.feeds,
            self.settings.name,
            self.settings.package_store_dir,
            self.settings.package_store_quota_bytes,
        )
        endpoint_svc = EndpointService(self.store)
        security = SecurityService(
            self.store, self.tls, self.settings.etcd_endpoints, self.settings.etcd_cert_paths()
        )
        ledger = LedgerService(self.feeds, self.tls)
        for svc in (
            cluster,
            agent,
            workload,
            gateway,
            rollout,
            telemetry_svc,
            endpoint_svc,
            security,
            package,
        ):
            svc.observe_call = self.metrics.api_observed  # API latency by method and code
        for guarded in (
            cluster,
            agent,
            workload,
            gateway,
            rollout,
            telemetry_svc,
            endpoint_svc,
            security,
            ledger,
        ):
            guarded.guard = self.guard  # revocation, certificate inventory, audit
        package.guard = self.guard
        for svc in (
            cluster,
            agent,
            workload,
            gateway,
            rollout,
            telemetry_svc,
            endpoint_svc,
            security,
            package,
        ):
            svc.drain = self.drain_state
        ledger.drain = self.drain_state
        revocations = asyncio.create_task(self.revocations.run(), name="revocations")
        try:
            await asyncio.wait_for(self.revocations.ready.wait(), 30.0)
        except TimeoutError:
            revocations.cancel()
            raise TemporaryError(
                msg("replica.revocations_timeout", "could not read the revocation list from etcd within 30 s")
            ) from None
        await self.seen.saw(x509.load_pem_x509_certificate(self.tls.cert), "replica")

        def reloaded(m: tls.TlsMaterial) -> None:  # SIGHUP: new connections use the new certificate
            self.tls = workload.tls = ledger.tls = m
            if self.metrics_server is not None:
                self.metrics_server.reload(m)
            self._tasks.append(
                asyncio.create_task(
                    self.seen.saw(x509.load_pem_x509_certificate(m.cert), "replica"), name="seen"
                )
            )

        self.live_tls.on_reload(reloaded)
        cluster_pb2_grpc.add_ClusterServiceServicer_to_server(cluster, server)
        agent_pb2_grpc.add_AgentServiceServicer_to_server(agent, server)
        workload_pb2_grpc.add_WorkloadServiceServicer_to_server(workload, server)
        gateway_pb2_grpc.add_GatewayServiceServicer_to_server(gateway, server)
        rollout_pb2_grpc.add_RolloutServiceServicer_to_server(rollout, server)
        telemetry_pb2_grpc.add_TelemetryServiceServicer_to_server(telemetry_svc, server)
        package_pb2_grpc.add_PackageServiceServicer_to_server(package, server)
        gateway_pb2_grpc.add_EndpointServiceServicer_to_server(endpoint_svc, server)
        agent_pb2_grpc.add_LedgerServiceServicer_to_server(ledger, server)
        security_pb2_grpc.add_SecurityServiceServicer_to_server(security, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        try:
            server.add_secure_port(self.settings.listen, self.live_tls.server_credentials())
        except RuntimeError as e:
            raise ConfigError(
                msg(
                    "settings.cannot_listen",
                    "{what}: cannot listen on {address} ({reason}); is the port in use?",
                    what="listen",
                    address=self.settings.listen,
                    reason=str(e),
                )
            ) from None
        await server.start()
        self.server = server
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self._tasks = [
            asyncio.create_task(self.elector.run(), name="elector"),
            asyncio.create_task(self.sessions.refresh_leases(), name="node-leases"),
            asyncio.create_task(self._keep_registered(), name="replica-lease"),
            asyncio.create_task(self.feeds.profiling.drive(self.profiler), name="profiling"),
            revocations,
        ]
        if self.settings.watch_heartbeat_s > 0:
            self._tasks.append(asyncio.create_task(self.watch_lag.run(lambda: self._lease), name="watch-lag"))
        log.info("replica serving", name=self.settings.name, listen=self.settings.listen, pid=os.getpid())

    async def drain(self) -> cluster_pb2.DrainReplicaResponse:
        """`kunlun-cli cluster replica drain`: stop campaigning and hand leadership over (waiting,
        bounded, until another replica leads), report NOT_SERVING, end every agent and gateway
        stream so that they reconnect to another replica, then ask `serve` to exit (0) once the
        answer is out. A second call while draining answers the same."""
        if self._drain is None:
            self._drain = asyncio.ensure_future(self._drain_once())
        return await asyncio.shield(self._drain)

    @property
    def draining(self) -> bool:
        return self._drain is not None

    async def _drain_once(self) -> cluster_pb2.DrainReplicaResponse:
        try:
            return await self._drain_steps()
        finally:  # answered or failed: a drained replica exits (the answer goes out meanwhile)
            asyncio.get_running_loop().call_later(0.2, self.exit_requested.set)

    async def _drain_steps(self) -> cluster_pb2.DrainReplicaResponse:
        started = time.monotonic()
        was_leader = self.elector.is_leader
        log.info("replica draining", name=self.settings.name, leader=was_leader)
        await self.health.enter_graceful_shutdown()
        await self.elector.resign()  # stops campaigning; as leader, revoking the lease deletes the key
        leader, handover_ms = await self._wait_for_other_leader(started)
        self.drain_state.begin()
        closed = await self.drain_state.wait_closed(DRAIN_STREAMS_WAIT_S)
        resp = cluster_pb2.DrainReplicaResponse(
            name=self.settings.name,
            pid=os.getpid(),
            was_leader=was_leader,
            leader=leader,
            handover_ms=handover_ms if was_leader else 0,
            streams_ended=self.drain_state.streams_ended,
        )
        log.info(
            "replica drained; exiting",
            leader=leader,
            handover_ms=resp.handover_ms,
            streams_ended=resp.streams_ended,
            streams_still_open=0 if closed else self.drain_state.open_streams,
        )
        return resp

    async def _wait_for_other_leader(self, started: float) -> tuple[str, int]:
        """(the leader that is not us, ms since `started`) once one holds the leader key; ("", 0)
        when none did within two leader lease TTLs (e.g. the last replica drained)."""
        deadline = started + 2 * self.settings.election.ttl_s + 1
        while True:
            with contextlib.suppress(KunlunError):
                kv = await self.store.get(keys.LEADER)
                name = keys.decode(kv.value).get("name", "") if kv is not None else ""
                if name and name != self.settings.name:
                    return str(name), int((time.monotonic() - started) * 1000)
            if time.monotonic() > deadline:
                return "", 0
            await asyncio.sleep(0.1)

    def reload_certificates(self) -> None:
        """SIGHUP after `kunlun-cli certs rotate`: the replica's own certificate (its gRPC server
        and exporter from the next handshake, its calls to agents from the next connection) and
        its etcd client certificate (a new etcd channel; store.reload_credentials)."""
        self.live_tls.reload()
        self.store.reload_credentials()

    async def stop(self) -> None:
        """Graceful stop: resign leadership at once, leave the registry, stop serving."""
        log.info("replica stopping", name=self.settings.name)
        await self.health.enter_graceful_shutdown()
        await self.elector.resign()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await close_profiler(self.profiler)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.store.lease_revoke(self._lease), 2.0)
        await self.feeds.stop()
        if self.server is not None:
            await self.server.stop(1.0)
        if self.metrics_server is not None:
            await self.metrics_server.stop()
        await self.store.close()
        self.stopped.set()


def dump_tasks() -> None:
    """SIGUSR1: log where every asyncio task is waiting (for operators debugging a stuck loop)."""
    import io

    for t in asyncio.all_tasks():
        buf = io.StringIO()
        coro: object = t.get_coro()
        for _ in range(20):  # follow the chain of awaits down to where the task is parked
            frame = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None)
            if frame is not None:
                buf.write(f"{frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}\n")
            coro = getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None)
            if coro is None:
                break
        log.info("task stack", task=t.get_name(), stack=buf.getvalue())


async def serve(settings: ReplicaSettings, points: Failpoints | None = None) -> None:
    """Run a replica until SIGTERM/SIGINT. `points`: test-only failpoints (controlplane/failpoints.py)."""
    replica = Replica(settings)
    if points is not None and points.active():
        log.warning("TEST FAILPOINTS active: this replica is not for production", failpoints=points.active())
        if points.watch_hold_file:
            replica.feeds.cache.hold = watch_hold(Path(points.watch_hold_file))
    await replica.start()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGUSR1, dump_tasks)
    loop.add_signal_handler(signal.SIGHUP, replica.reload_certificates)  # after `kunlun-cli certs rotate`
    waiter = asyncio.create_task(stop.wait())
    drained = asyncio.create_task(replica.exit_requested.wait())
    watched = {waiter, drained, *replica._tasks}
    while True:
        done, _ = await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
        watched -= done
        for t in done - {waiter, drained}:
            if not t.cancelled() and t.exception() is not None:
                log.error("background task died", task=t.get_name(), error=str(t.exception()))
        # a drain ends the elector on purpose: keep serving until the drain asks to exit
        if waiter in done or drained in done or not replica.draining:
            break
    for t in (waiter, drained):
        t.cancel()
    await asyncio.gather(waiter, drained, return_exceptions=True)
    await replica.stop()
