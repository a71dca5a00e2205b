"""The skeleton every leader-only loop shares (the scheduler, the rollout loop).

A loop keeps its own watch-fed `GraphCache`, wakes on changes under the key prefixes it cares
about (or after `idle_s` without one, so time-based decisions still run), lets a burst of changes
land (`debounce_s`), runs one tick, and, when the tick committed, waits until its cache has seen
that revision, so the next tick never decides from a snapshot older than its own last write. It
ends when the leadership term's fence is lost; the cache is stopped whatever happens. A tick's
exceptions are the caller's: the replica restarts a failed leader loop (and logs it).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence

import structlog

from controlplane.cache import GraphCache
from controlplane.election import Fence
from controlplane.store import EtcdStore

log = structlog.get_logger("leader-loop")

Tick = Callable[[Fence, GraphCache], Awaitable[int | None]]
"""One tick: decide from the cache and commit through the fence; returns the committed revision
(or 0/None when nothing was written)."""


async def run_leader_loop(
    name: str,
    store: EtcdStore,
    fence: Fence,
    prefixes: Sequence[str],
    tick: Tick,
    *,
    debounce_s: float = 0.0,
    idle_s: float = 1.0,
) -> None:
    """Tick on every change under `prefixes` (and at least every `idle_s`) until `fence` is lost."""
    cache = GraphCache(store)
    await cache.start()
    log.info(f"{name} started", epoch=fence.epoch, revision=cache.revision, keys=len(cache.kvs))
    try:
        wake, seen = cache.topic(tuple(prefixes)), -1
        while not fence.lost.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(idle_s):
                    seen = await wake.wait(seen)
                    if debounce_s:
                        await asyncio.sleep(debounce_s)  # one tick for a burst of changes
            seen = wake.version  # what lands from here on wakes the next round
            rev = await tick(fence, cache)
            if rev and not await cache.wait_for_revision(rev):
                log.warning(f"{name}: graph cache did not catch up with our commit", revision=rev)
    finally:
        await cache.stop()
