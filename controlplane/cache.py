"""A watch-fed, in-memory copy of the Device Resource Graph for the leader's loops.

It lists the whole `/kunlun/v1/` tree once, then applies one supervised watch; after a compaction
it is rebuilt from the re-list. `wait_for_revision` lets a writer see its own commits before it
decides again (so a plan is never made from a state older than the last commit).
"""

from __future__ import annotations

import asyncio
import contextlib

from controlplane import keys
from controlplane.store import KV, EtcdStore, Resync

_IGNORED = (keys.LEADER_STATE, keys.REPLICAS)


class GraphCache:
    def __init__(self, store: EtcdStore) -> None:
        self.store = store
        self.kvs: dict[str, KV] = {}
        self.revision = 0
        self.changed = asyncio.Event()
        self._rev_cond = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None
        self.ready = asyncio.Event()
        self.version = 0
        """Bumped on every change of a key the cache keeps (not on ignored keys)."""

    def prefix(self, prefix: str) -> list[KV]:
        return [kv for k, kv in self.kvs.items() if k.startswith(prefix)]

    def get(self, key: str) -> KV | None:
        return self.kvs.get(key)

    async def start(self) -> None:
        kvs, rev = await self.store.get_prefix(keys.ROOT)
        self.kvs = {kv.key: kv for kv in kvs if not kv.key.startswith(_IGNORED)}
        self.revision = rev
        self.ready.set()
        self.changed.set()
        self._task = asyncio.create_task(self._follow(rev + 1), name="graph-cache")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            # bounded: a leader stepping down must never hang on its cache
            await asyncio.wait({self._task}, timeout=5.0)
            if self._task.done() and not self._task.cancelled():
                with contextlib.suppress(Exception):
                    self._task.result()

    async def _follow(self, start: int) -> None:
        async for ev in self.store.watch_prefix(keys.ROOT, start):
            if isinstance(ev, Resync):
                self.kvs = {kv.key: kv for kv in ev.kvs if not kv.key.startswith(_IGNORED)}
                rev = ev.revision
                self.version += 1
                self.changed.set()
            else:
                rev = ev.kv.mod_revision
                if not ev.kv.key.startswith(_IGNORED):
                    if ev.kind == "put":
                        self.kvs[ev.kv.key] = ev.kv
                    else:
                        self.kvs.pop(ev.kv.key, None)
                    self.changed.set()
                    self.version += 1
            if rev > self.revision:
                self.revision = rev
                async with self._rev_cond:
                    self._rev_cond.notify_all()

    async def wait_version(self, seen: int) -> int:
        """Wait until the cache changed after version `seen`; return the new version."""
        async with self._rev_cond:
            await self._rev_cond.wait_for(lambda: self.version > seen)
        return self.version

    async def wait_for_revision(self, revision: int, within_s: float = 10.0) -> bool:
        """Wait until the cache has applied `revision`; False on timeout."""
        try:
            async with asyncio.timeout(within_s):
                async with self._rev_cond:
                    await self._rev_cond.wait_for(lambda: self.revision >= revision)
            return True
        except TimeoutError:
            return False
