"""A watch-fed, in-memory copy of the Device Resource Graph, with changes routed by key prefix.

It lists the whole `/kunlun/v1/` tree once, then applies one supervised watch; after a compaction
it is rebuilt from the re-list. `wait_for_revision` lets a writer see its own commits before it
decides again (so a plan is never made from a state older than the last commit).

Cost per change does not grow with the cluster. Keys are kept in one bucket per *kind* (the first
segment under the root: `nodes/`, `telemetry/`, `instances/`, ...). A consumer either

- subscribes a `Topic` to the kinds it cares about and waits on it (only that topic's waiters
  wake, and a telemetry write wakes nobody who did not ask for telemetry), or
- registers a `Listener` for its kinds, called synchronously with each changed key so it can keep
  derived indexes current in O(1) per change (the feeds' per-node assignments, the scheduler's
  decoded state).

Applying one event costs one bucket update, one dictionary lookup of the kind's topics and
listeners, and whatever those consumers do; `work` counts it (read by the work-counting tests).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol, TypeVar

from controlplane import keys
from controlplane.store import KV, EtcdStore, Resync, WatchEvent

_IGNORED = (keys.LEADER_STATE, keys.REPLICAS)


def kind_of(key: str) -> str:
    """The kind prefix of a key: `/kunlun/v1/nodes/n1` -> `/kunlun/v1/nodes/`."""
    cut = key.find("/", len(keys.ROOT))
    return key if cut < 0 else key[: cut + 1]


@dataclass
class WorkCounters:
    """Work done by a replica's change handling, counted where it happens (not timed).

    The work-counting tests drive synthetic changes at two cluster sizes and require the same
    deltas: a change must cost the same whether the cluster has 100 nodes or 1,000.
    """

    events: int = 0
    """Watch events applied to the cache."""
    decodes: int = 0
    """Records parsed (JSON or protobuf-JSON) by the cache's consumers."""
    lookups: int = 0
    """Index lookups: routing a change to its consumers, per-node and per-workload indexes."""
    wakeups: int = 0
    """Topic notifications (each wakes that topic's waiters)."""
    sends: int = 0
    """Messages pushed to agent streams because their node's assignments changed."""
    computes: int = 0
    """Assignment sets computed for a node."""

    def snapshot(self) -> dict[str, int]:
        return dict(self.__dict__)


class Topic:
    """A change notification for the kinds (key prefixes) a consumer cares about.

    `version` grows on every matching change; `wait(seen)` returns once it is above `seen`. Every
    waiter of the topic wakes (a broadcast), and only this topic's waiters.
    """

    def __init__(self, prefixes: tuple[str, ...] = ()) -> None:
        self.prefixes = prefixes
        self.version = 0
        self._event = asyncio.Event()

    def notify(self) -> None:
        self.version += 1
        event, self._event = self._event, asyncio.Event()
        event.set()

    async def wait(self, seen: int) -> int:
        """Wait until a change after version `seen`; return the new version."""
        while self.version <= seen:
            await self._event.wait()
        return self.version


class Listener(Protocol):
    """A consumer that keeps derived state current, one changed key at a time."""

    def apply(self, key: str, kv: KV | None) -> None:
        """`key` was put (`kv`) or deleted (None); the cache already holds the new state."""

    def reset(self, kvs: Mapping[str, KV]) -> None:
        """Rebuild from the whole cache (at start and after a Resync)."""


L = TypeVar("L", bound=Listener)


class GraphCache:
    def __init__(self, store: EtcdStore | None) -> None:
        self.store = store
        self.kvs: dict[str, KV] = {}
        """Every key the cache keeps (read-only for consumers)."""
        self.revision = 0
        self.changed = asyncio.Event()
        """Set on every change (kept for simple consumers; prefer a Topic)."""
        self.ready = asyncio.Event()
        self.version = 0
        """Bumped on every change of a key the cache keeps (not on ignored keys)."""
        self.event_revision = 0
        """The revision of the change being applied (listeners read it: a delete carries no kv)."""
        self.work = WorkCounters()
        self._buckets: dict[str, dict[str, KV]] = {}
        self._topics: dict[str, list[Topic]] = {}
        self._listeners: dict[str, list[Listener]] = {}
        self._all = Topic()
        self._derived: dict[object, Listener] = {}
        self._rev_waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        self._seq = 0
        self._task: asyncio.Task[None] | None = None
        self.hold: Callable[[], Awaitable[None]] | None = None
        """Awaited before each watch event is applied (tests only: controlplane/failpoints.py)."""

    # ------------------------------------------------------------------ reading
    def prefix(self, prefix: str) -> list[KV]:
        """Every kept key under `prefix` (one kind's bucket; filtered when `prefix` is longer)."""
        kind = kind_of(prefix)
        bucket = self._buckets.get(kind, {})
        if kind == prefix:
            return list(bucket.values())
        return [kv for k, kv in bucket.items() if k.startswith(prefix)]

    def bucket(self, kind: str) -> Mapping[str, KV]:
        """The keys of one kind, by key (read-only)."""
        return self._buckets.get(kind, {})

    def get(self, key: str) -> KV | None:
        return self.kvs.get(key)

    # ------------------------------------------------------------------ routing
    def topic(self, prefixes: Iterable[str]) -> Topic:
        """A topic notified on every change under one of `prefixes` (kind prefixes or longer)."""
        t = Topic(tuple(prefixes))
        for kind in {kind_of(p) for p in t.prefixes}:
            self._topics.setdefault(kind, []).append(t)
        return t

    def drop_topic(self, topic: Topic) -> None:
        for kind in {kind_of(p) for p in topic.prefixes}:
            subs = self._topics.get(kind, [])
            if topic in subs:
                subs.remove(topic)
            if not subs:
                self._topics.pop(kind, None)

    def listen(self, kinds: Iterable[str], listener: Listener) -> None:
        """Call `listener.apply` for every change under `kinds`; `reset` now if the cache is ready."""
        for kind in kinds:
            self._listeners.setdefault(kind_of(kind), []).append(listener)
        if self.ready.is_set():
            listener.reset(self.kvs)

    def derived(self, factory: Callable[[GraphCache], L]) -> L:
        """The one instance of a derived view of this cache (created on first use)."""
        view = self._derived.get(factory)
        if view is None:
            view = factory(self)
            self._derived[factory] = view
        return view  # type: ignore[return-value]

    # ------------------------------------------------------------------ applying changes
    def load(self, kvs: Iterable[KV], revision: int) -> None:
        """Replace the whole content (initial list, or a Resync)."""
        self.kvs = {kv.key: kv for kv in kvs if not kv.key.startswith(_IGNORED)}
        self._buckets = {}
        for k, kv in self.kvs.items():
            self._buckets.setdefault(kind_of(k), {})[k] = kv
        self.version += 1
        self.event_revision = revision
        self.changed.set()
        self.ready.set()
        for listener in {id(x): x for subs in self._listeners.values() for x in subs}.values():
            listener.reset(self.kvs)
        for subs in list(self._topics.values()):
            for t in subs:
                t.notify()
        self._all.notify()
        self._advance(revision)

    def apply(self, ev: WatchEvent) -> None:
        """Apply one watch event: O(1) plus what the kind's consumers do."""
        self.work.events += 1
        key = ev.kv.key
        if not key.startswith(_IGNORED):
            kind = kind_of(key)
            bucket = self._buckets.setdefault(kind, {})
            if ev.kind == "put":
                self.kvs[key] = ev.kv
                bucket[key] = ev.kv
                kv: KV | None = ev.kv
            else:
                self.kvs.pop(key, None)
                bucket.pop(key, None)
                kv = None
            self.version += 1
            self.event_revision = ev.kv.mod_revision
            self.changed.set()
            self.work.lookups += 1
            for listener in self._listeners.get(kind, ()):
                listener.apply(key, kv)
            for t in self._topics.get(kind, ()):
                if any(key.startswith(p) for p in t.prefixes):
                    self.work.wakeups += 1
                    t.notify()
            self._all.notify()
        self._advance(ev.kv.mod_revision)

    def _advance(self, revision: int) -> None:
        if revision <= self.revision:
            return
        self.revision = revision
        while self._rev_waiters and self._rev_waiters[0][0] <= revision:
            _, _, fut = heapq.heappop(self._rev_waiters)
            if not fut.done():
                fut.set_result(None)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        assert self.store is not None, "a cache without a store is fed by load() and apply()"
        kvs, rev = await self.store.get_prefix(keys.ROOT)
        self.load(kvs, rev)
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
        assert self.store is not None
        async for ev in self.store.watch_prefix(keys.ROOT, start):
            if self.hold is not None:
                await self.hold()
            if isinstance(ev, Resync):
                self.load(ev.kvs, ev.revision)
            else:
                self.apply(ev)

    # ------------------------------------------------------------------ waiting
    async def wait_version(self, seen: int) -> int:
        """Wait until the cache changed after version `seen` (any key); return the new version.

        Wakes on every change: consumers that care about some kinds only should use a `topic`."""
        while self.version <= seen:
            await self._all.wait(self._all.version)
        return self.version

    async def wait_for_revision(self, revision: int, within_s: float = 10.0) -> bool:
        """Wait until the cache has applied `revision`; False on timeout."""
        if self.revision >= revision:
            return True
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._seq += 1
        heapq.heappush(self._rev_waiters, (revision, self._seq, fut))
        try:
            async with asyncio.timeout(within_s):
                await fut
            return True
        except TimeoutError:
            return False
        finally:
            if not fut.done():
                fut.cancel()
