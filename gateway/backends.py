"""The routable instances per workload, their load, and which of them may take requests now.

The set is replaced whole by every endpoint snapshot from the control plane: an instance missing
from a snapshot is removed at once (its idle connections closed; requests in flight finish).

Ejection (an instance kept out of rotation for a while, without waiting for the control plane):
- passive: a refused or timed-out connect, or a reset on a fresh connection, ejects at once; resets
  on reused keep-alive connections or timeouts eject on the 2nd in a row, 502/503/504 answers on
  the 3rd. Ejection lasts `eject_s`, doubled on every repeat (at most 60 s); any success resets.
- active: with `health_check_interval_s` > 0, every instance's health path is fetched each
  interval; a failure ejects it until a check passes, a pass lifts any ejection.
When every instance of a workload is ejected, they are tried anyway (a blip must not make the whole
workload unavailable for the ejection period).
"""

from __future__ import annotations

import asyncio
import math
import random
import time
import zlib
from collections.abc import Iterable, Sequence
from typing import Any

import structlog

from gateway.endpoints import Compiled, compile_all
from gateway.httpclient import HttpError, fetch
from gateway.metrics import GatewayMetrics
from gateway.routing import Policy, make_policy
from gateway.settings import GatewaySettings, split_host_port
from gateway.stats import TrafficStats
from gateway.upstream import Pool
from kunlun_common.api import gateway_pb2, workload_pb2

log = structlog.get_logger("gateway.backends")
_MAX_EJECT_S = 60.0
_THRESHOLDS = {"connect": 1, "reset": 2, "timeout": 2, "status": 3}


class Backend:
    """One instance of a workload, as the gateway sees it."""

    __slots__ = (
        "address",
        "consecutive",
        "eject_reason",
        "ejected_until",
        "ejections",
        "failures",
        "host",
        "host_header",
        "inflight",
        "instance_id",
        "model",
        "node",
        "pool",
        "port",
        "removed",
        "requests",
        "variant",
        "workload",
    )

    def __init__(self, ep: workload_pb2.Endpoint, settings: GatewaySettings) -> None:
        self.instance_id = ep.instance_id
        self.workload = ep.workload
        self.address = ep.address
        self.node = ep.node
        self.model = ep.model
        self.variant = ep.variant
        self.host, self.port = split_host_port(ep.address, f"endpoint of {ep.instance_id}")
        self.host_header = f"host: {ep.address}\r\n".encode("latin-1")
        self.pool = Pool(self.host, self.port, settings.max_idle_per_instance, settings.connect_timeout_s)
        self.inflight = 0
        self.requests = 0
        self.failures = 0
        self.consecutive = 0
        self.ejected_until = 0.0
        self.ejections = 0
        self.eject_reason = ""
        self.removed = False

    def json(self, now: float) -> dict[str, Any]:
        left = self.ejected_until - now
        return {
            "instance_id": self.instance_id,
            "address": self.address,
            "node": self.node,
            "model": self.model,
            "variant": self.variant,
            "inflight": self.inflight,
            "requests": self.requests,
            "failures": self.failures,
            "ejected": left > 0,
            "ejected_for_s": None if left <= 0 else (-1 if math.isinf(left) else round(left, 2)),
            "eject_reason": self.eject_reason if left > 0 else "",
            "connections_opened": self.pool.opened,
        }


class WorkloadRoutes:
    __slots__ = ("backends", "balance_factor", "canaries", "name", "policy", "prefix_chars")

    def __init__(self, name: str, policy: Policy, prefix_chars: int, balance_factor: float) -> None:
        self.name = name
        self.backends: list[Backend] = []
        self.canaries = 0  # backends of variant "canary"
        self.policy = policy
        self.prefix_chars = prefix_chars
        self.balance_factor = balance_factor


class Registry:
    """Workload name -> instances and policy; the single place routing state changes."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.workloads: dict[str, WorkloadRoutes] = {}
        self.policies: dict[str, gateway_pb2.RoutingPolicy] = {}
        self.states: dict[str, gateway_pb2.WorkloadRouteState] = {}
        self.revision = -1
        self.synced = False
        self.canary_weights: dict[str, int] = {}  # workload -> percent of requests to its canary
        self.request_endpoints: dict[str, Compiled | str] = {}  # Request-as-a-Service (endpoints.py)
        self.stats = TrafficStats()  # per (workload, version): requests, errors, latency histogram
        self.metrics = GatewayMetrics()  # Prometheus counters (gateway/metrics.py)
        self._random = random.Random().random

    # ------------------------------------------------------------------ updates
    def apply_endpoints(self, endpoints: Iterable[workload_pb2.Endpoint], revision: int = 0) -> None:
        """Make the routable set equal to `endpoints` (one control-plane snapshot)."""
        old = {b.instance_id: b for w in self.workloads.values() for b in w.backends}
        grouped: dict[str, list[Backend]] = {}
        for ep in endpoints:
            b = old.get(ep.instance_id)
            if b is None or b.address != ep.address or b.workload != ep.workload or b.variant != ep.variant:
                b = Backend(ep, self.settings)
                log.info("instance added", workload=ep.workload, instance=ep.instance_id, address=ep.address)
            else:
                b.model, b.node = ep.model, ep.node
            grouped.setdefault(ep.workload, []).append(b)
        keep = {id(b) for bs in grouped.values() for b in bs}
        for b in old.values():
            if id(b) not in keep:
                b.removed = True
                b.pool.close()
                log.info("instance removed", workload=b.workload, instance=b.instance_id, address=b.address)
        for name in list(self.workloads):
            if name not in grouped:
                self.workloads[name].backends = []
        for name, backends in grouped.items():
            wl = self._routes(name)
            wl.policy.update(backends)
            wl.backends = backends
            wl.canaries = sum(1 for b in backends if b.variant == "canary")
        self.revision = revision
        self.synced = True

    def apply_config(self, cfg: gateway_pb2.GatewayConfig) -> None:
        self.policies = {p.workload: p for p in cfg.policies}
        self.states = {s.name: s for s in cfg.workloads}
        self.canary_weights = {c.workload: c.weight_pct for c in cfg.canaries}
        self.request_endpoints = compile_all(cfg.endpoints, self.request_endpoints)
        for name, wl in self.workloads.items():
            self._set_policy(wl, self.policies.get(name))

    def _routes(self, name: str) -> WorkloadRoutes:
        wl = self.workloads.get(name)
        if wl is None:
            s = self.settings
            policy = make_policy(s.default_policy, s.balance_factor, s.prefix_chars)
            wl = WorkloadRoutes(name, policy, s.prefix_chars, s.balance_factor)
            self._set_policy(wl, self.policies.get(name))
            self.workloads[name] = wl
        return wl

    def _set_policy(self, wl: WorkloadRoutes, p: gateway_pb2.RoutingPolicy | None) -> None:
        s = self.settings
        name = p.policy if p is not None and p.policy else s.default_policy
        factor = p.balance_factor if p is not None and p.balance_factor else s.balance_factor
        chars = p.prefix_chars if p is not None and p.prefix_chars else s.prefix_chars
        if wl.policy.name == name and wl.prefix_chars == chars and wl.balance_factor == factor:
            return
        wl.policy = make_policy(name, factor, chars)
        wl.policy.update(wl.backends)
        wl.prefix_chars, wl.balance_factor = chars, factor
        log.info("routing policy", workload=wl.name, policy=name)

    # ------------------------------------------------------------------ routing
    def variant_for(self, wl: WorkloadRoutes, session: str | None) -> str | None:
        """The version ("" baseline, "canary") a request goes to, by the workload's canary weight:
        sticky per session id (a hash of it), else at random. None: the workload has no canary."""
        if not wl.canaries:
            return None
        weight = self.canary_weights.get(wl.name, 0)
        if weight <= 0 or weight >= 100:
            return "canary" if weight >= 100 else ""
        draw = (zlib.crc32(session.encode()) % 10000) / 10000 if session else self._random()
        return "canary" if draw * 100 < weight else ""

    def pick(
        self, wl: WorkloadRoutes, key: str | None, tried: Sequence[Backend], variant: str | None = None
    ) -> Backend | str:
        """An instance (of `variant`, while it has any) for the next attempt, or why there is none."""
        now = time.monotonic()
        limit = self.settings.max_inflight_per_instance
        backends = wl.backends
        if variant is not None:
            backends = [b for b in backends if b.variant == variant] or backends
        cands = [b for b in backends if b.ejected_until <= now and b.inflight < limit and b not in tried]
        if not cands:
            cands = [b for b in backends if b.inflight < limit and b not in tried]  # all ejected: try anyway
            if not cands or any(b.ejected_until <= now for b in backends if b not in tried):
                return self.unavailable(wl, tried, now)
        if len(cands) == 1:
            return cands[0]
        picked = wl.policy.pick(cands, key)
        assert isinstance(picked, Backend)
        return picked

    def unavailable(self, wl: WorkloadRoutes, tried: Sequence[Backend], now: float) -> str:
        if not wl.backends:
            return self.no_instance_reason(wl.name)
        parts = []
        limit = self.settings.max_inflight_per_instance
        for b in wl.backends:
            if b in tried:
                parts.append(f"{b.instance_id} already failed this request")
            elif b.inflight >= limit:
                parts.append(f"{b.instance_id} at its in-flight limit ({limit})")
            else:
                parts.append(f"{b.instance_id} ejected ({b.eject_reason})")
        return f"no instance of workload {wl.name!r} can take the request: " + "; ".join(parts)

    def no_instance_reason(self, name: str) -> str:
        st = self.states.get(name)
        why = f"{st.phase}: {st.reason}" if st is not None and st.reason else "no Running instance"
        if st is not None and not st.reason:
            why = f"{st.phase}, {st.ready}/{st.replicas} instances ready"
        return f"workload {name!r} has no Ready instance ({why})"

    def known(self, name: str) -> bool:
        return name in self.states or name in self.workloads

    def served(self) -> list[WorkloadRoutes]:
        return [w for w in self.workloads.values() if w.backends]

    def all_backends(self) -> list[Backend]:
        return [b for w in self.workloads.values() for b in w.backends]

    # ------------------------------------------------------------------ outcomes
    def succeeded(self, b: Backend) -> None:
        if b.consecutive:
            b.consecutive = 0
            b.ejections = 0

    def failed(self, b: Backend, kind: str, reason: str, reused: bool = True) -> None:
        b.failures += 1
        b.consecutive += 1
        threshold = 1 if kind == "reset" and not reused else _THRESHOLDS.get(kind, 2)
        now = time.monotonic()
        if b.consecutive >= threshold and not b.removed and b.ejected_until <= now:
            period = min(_MAX_EJECT_S, self.settings.eject_s * (2**b.ejections))
            b.ejections += 1
            b.ejected_until = now + period
            b.eject_reason = f"{reason}; ejected for {period:g}s"
            self.metrics.ejected(b.workload)
            log.warning(
                "instance ejected", workload=b.workload, instance=b.instance_id, reason=reason, seconds=period
            )

    def health(self, b: Backend, ok: bool, reason: str = "") -> None:
        if ok:
            if b.ejected_until > 0:
                log.info("instance healthy again", workload=b.workload, instance=b.instance_id)
            b.ejected_until = 0.0
            b.consecutive = b.ejections = 0
        elif not b.removed:
            if b.ejected_until < math.inf:
                log.warning("instance failed its health check", instance=b.instance_id, reason=reason)
            b.ejected_until = math.inf
            b.eject_reason = f"health check failed: {reason}"

    def close(self) -> None:
        for b in self.all_backends():
            b.pool.close()

    def status_json(self) -> dict[str, Any]:
        now = time.monotonic()
        return {
            name: {
                "policy": w.policy.name,
                "instances": [b.json(now) for b in w.backends],
            }
            for name, w in sorted(self.workloads.items())
        }


class HealthChecker:
    """Active health checks of every instance, every interval (off when the interval is 0)."""

    def __init__(self, registry: Registry, settings: GatewaySettings) -> None:
        self.registry = registry
        self.settings = settings

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.settings.health_check_interval_s)
            await self.check_all()

    async def check_all(self) -> None:
        backends = self.registry.all_backends()
        if backends:
            await asyncio.gather(*(self._check(b) for b in backends))

    async def _check(self, b: Backend) -> None:
        s = self.settings
        try:
            r = await fetch(b.host, b.port, "GET", s.health_check_path, timeout_s=s.health_check_timeout_s)
        except HttpError as e:
            self.registry.health(b, False, str(e))
            return
        self.registry.health(b, r.status < 500, f"{s.health_check_path} answered {r.status}")
