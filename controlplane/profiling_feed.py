"""The run-time profiling switch as this replica's cache sees it (the scheduler settings'
`advanced_profiling` and `profiling_interval_ms`), for the replica's own profiler and for what it
pushes to agents (on their streams) and gateways (in their config).

Decoded once per change of the settings key (memoised on its revision), whoever asks how often.
"""

from __future__ import annotations

import asyncio

import structlog

from controlplane import keys
from controlplane.cache import GraphCache
from controlplane.scheduler.config import SchedulerConfig, parse_scheduler_config
from kunlun_common.api import types_pb2
from kunlun_common.profiling import Profiler, ProfilingMode

log = structlog.get_logger("profiling")


class ProfilingFeed:
    def __init__(self, cache: GraphCache) -> None:
        self.cache = cache
        self.topic = cache.topic((keys.SCHEDULER_CONFIG,))
        """Notified on every change of the scheduler settings."""
        self._memo: tuple[int, types_pb2.ProfilingSettings] = (-1, self._of(SchedulerConfig()))

    @staticmethod
    def _of(cfg: SchedulerConfig) -> types_pb2.ProfilingSettings:
        return types_pb2.ProfilingSettings(
            enabled=cfg.advanced_profiling, interval_ms=cfg.profiling_interval_ms
        )

    def current(self) -> types_pb2.ProfilingSettings:
        """The switch as stored (off when no settings are stored or they cannot be read)."""
        kv = self.cache.get(keys.SCHEDULER_CONFIG)
        rev = kv.mod_revision if kv is not None else 0
        if self._memo[0] != rev:
            cfg = SchedulerConfig()
            if kv is not None:
                try:
                    cfg = parse_scheduler_config(str(keys.decode(kv.value)["yaml"]))
                except Exception as e:  # validated when stored; never crash on it
                    log.warning("stored scheduler config unreadable; profiling stays off", error=str(e)[:200])
            self._memo = (rev, self._of(cfg))
        out = types_pb2.ProfilingSettings()
        out.CopyFrom(self._memo[1])
        return out

    async def drive(self, profiler: Profiler) -> None:
        """Keep this process's profiler switched as the settings say (a replica task)."""
        await self.cache.ready.wait()
        while True:
            seen = self.topic.version
            p = self.current()
            profiler.apply(ProfilingMode(p.enabled, p.interval_ms))
            await self.topic.wait(seen)


async def close_profiler(profiler: Profiler) -> None:
    """End the profiler's session (writes its last events) without blocking the event loop."""
    await asyncio.to_thread(profiler.close)
