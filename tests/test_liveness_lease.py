"""One liveness lease per replica, against real etcd: what it must never do.

Every `alive/<node>` key a replica writes is bound to the replica's own lease (one keep-alive a
period whatever the number of agents); a node that goes silent is marked dead by an explicit,
compared delete. These tests try to break that: a node that moved to another replica must keep
its key, a silent node must lose it and get no ack meanwhile, a lost lease must withhold acks until
the node is marked alive again, and the keep-alives must not grow with the number of nodes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from controlplane import keys
from controlplane.liveness import liveness_lease_ttl_s, refresh_period_s
from controlplane.node_session import NodeSession
from controlplane.nodes import NodeSessions
from controlplane.settings import ReplicaSettings
from controlplane.store import EtcdStore
from kunlun_common.api import agent_pb2

TTL = 3  # the node lease: the shortest a replica accepts


def settings(name: str) -> ReplicaSettings:
    return ReplicaSettings(
        name=name,
        cert_dir="/nonexistent",
        etcd_endpoints=("https://127.0.0.1:1",),
        node_lease_ttl_s=TTL,
        heartbeat_ack_requires_etcd_s=1.5,
    )


async def until(check: object, within: float, what: str) -> None:
    assert callable(check)
    end = time.monotonic() + within
    while time.monotonic() < end:
        if await check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out after {within}s waiting for {what}")


@pytest.fixture
async def replicas(store: EtcdStore) -> AsyncIterator[tuple[NodeSessions, NodeSessions]]:
    await store.delete(keys.ROOT, prefix=True)
    a, b = NodeSessions(store, settings("r-a")), NodeSessions(store, settings("r-b"))
    loops = [asyncio.create_task(s.refresh_leases()) for s in (a, b)]
    try:
        yield a, b
    finally:
        for t in loops:
            t.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
        for s in (a, b):
            for session in list(s.sessions.values()):
                await s.disconnect(session)
            if s.lease:
                await store.lease_revoke(s.lease)
        await store.delete(keys.ROOT, prefix=True)


async def register(s: NodeSessions, node: str) -> NodeSession:
    return await s.register(agent_pb2.RegisterNode(node=node, address="127.0.0.1"), f"agent:{node}")


async def alive_lease(store: EtcdStore, node: str) -> int | None:
    kv = await store.get(keys.alive(node))
    return None if kv is None else kv.lease


async def test_nodes_share_the_replicas_lease_and_keepalives_do_not_grow_with_nodes(
    store: EtcdStore, replicas: tuple[NodeSessions, NodeSessions]
) -> None:
    a, b = replicas
    few = [await register(a, f"few-{i}") for i in range(2)]
    many = [await register(b, f"many-{i}") for i in range(40)]
    assert {await alive_lease(store, s.node) for s in few} == {a.lease}
    assert {await alive_lease(store, s.node) for s in many} == {b.lease}
    assert a.lease != b.lease
    assert await store.lease_time_to_live(a.lease) > TTL  # node lease + ack window
    k0 = (a.keepalives, b.keepalives)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 4 * refresh_period_s(a.settings):  # heartbeats at 4 Hz meanwhile
        for s in few:
            assert await a.heartbeat(s, agent_pb2.Heartbeat(seq=1)), "ack withheld in steady state"
        for s in many:
            assert await b.heartbeat(s, agent_pb2.Heartbeat(seq=1)), "ack withheld in steady state"
        await asyncio.sleep(0.25)
    ka, kb = a.keepalives - k0[0], b.keepalives - k0[1]
    # one keep-alive a period per replica, 2 nodes or 40: no keep-alive per node
    assert 2 <= ka <= 6 and 2 <= kb <= 6 and abs(ka - kb) <= 2, (ka, kb)


async def test_a_node_that_moved_keeps_its_key_when_the_old_replica_sweeps(
    store: EtcdStore, replicas: tuple[NodeSessions, NodeSessions]
) -> None:
    a, b = replicas
    old = await register(a, "mover")
    await a.disconnect(old)  # the agent's stream to a ended ...
    assert "mover" in a.departed
    new = await register(b, "mover")  # ... and it registered with b
    assert await alive_lease(store, "mover") == b.lease

    # a's sweep comes once the node is a lease past its last heartbeat there: b's key must stay
    async def swept() -> bool:
        return "mover" not in a.departed

    await until(swept, 3 * TTL, "a's sweep of the node")
    for beat in range(4):
        assert await b.heartbeat(new, agent_pb2.Heartbeat(seq=beat))
        assert await alive_lease(store, "mover") == b.lease
        await asyncio.sleep(0.2)


async def test_a_silent_node_loses_its_key_gets_no_ack_then_is_marked_alive_again(
    store: EtcdStore, replicas: tuple[NodeSessions, NodeSessions]
) -> None:
    a, _ = replicas
    quiet, talker = await register(a, "quiet"), await register(a, "talker")
    t0 = time.monotonic()

    async def gone() -> bool:
        assert await a.heartbeat(talker, agent_pb2.Heartbeat(seq=0)), "the heard node lost its ack"
        return await alive_lease(store, "quiet") is None

    # the stream stays open (a frozen agent): the key goes 1.5 x the node lease after the last beat
    await until(gone, 4 * TTL, "the silent node's alive key to be deleted")
    assert time.monotonic() - t0 >= 1.5 * TTL - 0.1
    assert await alive_lease(store, "talker") == a.lease
    # the agent wakes up: that heartbeat is not acked (no key), it marks the node alive again
    assert not await a.heartbeat(quiet, agent_pb2.Heartbeat(seq=1))

    async def acked() -> bool:
        return await a.heartbeat(quiet, agent_pb2.Heartbeat(seq=2))

    await until(acked, 5, "acks to resume once the node is marked alive again")
    assert await alive_lease(store, "quiet") == a.lease


async def test_a_lost_lease_withholds_acks_until_each_node_is_marked_alive_again(
    store: EtcdStore, replicas: tuple[NodeSessions, NodeSessions]
) -> None:
    a, _ = replicas
    nodes = [await register(a, f"lost-{i}") for i in range(3)]
    first = a.lease
    await store.lease_revoke(first)  # as if the replica was paused past its lease: every key gone
    assert [await alive_lease(store, s.node) for s in nodes] == [None, None, None]

    # until the replica knows, it may still ack (the lease was confirmed within the window) but
    # never past the window; once it knows, no ack until the node's key is written again
    async def renewed() -> bool:
        return a.lease not in (0, first)

    await until(renewed, 5, "a new liveness lease")
    for s in nodes:
        assert not await a.heartbeat(s, agent_pb2.Heartbeat(seq=1)), "acked with no alive key"

    async def all_acked() -> bool:
        return all([await a.heartbeat(s, agent_pb2.Heartbeat(seq=2)) for s in nodes])

    await until(all_acked, 5, "acks to resume after the nodes were marked alive again")
    assert {await alive_lease(store, s.node) for s in nodes} == {a.lease}
    assert await store.lease_time_to_live(a.lease) > 0 and liveness_lease_ttl_s(a.settings) == TTL + 2


async def test_a_reregistration_during_the_sweep_keeps_the_new_key(
    store: EtcdStore, replicas: tuple[NodeSessions, NodeSessions]
) -> None:
    """The sweep deletes only the value it wrote: a registration landing just before its delete
    (same replica, same lease) wrote a newer value, which stays."""
    a, _ = replicas
    old = await register(a, "again")
    written = old.alive_value
    await a.disconnect(old)
    new = await register(a, "again")  # the agent came back to the same replica
    assert new.alive_value != written and "again" not in a.departed
    # the stale entry of the old session, had it been queued: the compared delete must not apply
    a._sweep.append(("again", written))
    await a._delete_stale(time.monotonic())
    assert await alive_lease(store, "again") == a.lease
    assert await a.heartbeat(new, agent_pb2.Heartbeat(seq=1))


async def test_a_key_an_older_replica_left_on_our_lease_is_deleted_after_two_scans(
    store: EtcdStore, replicas: tuple[NodeSessions, NodeSessions]
) -> None:
    """Mixed versions during a rolling upgrade: a 0.5.0 replica adopts the lease of the alive key it
    finds (ours) when the node moves to it, and writes its own value. When the node then dies there,
    our lease keeps the key alive and our sweep (which compares our value) never deletes it: the
    orphan scan does, or the node would stay Ready forever."""
    a, _ = replicas
    moved = await register(a, "adopted")
    stays = await register(a, "stays")  # a node of ours, heard: never an orphan
    await a.disconnect(moved)
    # what 0.5.0's registration wrote: its own value on the lease it found
    await store.put(keys.alive("adopted"), keys.encode({"replica": "old", "lease": a.lease}), a.lease)

    async def deleted() -> bool:
        assert await a.heartbeat(stays, agent_pb2.Heartbeat(seq=1))
        return await alive_lease(store, "adopted") is None

    await until(deleted, 6 * 2 * TTL, "the orphaned alive key to be deleted")
    assert a.orphans_deleted == 1
    assert await alive_lease(store, "stays") == a.lease


async def test_a_busy_event_loop_does_not_starve_the_liveness_keepalive(
    store: EtcdStore, replicas: tuple[NodeSessions, NodeSessions]
) -> None:
    """The keep-alives run in a thread of their own: a loop blocked longer than the ack window
    (a storm of callbacks, a slow handler) finds its lease confirmed when it wakes, and acks at
    once. Keep-alives written by the loop were not sent while it was blocked, so every heartbeat
    queued meanwhile was refused its ack."""
    a, _ = replicas
    s = await register(a, "busy")

    async def threaded() -> bool:
        return a.keeper is not None and a.keeper.sent > 0

    await until(threaded, 5, "the keep-alive thread's first refresh")
    window = a.settings.heartbeat_ack_requires_etcd_s
    time.sleep(window + 1.0)  # noqa: ASYNC251  # the fault: the event loop blocked, nothing else runs
    assert time.monotonic() - a.lease_ok_at < window, "the lease was not refreshed while the loop was blocked"
    assert await a.heartbeat(s, agent_pb2.Heartbeat(seq=1))


async def test_a_wedged_event_loop_lets_the_lease_expire(
    store: EtcdStore, replicas: tuple[NodeSessions, NodeSessions]
) -> None:
    """The watchdog: the thread refreshes only while the loop beat within the node lease, so a
    wedged loop does not keep the alive keys of nodes it cannot serve alive forever."""
    a, _ = replicas
    await register(a, "wedged")

    async def threaded() -> bool:
        return a.keeper is not None and a.keeper.sent > 0

    await until(threaded, 5, "the keep-alive thread's first refresh")
    assert a.keeper is not None
    time.sleep(TTL + 1.5)  # noqa: ASYNC251  # the fault: the loop wedged past the node lease
    assert a.keeper.skipped_for_loop >= 1
    assert time.monotonic() - a.lease_ok_at > 1.0  # no refresh was confirmed in the last second


async def test_a_stale_stream_never_takes_back_a_key_another_replica_wrote(
    store: EtcdStore, replicas: tuple[NodeSessions, NodeSessions]
) -> None:
    """The agent left replica a (frozen, SIGSTOP) for b. Once a resumes, its sweep has dropped the
    node's key as its own (b's value stands), and then a heartbeat that waited in a's socket
    arrives on the old stream: a must not write the key back under its own lease (b would go on
    acking a node whose key a's lease holds and a deletes 3 s later), nor ack."""
    a, b = replicas
    old = await register(a, "fled")
    new = await register(b, "fled")  # the agent's new stream, while a's old one still stands

    async def swept() -> bool:
        assert await b.heartbeat(new, agent_pb2.Heartbeat(seq=1)), "b lost its ack"
        return old.lease == 0  # a's sweep: silent 1.5 x the lease on the open stream

    await until(swept, 4 * TTL, "a's sweep of the silent stream")
    assert not await a.heartbeat(old, agent_pb2.Heartbeat(seq=0)), "a stale stream was acked"
    assert old.marking is not None
    await asyncio.wait({old.marking})
    kv = await store.get(keys.alive("fled"))
    assert kv is not None and kv.lease == b.lease and kv.value == new.alive_value, "a took the key back"
    assert a.foreign_writes == 1
    assert not await a.heartbeat(old, agent_pb2.Heartbeat(seq=1))
    assert await b.heartbeat(new, agent_pb2.Heartbeat(seq=2))


async def test_a_late_registration_elsewhere_stops_the_acks_until_the_key_is_ours_again(
    store: EtcdStore, replicas: tuple[NodeSessions, NodeSessions]
) -> None:
    """A registration that waited on replica a (paused mid-way) lands after the agent registered
    with b: the key is now on a's lease. b sees it through its watch and stops acking at once
    (before the change it acked on, and a deleted the key when its dead stream was swept: the node
    NotReady while b acked it). Once a's dead session is swept, b's next heartbeat takes the key
    back and acks again."""
    from controlplane.cache import GraphCache
    from controlplane.liveness import AliveKeys

    a, b = replicas
    cache = GraphCache(store)
    cache.listen([keys.ALIVE], AliveKeys(b, cache))
    await cache.start()
    try:
        mine = await register(b, "late")
        assert await b.heartbeat(mine, agent_pb2.Heartbeat(seq=0))
        late = await register(a, "late")  # the stale registration overtakes b's
        assert await alive_lease(store, "late") == a.lease

        async def withheld() -> bool:
            return not await b.heartbeat(mine, agent_pb2.Heartbeat(seq=1))

        await until(withheld, 5, "b to stop acking a node whose key a's lease holds")
        assert b.foreign_writes >= 1
        await a.disconnect(late)  # a's stream was dead: its session is swept, its key deleted

        async def ours_again() -> bool:
            acked = await b.heartbeat(mine, agent_pb2.Heartbeat(seq=2))
            return acked and await alive_lease(store, "late") == b.lease

        await until(ours_again, 4 * TTL, "b to take the key back and ack again")
    finally:
        await cache.stop()


async def test_a_key_of_ours_the_session_does_not_know_does_not_keep_a_silent_node_alive(
    store: EtcdStore, replicas: tuple[NodeSessions, NodeSessions]
) -> None:
    """A write of ours that the node's current session never recorded (an older session's write
    that landed after the new registration, as an unconditional re-mark could) holds the key: the
    session's compared delete cannot remove it once the node goes silent. The orphan scan must
    (it skipped every node with a session, so the frozen node stayed Ready for good)."""
    a, _ = replicas
    s = await register(a, "frozen")
    await store.put(keys.alive("frozen"), keys.encode({"replica": "r-a", "write": 0}), a.lease)
    t0 = time.monotonic()

    async def gone() -> bool:
        return await alive_lease(store, "frozen") is None

    await until(gone, 6 * 2 * TTL, "the silent node's key to be deleted")
    assert time.monotonic() - t0 >= 1.5 * TTL - 0.1  # never before a silent session's own sweep
    assert a.orphans_deleted == 1 and s.lease == 0
