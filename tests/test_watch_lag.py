"""A replica's watch lag: its heartbeat write timed until its own watch-fed cache delivers it, on a
real etcd; a stalled watch shows as a growing lag (not as the last good value); the exported figure
on a live cluster is in tests/test_telemetry_cluster.py."""

from __future__ import annotations

import asyncio
import time

from controlplane import keys
from controlplane.cache import GraphCache
from controlplane.store import EtcdStore
from controlplane.watch_lag import WatchLag


async def _until(predicate: object, within_s: float, what: str) -> None:
    assert callable(predicate)
    end = time.monotonic() + within_s
    while not predicate():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def test_heartbeat_timed_through_the_watch_and_a_stalled_watch_grows(store: EtcdStore) -> None:
    cache = GraphCache(store)
    lag = WatchLag(store, cache, "lag-test", interval_s=0.05)
    other = WatchLag(store, cache, "lag-other", interval_s=0.05)
    await cache.start()
    lease = await store.lease_grant(10)
    try:
        assert lag.lag_s() is None  # nothing measured yet
        await lag.beat(lease)
        await other.beat(lease)  # another replica's heartbeat times nothing of ours
        await _until(lambda: lag.seen == 1 and other.seen == 1, 20, "both heartbeats through the watch")
        first = lag.lag_s()
        assert first is not None and 0.0 <= first < 5.0
        kv = await store.get(keys.watch_heartbeat("lag-test"))
        assert kv is not None and kv.lease == lease  # gone with the replica
        for _ in range(3):
            await lag.beat(lease)
        await _until(lambda: lag.seen == 4, 20, "three more heartbeats")
        # the watch stops (a stuck stream): the unseen heartbeat's age is the lag, and it grows
        await cache.stop()
        await lag.beat(lease)
        t0 = time.monotonic()
        await asyncio.sleep(0.5)
        stalled = lag.lag_s()
        assert stalled is not None and stalled >= 0.5 and stalled >= time.monotonic() - t0 - 0.05
        await asyncio.sleep(0.2)
        assert (lag.lag_s() or 0) >= stalled + 0.2 - 0.01
        assert lag.seen == 4
    finally:
        await cache.stop()
        await store.lease_revoke(lease)
    assert await store.get(keys.watch_heartbeat("lag-test")) is None
