"""How far behind etcd a replica's watch-fed cache runs (`kunlun_replica_watch_lag_seconds`).

etcd events carry no commit time, so each replica times a write of its own: every `interval_s` it
rewrites its heartbeat key `watch-heartbeats/<replica>` (bound to the replica's lease) with a
sequence number, noting the monotonic time just before sending it, and its cache's listener notes
when the watch delivers that sequence. The lag is the time between the two: the write's commit plus
the watch's delivery, on one clock (no skew between hosts), so an upper bound of the watch's own
delay. While a heartbeat is written but not yet seen, the figure is at least its age, so a stalled
watch shows as a growing lag rather than as the last good value.

The cost: one small put per replica every `interval_s` (5 s by default) and one decode per
heartbeat of this replica; other replicas' heartbeats are ignored by key.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping

import structlog

from controlplane import keys
from controlplane.cache import GraphCache
from controlplane.store import KV, EtcdStore
from kunlun_common.clock import now_ms
from kunlun_common.errors import KunlunError

log = structlog.get_logger("watch-lag")

MAX_PENDING = 16
"""Heartbeats remembered while unseen (older ones are dropped: their age already shows)."""


class WatchLag:
    """The replica's heartbeat writer and the cache listener that times it."""

    def __init__(
        self,
        store: EtcdStore | None,
        cache: GraphCache,
        replica: str,
        interval_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.key = keys.watch_heartbeat(replica)
        self.interval_s = interval_s
        self.clock = clock
        self.last_s: float | None = None
        """The lag of the last heartbeat seen (None before the first)."""
        self.seen = 0
        """Heartbeats of this replica its watch delivered."""
        self._seq = 0
        self._sent: dict[int, float] = {}
        cache.listen((keys.WATCH_HEARTBEATS,), self)

    # ------------------------------------------------------------------ the figure
    def lag_s(self) -> float | None:
        """The current lag: the last measured, or the age of the oldest unseen heartbeat if larger."""
        oldest = min(self._sent.values(), default=None)
        if oldest is None:
            return self.last_s
        age = self.clock() - oldest
        return age if self.last_s is None or age > self.last_s else self.last_s

    # ------------------------------------------------------------------ cache listener
    def apply(self, key: str, kv: KV | None) -> None:
        if key != self.key or kv is None:
            return
        try:
            seq = int(keys.decode(kv.value).get("seq", 0))
        except (ValueError, TypeError):
            return
        sent = self._sent.pop(seq, None)
        if sent is None:
            return  # written by an earlier run of this replica, or already timed out
        self.last_s = max(0.0, self.clock() - sent)
        self.seen += 1
        for old in [s for s in self._sent if s < seq]:  # superseded: etcd delivers in order
            del self._sent[old]

    def reset(self, kvs: Mapping[str, KV]) -> None:
        """A re-list after compaction: events in between were not delivered one by one."""

    # ------------------------------------------------------------------ writer
    async def beat(self, lease: int) -> None:
        """Write one heartbeat (noting when it was sent)."""
        assert self.store is not None
        self._seq += 1
        seq = self._seq
        self._sent[seq] = self.clock()
        while len(self._sent) > MAX_PENDING:
            del self._sent[min(self._sent)]
        try:
            await self.store.put(self.key, keys.encode({"seq": seq, "at_ms": now_ms()}), lease)
        except KunlunError:
            self._sent.pop(seq, None)  # not written: says nothing about the watch
            raise

    async def run(self, lease: Callable[[], int]) -> None:
        """Beat every `interval_s` with the replica's current lease."""
        while True:
            try:
                await self.beat(lease())
            except KunlunError as e:
                log.warning("watch heartbeat not written", error=str(e)[:200])
            await asyncio.sleep(self.interval_s)
