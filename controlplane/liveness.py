"""Node liveness on one replica: its liveness lease and the `alive/<node>` keys bound to it.

One lease per replica, not one per node. Every `alive/<node>` key this replica writes is bound to
its *liveness lease*, which it refreshes once a `refresh_period_s` whatever the number of agents (a
lease per node cost a keep-alive round trip per node every 2 s: a third of a replica's CPU per
heartbeat). A node whose heartbeats stop is marked dead by an explicit delete that compares the
value this replica wrote (so a node that moved to another replica is never touched),
`stale_after_s` after its last heartbeat; a replica that dies or is cut off from etcd loses its
lease and every alive key with it. Timing (see `controlplane/fencing.py`): an ack is sent only
while the lease was confirmed within `heartbeat_ack_requires_etcd_s`, and the lease's TTL is the
node lease TTL plus that window, so a node's alive key outlives the last ack it got by at least
`node_lease_ttl_s` on both paths (explicit delete: the node lease after the last heartbeat once the
stream ended, 1.5 x it while a silent stream stays open).

Ownership: a replica acks a node only while the node's alive key is the one it wrote. It watches
the keys (`AliveKeys`, fed by the replica's cache): a write or delete by anyone else after its own
write withholds the node's acks; it writes the key again only where the key is gone or still holds
its session's last write, so a stale stream never takes back a key a newer stream holds.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

import structlog

from controlplane import keys
from controlplane.node_session import NodeSession
from controlplane.settings import ReplicaSettings
from controlplane.store import KV, Compare, DeleteOp, EtcdStore, PutOp
from controlplane.store.keepalive_thread import KeepAliveThread
from kunlun_common.clock import now_ms
from kunlun_common.errors import KunlunError, TemporaryError

if TYPE_CHECKING:
    from controlplane.cache import GraphCache

log = structlog.get_logger("nodes")


def liveness_lease_ttl_s(settings: ReplicaSettings) -> int:
    """TTL of the replica's liveness lease: the node lease plus the ack window, so that an alive key
    outlives the last ack sent under it by at least `node_lease_ttl_s` (an ack needs the lease
    confirmed within the window)."""
    return settings.node_lease_ttl_s + math.ceil(settings.heartbeat_ack_requires_etcd_s)


def refresh_period_s(settings: ReplicaSettings) -> float:
    """How often the replica's liveness lease is refreshed: a third of the heartbeat ack window (so a
    refresh that needs a retry on another etcd member still lands inside the window), at most a
    third of the lease."""
    return min(liveness_lease_ttl_s(settings) / 3, settings.heartbeat_ack_requires_etcd_s / 3)


def stale_after_s(settings: ReplicaSettings, connected: bool) -> float:
    """A node not heard for this long has its alive key deleted (it turns NotReady), as when each
    node had its own lease: the node lease after the last heartbeat once its stream ended (the lease
    was no longer refreshed), 1.5 x the node lease while its stream stays open (a frozen agent: the
    lease was refreshed while the node was heard within half of it)."""
    return settings.node_lease_ttl_s * (1.5 if connected else 1.0)


class AliveKeys:
    """Feeds `alive/` changes seen by the replica's cache to its node sessions (`alive_changed`)."""

    def __init__(self, sessions: Liveness, cache: GraphCache) -> None:
        self.sessions, self.cache = sessions, cache

    def apply(self, key: str, kv: KV | None) -> None:
        self.sessions.alive_changed(key[len(keys.ALIVE) :], kv, self.cache.event_revision)

    def reset(self, kvs: Mapping[str, KV]) -> None:
        for node in list(self.sessions.sessions):
            self.sessions.alive_changed(node, kvs.get(keys.alive(node)), self.cache.event_revision)


class Liveness:
    """The liveness lease and alive keys of the nodes connected to this replica (`NodeSessions`
    adds registration, heartbeats and state writes)."""

    def __init__(self, store: EtcdStore, settings: ReplicaSettings) -> None:
        self.store = store
        self.settings = settings
        self.sessions: dict[str, NodeSession] = {}
        self.lease = 0
        """This replica's liveness lease (0: none yet, or lost and not yet granted again)."""
        self.lease_ok_at = 0.0
        """When etcd last confirmed the liveness lease (monotonic)."""
        self._lease_lock = asyncio.Lock()
        self.departed: dict[str, NodeSession] = {}
        """Sessions whose stream ended while their alive key (ours) still stands: deleted when stale."""
        self.keepalives = 0
        """Keep-alives of the liveness lease sent (benchmarks and tests)."""
        self._sweep: list[tuple[str, bytes]] = []  # stale alive keys to delete: (node, value we wrote)
        self._writes = itertools.count(1)
        self._registering: set[str] = set()
        self._lost_task: asyncio.Task[None] | None = None
        self.keeper: KeepAliveThread | None = None
        """The thread that refreshes the liveness lease (once the loop started it)."""
        self._orphans: dict[str, int] = {}  # alive keys on our lease with no session: node -> mod revision
        self.orphans_deleted = 0
        """Alive keys on this replica's lease that no session of it accounted for, deleted (tests)."""
        self.foreign_writes = 0
        """Times a session of ours found its node's alive key written by another stream (tests)."""
        self._alive_seen: dict[str, tuple[int, bytes | None]] = {}
        """The last `alive/` change the cache saw per node: (revision, value or None if deleted)."""

    async def current_lease(self) -> int:
        """The liveness lease, granted first if there is none."""
        if self.lease:
            return self.lease
        async with self._lease_lock:
            if not self.lease:
                asked = time.monotonic()  # the lease lives its TTL from some time after this
                self.lease = await self.store.lease_grant(liveness_lease_ttl_s(self.settings))
                self.lease_ok_at = asked
                log.info(
                    "liveness lease granted",
                    lease=f"{self.lease:x}",
                    ttl_s=liveness_lease_ttl_s(self.settings),
                )
            return self.lease

    def _alive_value(self, lease: int) -> bytes:
        """Unique per write (`write`): a delete that compares it never removes a newer write."""
        return keys.encode(
            {"replica": self.settings.name, "lease": lease, "since_ms": now_ms(), "write": next(self._writes)}
        )

    async def _mark_alive(self, session: NodeSession) -> None:
        """Write the node's alive key under the current lease, only where no other stream took it
        over: the key is gone (our lease was lost, or we deleted it as stale) or still holds this
        session's own last write. A key written by anyone else since belongs to a newer stream of
        the agent (it left this one): a replica resumed after a freeze, working through heartbeats
        that waited in its socket, must never take it back; this stream then gets no ack."""
        lease = self.lease
        if self.sessions.get(session.node) is not session:
            return
        key, value = keys.alive(session.node), self._alive_value(lease)
        try:
            res = await self.store.txn([Compare.absent(key)], [PutOp(key, value, lease)])
            if not res.succeeded and session.alive_value:
                res = await self.store.txn(
                    [Compare(key, "value", "==", session.alive_value)], [PutOp(key, value, lease)]
                )
        except KunlunError as e:
            log.warning("could not mark the node alive", node=session.node, error=str(e))
            return
        if not res.succeeded:
            self.foreign_writes += 1
            if not session.foreign_logged:
                session.foreign_logged = True
                log.warning(
                    "node's alive key was written by another stream since; this one gets no ack",
                    node=session.node,
                )
            return
        if self.sessions.get(session.node) is session and self._claimable(session.node, value, res.revision):
            session.lease, session.alive_value, session.alive_rev = lease, value, res.revision
            session.foreign_logged = False
            log.info("node marked alive again", node=session.node, lease=f"{lease:x}")

    def alive_changed(self, node: str, kv: KV | None, revision: int) -> None:
        """The cache saw `alive/<node>` written (`kv`) or deleted (None) at `revision`. A connected
        node whose key someone else wrote or deleted after our last write is no longer vouched for
        by our key: its acks stop at once, and its next heartbeat marks it alive again only if the
        key is free (`_mark_alive`). So a late write by another replica (a registration, or a
        stale stream's write that overtook ours) never leaves this replica acking a node whose key
        another replica's lease holds, and then deletes."""
        self._alive_seen[node] = (revision, None if kv is None else kv.value)
        s = self.sessions.get(node)
        if s is None or not s.lease or revision <= s.alive_rev or node in self._registering:
            return
        if (kv is not None and kv.value == s.alive_value) or (s.marking is not None and not s.marking.done()):
            return  # ours, or our own write in flight (`_claimable` judges it when it returns)
        s.lease = 0
        self.foreign_writes += 1
        log.warning(
            "node's alive key changed by another writer; acks withheld until it is ours again",
            node=node,
            deleted=kv is None,
            revision=revision,
        )

    def _claimable(self, node: str, value: bytes, revision: int) -> bool:
        """Our write of `value` at `revision` still stands as far as the cache has seen (no newer
        write or delete by anyone else arrived while we waited for etcd's answer)."""
        seen = self._alive_seen.get(node)
        return seen is None or seen[0] <= revision or seen[1] == value

    async def refresh_leases(self) -> None:
        """Loop: refresh this replica's liveness lease every `refresh_period_s` (one keep-alive,
        whatever the number of agents), grant a new one when it was lost (each node is marked alive
        again by its next heartbeat), delete the alive keys of nodes not heard for `stale_after_s`
        (connected or departed) and, every 2 x the node lease, orphaned keys on our lease.

        The keep-alives are sent by a thread of their own over a blocking channel of their own
        (`controlplane/store/keepalive_thread.py`), so a busy event loop cannot delay them; this loop
        beats its watchdog every tick (a loop wedged for the node lease lets the lease expire). If
        that thread cannot run, the loop sends them itself, pipelined: one every period even while
        earlier ones wait for their answer. Either way the lease counts as confirmed at the time
        the answered keep-alive was *sent* (etcd refreshed it after that, so it lives at least its
        TTL from then). Never dies: each failure is logged and retried."""
        period = refresh_period_s(self.settings)
        scan_every = max(1, round(2 * self.settings.node_lease_ttl_s / period))
        inflight: set[asyncio.Task[None]] = set()
        loop = asyncio.get_running_loop()

        def answered(lease: int, ttl: int, sent: float) -> None:  # in the keep-alive thread
            if ttl > 0:
                self.keepalives += 1
                if self.lease == lease and sent > self.lease_ok_at:
                    self.lease_ok_at = sent
            else:
                loop.call_soon_threadsafe(self._lost_soon, lease)

        keeper: KeepAliveThread | None = None
        try:
            for tick in itertools.count():
                t0 = time.monotonic()
                try:
                    if not self.lease:
                        await self.current_lease()
                    if keeper is None and self.lease:  # the store is connected: it has its certificate
                        keeper = KeepAliveThread(
                            self.store,
                            lambda: self.lease,
                            answered,
                            period,
                            self.settings.heartbeat_ack_requires_etcd_s,
                            self.settings.node_lease_ttl_s,
                        )
                        keeper.start()
                        self.keeper = keeper
                    threaded = keeper is not None and keeper.alive()
                    if keeper is not None and threaded:
                        keeper.beat()
                    # the loop refreshes too when the thread is gone or gets no answer for 2 periods
                    stale = time.monotonic() - self.lease_ok_at > 2 * period
                    if self.lease and len(inflight) < 3 and (not threaded or stale):
                        task = asyncio.create_task(self._refresh_once(self.lease, t0), name="liveness-lease")
                        inflight.add(task)
                        task.add_done_callback(inflight.discard)
                    await self._delete_stale(time.monotonic())
                    if tick % scan_every == scan_every - 1:
                        await self._delete_orphans()
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # the loop outlives any one failure
                    log.warning("liveness lease tick failed", error=str(e))
                await asyncio.sleep(max(0.05, period - (time.monotonic() - t0)))
        finally:
            for task in list(inflight):
                task.cancel()
            await asyncio.gather(*inflight, return_exceptions=True)
            if keeper is not None:
                await asyncio.to_thread(keeper.stop)

    def _lost_soon(self, lease: int) -> None:
        if self.lease == lease:
            self._lost_task = asyncio.create_task(self._lost(lease), name="liveness-lease-lost")

    async def _lost(self, lease: int) -> None:
        """The liveness lease is gone (expired while this replica could not refresh it): every alive
        key of ours went with it; grant a new one (each node's next heartbeat writes its key)."""
        log.warning("liveness lease had expired; granting a new one", lease=f"{lease:x}")
        async with self._lease_lock:
            if self.lease == lease:
                self.lease = 0
        try:
            await self.current_lease()
        except KunlunError as e:
            log.warning("could not grant a new liveness lease; retrying next tick", error=str(e))

    async def _refresh_once(self, lease: int, sent_at: float) -> None:
        try:
            # an answer later than the ack window confirms nothing the acks could still use
            ttl = await self.store.lease_keepalive(
                lease, timeout_s=self.settings.heartbeat_ack_requires_etcd_s
            )
        except TemporaryError as e:
            log.warning("liveness lease refresh failed", lease=f"{lease:x}", error=str(e))
            return
        self.keepalives += 1
        if ttl > 0:
            if self.lease == lease:
                self.lease_ok_at = max(self.lease_ok_at, sent_at)
            return
        await self._lost(lease)

    async def _delete_stale(self, now: float) -> None:
        """Delete the alive key of every node of ours not heard for `stale_after_s`, connected or
        departed, if it still holds the value we wrote (a node that moved to another replica, or
        re-registered here meanwhile, has a newer value and keeps it). Acks stop before the delete
        is sent; a failed delete is retried next tick."""
        connected, departed = stale_after_s(self.settings, True), stale_after_s(self.settings, False)
        for s in [
            *(s for s in self.sessions.values() if s.lease and now - s.last_heartbeat > connected),
            *(s for s in self.departed.values() if s.lease and now - s.last_heartbeat > departed),
        ]:
            if s.lease == self.lease:  # (a key under an older lease went with that lease)
                self._sweep.append((s.node, s.alive_value))
                log.info(
                    "node not heard; deleting its alive key",
                    node=s.node,
                    silent_s=round(now - s.last_heartbeat, 1),
                )
            s.lease = 0  # no ack under a key being deleted: the next heartbeat writes a new one
            if self.departed.get(s.node) is s:
                del self.departed[s.node]
        pending, self._sweep = self._sweep, []
        for node, value in pending:
            try:
                res = await self.store.txn(
                    [Compare(keys.alive(node), "value", "==", value)], [DeleteOp(keys.alive(node))]
                )
            except KunlunError as e:
                log.warning("could not delete a stale alive key; retrying", node=node, error=str(e))
                self._sweep.append((node, value))
                continue
            if not res.succeeded:
                log.info("stale alive key already replaced or gone; left as it is", node=node)

    async def _delete_orphans(self) -> None:
        """Delete the alive keys bound to our lease that no session of ours accounts for, once seen
        unchanged by two scans (2 x the node lease apart). A replica of an earlier version that
        took over our lease for a node (it adopted the lease of the key it found) leaves such a
        key behind when the node dies: our lease keeps it alive and our sweep, comparing the value
        we wrote, never deletes it. Compared on the key's mod revision, so a newer write stays."""
        lease = self.lease
        if not lease:
            return
        kvs, _ = await self.store.get_prefix(keys.ALIVE)
        seen, self._orphans = self._orphans, {}
        for kv in kvs:
            node = kv.key[len(keys.ALIVE) :]
            holder = self.sessions.get(node) or self.departed.get(node)
            if (
                kv.lease != lease
                or (holder is not None and holder.alive_value == kv.value)
                or node in self._registering
            ):
                continue
            if seen.get(node) != kv.mod_revision:
                self._orphans[node] = kv.mod_revision  # the next scan decides
                continue
            try:
                res = await self.store.txn(
                    [Compare(kv.key, "mod", "==", kv.mod_revision)], [DeleteOp(kv.key)]
                )
            except KunlunError as e:
                log.warning("could not delete an orphaned alive key", node=node, error=str(e))
                self._orphans[node] = kv.mod_revision
                continue
            if res.succeeded:
                self.orphans_deleted += 1
                log.warning("alive key on our lease with no session of ours; deleted", node=node)
