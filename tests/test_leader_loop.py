"""The skeleton shared by the leader-only loops (controlplane/leader_loop.py), against real etcd:
a change under the loop's prefixes wakes a tick, a tick that committed is followed only by ticks
whose cache has seen that commit, and the loop ends (its cache stopped) when the term is lost."""

from __future__ import annotations

import asyncio

from controlplane import keys
from controlplane.cache import GraphCache
from controlplane.election import Fence
from controlplane.leader_loop import run_leader_loop
from controlplane.store import EtcdStore


async def test_ticks_on_its_prefixes_sees_its_own_commits_and_ends_with_the_term(store: EtcdStore) -> None:
    fence = Fence(store, "r1", 1)
    seen: list[tuple[int, bool]] = []  # (cache revision, the rollout key present) per tick
    committed: list[int] = []
    ticked = asyncio.Condition()

    async def tick(f: Fence, cache: GraphCache) -> int:
        assert f is fence
        seen.append((cache.revision, cache.get(keys.rollout("w")) is not None))
        rev = 0
        if len(seen) == 2:  # the second tick commits; the third must see that commit
            rev = await store.put(keys.rollout("w2"), b"{}")
            committed.append(rev)
        async with ticked:
            ticked.notify_all()
        return rev

    async def ticks(n: int) -> None:
        async with ticked:
            await asyncio.wait_for(ticked.wait_for(lambda: len(seen) >= n), 30)

    loop = asyncio.create_task(run_leader_loop("test loop", store, fence, (keys.ROLLOUTS,), tick, idle_s=60))
    try:
        await ticks(1)  # a first tick at start
        rev = await store.put(keys.rollout("w"), b"{}")  # under its prefix: wakes it at once
        await ticks(2)
        assert seen[1][0] >= rev and seen[1][1]
        await store.put(keys.rollout("w3"), b"{}")
        await ticks(3)
        assert seen[2][0] >= committed[0]  # never decides from a cache older than its own commit
        fence.lost.set()
        await store.put(keys.rollout("w4"), b"{}")  # wakes it: it sees the term is over and ends
        await asyncio.wait_for(loop, 30)
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        await store.delete(keys.ROOT, prefix=True)
