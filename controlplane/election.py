"""Leader election through etcd (a lease plus a transaction on the leader key) and fencing.

The leader's *epoch* is the create revision of the leader key it wrote. Every write made on
behalf of leadership goes through `Fence.txn`, which adds `create_revision(leader key) == epoch`
to the transaction: a deposed, paused or partitioned leader can never commit, because once its
lease expired the key is gone or belongs to another replica with another create revision.

Timing follows Kubernetes' leader election: ttl (lease duration) > renew deadline > 1.2 x retry
period. The leader renews every retry period; if it cannot renew for `renew_deadline_s` it steps
down on its own, before the lease can expire under it. Each leader tick first makes a fenced
write (the leader-state record), so a leader that wakes from a pause learns it was deposed from
etcd's refusal before it does anything else.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import structlog

from controlplane import keys
from controlplane.store import Compare, EtcdStore, GetOp, Op, PutOp, Resync, TxnResult
from kunlun_common.clock import now_ms
from kunlun_common.errors import ConfigError, KunlunError, TemporaryError
from kunlun_common.messages import msg

log = structlog.get_logger("election")


@dataclass(frozen=True)
class ElectionSettings:
    """Leader election timing (same validation rule as Kubernetes' leader election)."""

    ttl_s: int = 5
    """Lease duration in whole seconds: how long a dead leader keeps the role at most."""
    renew_deadline_s: float = 3.0
    """A leader that could not renew for this long steps down (must be < ttl_s)."""
    retry_period_s: float = 1.0
    """How often the leader renews and followers look for a vacant role (renew deadline > 1.2x this)."""

    def __post_init__(self) -> None:
        if self.ttl_s < 2:
            raise ConfigError(
                msg("election.ttl", "election ttl_s must be at least 2 seconds, found {ttl}", ttl=self.ttl_s)
            )
        if not self.ttl_s > self.renew_deadline_s:
            raise ConfigError(
                msg(
                    "election.ttl_deadline",
                    "election ttl_s ({ttl}) must be greater than renew_deadline_s ({deadline})",
                    ttl=self.ttl_s,
                    deadline=self.renew_deadline_s,
                )
            )
        if not self.renew_deadline_s > 1.2 * self.retry_period_s:
            raise ConfigError(
                msg(
                    "election.deadline_retry",
                    "election renew_deadline_s ({deadline}) must be greater than 1.2 x retry_period_s "
                    "({retry}), i.e. > {least:g}",
                    deadline=self.renew_deadline_s,
                    retry=self.retry_period_s,
                    least=1.2 * self.retry_period_s,
                )
            )
        if self.retry_period_s <= 0:
            raise ConfigError(msg("election.retry", "election retry_period_s must be > 0"))


class Fenced(KunlunError):
    """etcd refused a leader write: this replica is no longer the leader. Never retried."""


class Fence:
    """The write helper of one leadership term (epoch)."""

    def __init__(self, store: EtcdStore, name: str, epoch: int) -> None:
        self.store = store
        self.name = name
        self.epoch = epoch
        self.lost = asyncio.Event()

    async def txn(
        self, compares: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()
    ) -> TxnResult:
        """ATOMIC fenced transaction: the caller's compares plus `leader key create revision == epoch`.

        Raises Fenced if the leader compare failed (and marks the term lost); returns the result
        (succeeded False) if only the caller's own compares failed. `reads` of the result holds the
        caller's failure reads, without the leader read this adds.
        """
        if self.lost.is_set():
            raise Fenced(f"{self.name}: leadership of epoch {self.epoch} already lost")
        res = await self.store.txn(
            [Compare(keys.LEADER, "create", "==", self.epoch), *compares],
            success,
            [*failure, GetOp(keys.LEADER)],
        )
        if res.succeeded:
            return res
        leader_now = res.reads[-1] if res.reads else []
        if not leader_now or leader_now[0].create_revision != self.epoch:
            self.lost.set()
            holder = keys.decode(leader_now[0].value).get("name", "?") if leader_now else "nobody"
            log.warning("fenced write refused by etcd; stepping down", epoch=self.epoch, leader_now=holder)
            raise Fenced(f"{self.name}: epoch {self.epoch} is no longer the leader (now: {holder})")
        return TxnResult(False, res.revision, res.reads[:-1])

    async def put(self, key: str, value: bytes) -> int:
        """Fenced unconditional put; returns the revision."""
        return (await self.txn([], [PutOp(key, value)])).revision


LeaderLoop = Callable[[Fence], Awaitable[None]]


class Elector:
    """Campaigns for leadership and runs the leader-only loops while it holds it."""

    def __init__(
        self,
        store: EtcdStore,
        name: str,
        address: str,
        settings: ElectionSettings,
        loops: Sequence[LeaderLoop] = (),
    ) -> None:
        self.store = store
        self.name = name
        self.address = address
        self.settings = settings
        self.loops = list(loops)
        self.fence: Fence | None = None
        self.leader_name: str = ""
        self._lease = 0
        self._seen_revision = 0
        self._stopping = False
        self.changed = asyncio.Event()
        self.terms = 0  # leaderships this replica has won since it started (metrics)

    @property
    def is_leader(self) -> bool:
        return self.fence is not None and not self.fence.lost.is_set()

    async def run(self) -> None:
        """Follow or lead until cancelled. Never raises on etcd trouble: logs and retries."""
        while not self._stopping:
            try:
                epoch = await self._campaign()
                if epoch:
                    await self._lead(epoch)
                else:
                    await self._wait_for_vacancy()
            except asyncio.CancelledError:
                raise
            except KunlunError as e:
                log.warning("election tick failed; retrying", error=str(e))
                await asyncio.sleep(self.settings.retry_period_s)

    async def _wait_for_vacancy(self) -> None:
        """A follower waits until the leader key is deleted (a watch: a resigning or expired leader
        is replaced at once, not on the next poll), or at most `retry_period_s` (the poll stays as
        the fallback should the watch miss it)."""

        async def deleted() -> None:
            async for ev in self.store.watch_prefix(keys.LEADER, self._seen_revision + 1):
                if isinstance(ev, Resync):
                    if not any(kv.key == keys.LEADER for kv in ev.kvs):
                        return
                elif ev.kv.key == keys.LEADER and ev.kind == "delete":
                    return

        if not self._seen_revision:
            await asyncio.sleep(self.settings.retry_period_s)
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(deleted(), self.settings.retry_period_s)

    async def _campaign(self) -> int:
        """Become leader if the role is vacant; return the epoch (0 when someone else leads)."""
        current = await self.store.get(keys.LEADER)
        if current is not None:
            self._observe(keys.decode(current.value).get("name", ""))
            self._seen_revision = current.mod_revision
            return 0
        self._seen_revision = 0
        lease = await self.store.lease_grant(self.settings.ttl_s)
        value = keys.encode(
            {
                "name": self.name,
                "address": self.address,
                "pid": os.getpid(),
                "since_ms": now_ms(),
            }
        )
        try:
            res = await self.store.create(keys.LEADER, value, lease)
        except BaseException:
            with contextlib.suppress(Exception):
                await self.store.lease_revoke(lease)
            raise
        if not res.succeeded:
            await self.store.lease_revoke(lease)
            if res.reads and res.reads[0]:
                self._observe(keys.decode(res.reads[0][0].value).get("name", ""))
                self._seen_revision = res.reads[0][0].mod_revision
            return 0
        self._lease = lease
        return res.revision

    def _observe(self, leader: str) -> None:
        if leader != self.leader_name:
            self.leader_name = leader
            self.changed.set()

    async def _lead(self, epoch: int) -> None:
        fence = Fence(self.store, self.name, epoch)
        self.fence = fence
        self.terms += 1
        self._observe(self.name)
        log.info("became leader", epoch=epoch, ttl_s=self.settings.ttl_s)
        tasks = [
            asyncio.create_task(self._guard(loop, fence), name=f"leader-loop-{i}")
            for i, loop in enumerate(self.loops)
        ]
        try:
            await self._renew_until_lost(fence)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            fence.lost.set()
            self.fence = None
            lease, self._lease = self._lease, 0
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.store.lease_revoke(lease), 1.0)
            self._observe("")
            log.info("stepped down", epoch=epoch)

    async def _guard(self, loop: LeaderLoop, fence: Fence) -> None:
        """Run one leader loop; it must never die: restart it after errors until the term ends."""
        while not fence.lost.is_set():
            try:
                await loop(fence)
                return
            except asyncio.CancelledError:
                raise
            except Fenced:
                return
            except Exception as e:
                log.exception(
                    "leader loop failed; restarting",
                    loop=getattr(loop, "__qualname__", str(loop)),
                    error=str(e),
                )
                await asyncio.sleep(self.settings.retry_period_s)

    async def _renew_until_lost(self, fence: Fence) -> None:
        s = self.settings
        last_ok = time.monotonic()
        tick = 0
        while not fence.lost.is_set() and not self._stopping:
            tick += 1
            try:
                # fenced write first: a leader waking from a pause learns from etcd that it was deposed
                await fence.put(
                    keys.LEADER_STATE,
                    keys.encode(
                        {
                            "name": self.name,
                            "epoch": fence.epoch,
                            "tick": tick,
                            "at_ms": now_ms(),
                        }
                    ),
                )
                ttl = await self.store.lease_keepalive(self._lease)
                if ttl <= 0:
                    log.warning("leader lease lost (keep-alive returned TTL 0)", epoch=fence.epoch)
                    return
                last_ok = time.monotonic()
            except Fenced:
                return
            except TemporaryError as e:
                if time.monotonic() - last_ok > s.renew_deadline_s:
                    log.warning("could not renew within the renew deadline; stepping down", error=str(e))
                    return
            try:
                await asyncio.wait_for(fence.lost.wait(), s.retry_period_s)
            except TimeoutError:
                pass

    async def resign(self) -> None:
        """Give up leadership at once (graceful stop): revoking the lease deletes the leader key."""
        self._stopping = True
        if self.fence is not None:
            self.fence.lost.set()
        if self._lease:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.store.lease_revoke(self._lease), 2.0)
            log.info("resigned leadership")
