"""The node agent process: load the declaration, start the device plugins, keep the link up, run the
engines the scheduler assigns (`executor/manager.py`) and serve their logs (`node_service.py`)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import structlog

from kunlun_common import revocation, tls
from kunlun_common.api import agent_pb2, types_pb2
from kunlun_common.errors import ConfigError
from kunlun_common.messages import msg
from kunlun_common.metrics_http import MetricsServer
from kunlun_common.pki import paths_for
from kunlun_common.profiling import Profiler, ProfilerCollector, ProfilingMode
from kunlun_common.reload import LiveTls
from kunlun_common.version import version
from node_agent.connection import ReplicaLink, registration
from node_agent.devices import DeviceManager
from node_agent.executor import fence, ledger
from node_agent.executor.cgroups import detect_layout
from node_agent.executor.hardening import plan_hardening, protect_key_folder, with_engine_user
from node_agent.executor.manager import ExecutorManager
from node_agent.executor.package_cache import PackageCache
from node_agent.executor.package_pull import PackagePuller, PullSettings
from node_agent.executor.prepare import NodeContext
from node_agent.executor.probes import endpoint
from node_agent.executor.sandbox import (
    Protections,
    detect_protections,
    require_protections,
)
from node_agent.metrics import AgentMetrics, cgroup_usage
from node_agent.node_service import NodeServiceServer, NodeServiceServicer
from node_agent.plugins.config import NodeConfig, load_config
from node_agent.plugins.remote import plugin_socket_dir
from node_agent.settings import AgentSettings
from node_agent.simulation import simulated_mode

log = structlog.get_logger("agent")


class AgentLoopEnded(RuntimeError):
    """One of the agent's loops (link, sampler, fence, revocations) ended without being asked to:
    a bug; restarting the agent can help (its engines are adopted, or fenced, as on any restart)."""


VERSION = version()
DEFAULT_NODE_LEASE_S = 5.0  # the replicas' default node_lease_ttl_s
DEFAULT_NODE_GRACE_S = 8.0  # the scheduler's default node_not_ready_grace_seconds
FENCE_RENEW_POLL_S = 0.2
FAILOVER_S = 1.0
"""Time the agent allows itself to register with another replica and hear its first ack, once it
gave up on an unresponsive one (a TLS handshake and a few etcd writes; well under this)."""


def check_fencing(settings: AgentSettings) -> None:
    """Refuse self-fencing timings that cannot work: the deadline must outlast an agent restart,
    and deadline + stop grace must stay below the default node lease + not-ready grace (the replica
    checks the cluster's actual numbers again at registration)."""
    ex = settings.executor
    if ex.disconnect_stop_s < fence.MIN_DEADLINE_S:
        raise ConfigError(
            msg(
                "agent.flags.disconnect_stop_short",
                "--disconnect-stop: {stop:g}s is shorter than an agent restart; expected at "
                "least {least:g}s (restarting the agent must never stop its engines)",
                stop=ex.disconnect_stop_s,
                least=fence.MIN_DEADLINE_S,
            )
        )
    # one frozen replica must never stop the engines: the agent notices it after the ack timeout
    # (checked once per heartbeat interval) and needs a moment to reach another replica, all
    # before the deadline
    failover = settings.ack_timeout_s + settings.heartbeat_interval_s + FAILOVER_S
    if failover > ex.disconnect_stop_s:
        raise ConfigError(
            msg(
                "agent.flags.failover_too_slow",
                "--ack-timeout {ack:g}s + --heartbeat-interval {heartbeat:g}s + failover to another replica "
                "{failover_s:g}s = {failover:g}s is more than --disconnect-stop {stop:g}s: one frozen replica "
                "would stop every engine before the agent reaches another; lower --ack-timeout "
                "(and --heartbeat-interval) or raise --disconnect-stop",
                ack=settings.ack_timeout_s,
                heartbeat=settings.heartbeat_interval_s,
                failover_s=FAILOVER_S,
                failover=failover,
                stop=ex.disconnect_stop_s,
            )
        )
    budget = ex.disconnect_stop_s + fence.FENCE_SLACK_S + ex.stop_grace_s
    if budget >= DEFAULT_NODE_LEASE_S + DEFAULT_NODE_GRACE_S:
        raise ConfigError(
            msg(
                "agent.flags.fence_too_slow",
                "--disconnect-stop {stop:g}s + fence check slack {slack:g}s + --stop-grace {grace:g}s = "
                "{budget:g}s is not below the default node lease {lease:g}s + node_not_ready_grace_seconds "
                "{node_grace:g}s = {limit:g}s: an engine cut off with its node could still run when its "
                "instance starts elsewhere; lower them",
                stop=ex.disconnect_stop_s,
                slack=fence.FENCE_SLACK_S,
                grace=ex.stop_grace_s,
                budget=budget,
                lease=DEFAULT_NODE_LEASE_S,
                node_grace=DEFAULT_NODE_GRACE_S,
                limit=DEFAULT_NODE_LEASE_S + DEFAULT_NODE_GRACE_S,
            )
        )


def protection_names(p: Protections) -> list[str]:
    """The protections as reported to the control plane (`InstanceReport.protections`)."""
    flags = (
        ("cgroup-memory", p.cgroup_memory),
        ("cgroup-pids", p.cgroup_pids),
        ("cgroup-cpu", p.cgroup_cpu),
        ("pid-namespace", p.pid_namespace),
        ("mount-namespace", p.mount_namespace),
        ("private-dev", p.private_dev),
        ("private-tmp", p.private_dev),
        ("env-allowlist", p.env_allowlist),
    )
    return [name for name, on in flags if on]


class Agent:
    def __init__(self, settings: AgentSettings, config: NodeConfig | None = None) -> None:
        self.settings = settings
        check_fencing(settings)
        self.config = config or load_config(settings.config_path)
        paths = paths_for(settings.cert_dir, "agent", self.config.node_name)
        self.tls = tls.load_tls(paths, expect_roles=("agent",))
        self.live_tls = LiveTls(self.tls, expect_roles=("agent",))
        self.live_tls.on_reload(self._reloaded)
        if self.tls.identity.name != self.config.node_name:
            raise ConfigError(
                msg(
                    "agent.cert_node",
                    "{cert}: certificate is for node {cert_node!r} but {config} declares node {node!r}; "
                    "the certificate decides which node an agent speaks for",
                    cert=str(paths.cert),
                    cert_node=self.tls.identity.name,
                    config=settings.config_path,
                    node=self.config.node_name,
                )
            )
        state_dir = Path(settings.state_dir)
        state_dir.mkdir(parents=True, exist_ok=True)
        self.state_dir = state_dir.resolve()
        simulated = simulated_mode(self.config, state_dir) if self.config.simulated else None
        env = simulated.env if simulated is not None else dict(os.environ)
        self.devices = DeviceManager(self.config, env)
        self.plugin_socket_dir = plugin_socket_dir(self.config, state_dir)
        self.protections = detect_protections()
        require_protections(self.protections, settings.executor.allow_unsandboxed)
        protect_key_folder(settings.cert_dir, paths.key.parent, paths.key)
        # engines never see the certificates nor the agent's state (their own folders are bound back)
        self.hardening = plan_hardening(
            settings.executor, self.protections, (settings.cert_dir, str(self.state_dir))
        )
        ex = settings.executor
        package_cache = PackageCache(
            root=state_dir.resolve() / "packages",
            limit_bytes=ex.package_cache_mb * 2**20,
            puller=PackagePuller(
                settings.endpoints, self.tls, PullSettings(rate_bytes_s=ex.package_pull_rate_mb_s * 2**20)
            ),
            in_use=lambda: self.executor.packages_in_use(),
            require_signed=ex.require_signed_packages,
            trusted_keys_dir=ex.trusted_keys_dir,
        )
        ctx = NodeContext(
            node=self.config.node_name,
            address=self.config.address,
            instances_dir=state_dir.resolve() / "instances",
            cache_root=state_dir.resolve() / "cache",
            settings=with_engine_user(settings.executor, self.hardening),
            sandbox=self.hardening.sandbox,
            cgroups=self.protections.cgroup_memory
            or self.protections.cgroup_pids
            or self.protections.cgroup_cpu,
            devices=self.devices.devices,
            plugin=self.devices.plugin,
            package_cache=package_cache,
        )
        self.executor = ExecutorManager(
            ctx,
            [*protection_names(self.protections), *self.hardening.names],
            self._seconds_since_contact,
            simulated.chip_usage if simulated is not None else None,
            fence_deadline_s=settings.executor.disconnect_stop_s,
        )
        self.revoked = revocation.RevokedSerials()
        self.node_service = NodeServiceServer(
            self.live_tls,
            NodeServiceServicer(
                self.config.node_name,
                self.executor.instance_dir,
                ledger.ledger_path(self.state_dir),
                plugins=lambda: list(self.devices.plugins.values()),
                revoked=self.revoked,
            ),
        )
        self.node_service_address = ""
        self.metrics: MetricsServer | None = None
        self.metrics_address = ""
        self.link = ReplicaLink(
            settings.endpoints,
            self.tls,
            register=self._registration,
            samples=self.devices.samples,
            heartbeat_interval_s=settings.heartbeat_interval_s,
            ack_timeout_s=settings.ack_timeout_s,
            connect_timeout_s=settings.connect_timeout_s,
            on_assignments=self.executor.assign,
            reports=self.executor.report,
            report_changed=self.executor.changed,
            on_profiling=self._profiling,
            revoked=self.revoked,
        )
        self.profiler = Profiler(settings.profiling, f"agent.{self.config.node_name}")
        """Run-time profiling, switched by the replicas (scheduler settings) on the stream."""

    def _reloaded(self, material: tls.TlsMaterial) -> None:
        """SIGHUP after `certs rotate`: the next connection to a replica and every new handshake
        at the NodeService and the exporter use the new certificate; the open stream carries on."""
        self.tls = material
        self.link.reload(material)
        if self.metrics is not None:
            self.metrics.reload(material)

    def _profiling(self, p: types_pb2.ProfilingSettings) -> None:
        self.profiler.apply(ProfilingMode(p.enabled, p.interval_ms))

    def _registration(self) -> agent_pb2.RegisterNode:
        reg = registration(
            self.config.node_name,
            self.config.address,
            self.config.simulated,
            self.devices.devices(),
            VERSION,
            os.path.abspath(self.config.path),
            self.node_service_address,
            self.metrics_address,
        )
        reg.disconnect_deadline_s = self.settings.executor.disconnect_stop_s + fence.FENCE_SLACK_S
        reg.stop_grace_s = self.settings.executor.stop_grace_s
        return reg

    async def _renew_fence(self) -> None:
        """Renew the engines' fence lease after every acknowledged heartbeat (see executor/fence.py)."""
        path = self.state_dir / fence.FENCE_FILE
        deadline = self.settings.executor.disconnect_stop_s
        written = 0.0
        while True:
            ack = self.link.last_ack
            if ack > written:
                try:
                    await asyncio.to_thread(fence.renew, path, ack, deadline)
                    written = ack
                except OSError as e:
                    log.error("could not renew the engines' fence lease", path=str(path), error=str(e))
            await asyncio.sleep(FENCE_RENEW_POLL_S)

    def _seconds_since_contact(self) -> float:
        return time.monotonic() - self.link.last_contact

    def explain_no_devices(self) -> str | None:
        """If no declared device is usable, say exactly why (tools, devices, config file)."""
        devs = self.devices.devices()
        if any(d.status == types_pb2.DEVICE_STATUS_READY for d in devs):
            return None
        lines = [
            f"no usable device on node {self.config.node_name} (config {os.path.abspath(self.config.path)}):"
        ]
        for dtype, err in self.devices.tool_errors.items():
            lines.append(f"  {dtype}: {err}")
        for d in devs:
            lines.append(f"  {d.name}: {d.status_reason or 'not ready'}")
        return "\n".join(lines)

    async def _sample_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_seconds)
            try:
                await self.devices.sample()
            except Exception as e:  # a loop must never die
                log.exception("device sampling failed", error=str(e))

    async def _start_metrics(self) -> None:
        if not self.settings.metrics_listen:
            return
        m = AgentMetrics(
            self.config.node_name,
            self.devices.devices,
            lambda: [w.status for w in self.executor.workers.values()],
            lambda: bool(self.link.connected_to),
            # the cgroups the supervisors made: `<cgroup_parent>/<node>/<instance>` in each hierarchy
            usage=cgroup_usage(
                detect_layout(), f"{self.settings.executor.cgroup_parent}/{self.config.node_name}"
            )
            if self.executor.ctx.cgroups
            else None,
        )
        m.registry.register(ProfilerCollector(self.profiler))
        self.metrics = MetricsServer(
            self.settings.metrics_listen, self.tls, m.registry, m.prepare, revoked=self.revoked
        )
        self.metrics_address = await self.metrics.start()

    async def run(self) -> None:
        await self.devices.start(self.plugin_socket_dir)  # out-of-process plugins register here
        try:
            listen = self.settings.node_service_listen or endpoint(self.config.address, 0)
            port = await self.node_service.start(listen)
            self.node_service_address = endpoint(self.config.address, port)
            await self._start_metrics()
            await self.executor.start()
            await self._run()
        finally:
            if self.settings.executor.stop_engines_on_exit:
                await self.executor.stop_everything("the agent exited (--stop-engines-on-exit)")
            await self.executor.close()  # without --stop-engines-on-exit the next agent adopts them
            await self.node_service.stop()
            if self.metrics is not None:
                await self.metrics.stop()
            await asyncio.to_thread(self.profiler.close)
            await self.devices.stop()

    async def _link_after_first_list(self) -> None:
        """Connect to a replica only once the revocation list is in: a fresh agent knows no
        revocation, so without it a revoked replica certificate would be trusted until the first
        poll (revocation.first_fetch)."""
        await revocation.first_fetch(self.settings.endpoints, lambda: self.tls, self.revoked)
        await self.link.run()

    async def _run(self) -> None:
        await self.devices.sample()
        why = self.explain_no_devices()
        if why:
            log.warning(why)
        log.info(
            "agent starting",
            node=self.config.node_name,
            devices=len(self.config.devices),
            simulated=self.config.simulated,
            endpoints=list(self.settings.endpoints),
            node_service=self.node_service_address,
            protections=[*protection_names(self.protections), *self.hardening.names],
            protection_notes=list(self.protections.notes),
        )
        tasks = [
            asyncio.create_task(self._link_after_first_list(), name="link"),
            asyncio.create_task(self._sample_loop(), name="sampler"),
            asyncio.create_task(self._renew_fence(), name="fence"),
            asyncio.create_task(
                revocation.follow(self.settings.endpoints, lambda: self.tls, self.revoked), name="revocations"
            ),
        ]
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        loop.add_signal_handler(signal.SIGHUP, self.live_tls.reload)
        waiter = asyncio.create_task(stop.wait())
        await asyncio.wait([waiter, *tasks], return_when=asyncio.FIRST_COMPLETED)
        # a loop that ended on its own is a bug (each runs until cancelled): say which and why, and
        # exit non-zero so that systemd restarts the agent instead of leaving the node NotReady
        ended = [t for t in tasks if t.done() and not t.cancelled()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for t in ended:
            exc = t.exception()
            log.error(
                "agent loop ended on its own; stopping the agent",
                loop=t.get_name(),
                error=f"{type(exc).__name__}: {exc}" if exc is not None else "returned",
                exc_info=exc,
            )
        if ended and not stop.is_set():
            raise AgentLoopEnded(", ".join(sorted(t.get_name() for t in ended)))
        log.info("agent stopped", node=self.config.node_name)
