"""Interop: keep an external sglang-router's workers equal to the gateway's instances.

With `sglang_router_url` set, the gateway owns that router's worker list: after every endpoint
snapshot (and every 10 s) it reads `GET /workers`, adds each missing instance with
`POST /workers {"url": "http://<address>", "model_id": <workload>}` and removes each worker that is
not one of ours with `DELETE /workers/{id}`. `sglang_router_workload` limits the mirror to one
workload (the router then serves only it; without it, run the router with per-model routing).
The router checks a new worker's health before it lists it, so an add is not repeated for 30 s.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any
from urllib.parse import urlparse

import structlog

from gateway.backends import Registry
from gateway.httpclient import HttpError, fetch
from kunlun_common.errors import ConfigError

log = structlog.get_logger("gateway.routersync")
_JSON = {"content-type": "application/json"}


class RouterSync:
    def __init__(self, url: str, registry: Registry, workload: str = "", period_s: float = 10.0) -> None:
        u = urlparse(url)
        if u.scheme != "http" or not u.hostname or not u.port:
            raise ConfigError(f"sglang_router_url: expected http://HOST:PORT, found {url!r}")
        self.host, self.port = u.hostname, u.port
        self.registry = registry
        self.workload = workload
        self.period_s = period_s
        self._kick = asyncio.Event()
        self._adding: dict[str, float] = {}
        self.syncs = 0
        self.workers = 0
        self.last_error = ""

    def kick(self) -> None:
        self._kick.set()

    def status(self) -> dict[str, Any]:
        return {
            "router": f"http://{self.host}:{self.port}",
            "syncs": self.syncs,
            "workers": self.workers,
            "last_error": self.last_error,
        }

    async def run(self) -> None:
        first = True
        while True:
            if not first:
                try:
                    await asyncio.wait_for(self._kick.wait(), self.period_s)
                except TimeoutError:
                    pass
            first = False
            self._kick.clear()
            try:
                await self.sync_once()
                self.last_error = ""
            except (HttpError, ValueError, KeyError, TypeError) as e:
                if str(e) != self.last_error:
                    log.warning("sglang-router sync failed", router=f"{self.host}:{self.port}", error=str(e))
                self.last_error = str(e)

    def wanted(self) -> dict[str, str]:
        return {
            f"http://{b.address}": b.workload
            for b in self.registry.all_backends()
            if not self.workload or b.workload == self.workload
        }

    async def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        r = await fetch(self.host, self.port, method, path, data, _JSON if data else None, timeout_s=5.0)
        if r.status >= 300:
            raise HttpError(f"{method} {path} answered {r.status}: {r.body[:200]!r}")
        return r.json() if r.body else None

    async def sync_once(self) -> None:
        want = self.wanted()
        listed = await self._call("GET", "/workers")
        have = {str(w["url"]): str(w["id"]) for w in listed.get("workers", [])}
        now = time.monotonic()
        self._adding = {u: t for u, t in self._adding.items() if now - t < 30 and u not in have}
        for url, workload in sorted(want.items()):
            if url not in have and url not in self._adding:
                await self._call("POST", "/workers", {"url": url, "model_id": workload})
                self._adding[url] = now
                log.info("sglang-router worker added", url=url, workload=workload)
        for url, wid in sorted(have.items()):
            if url not in want:
                await self._call("DELETE", f"/workers/{wid}")
                log.info("sglang-router worker removed", url=url)
        self.workers = len(want)
        self.syncs += 1
