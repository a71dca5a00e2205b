"""An audit record rides in the transaction of the change it records (controlplane/store/riders.py),
against the real 3-member TLS etcd: it exists if and only if the change committed, at the same
revision; a failed compare writes neither; reads and full transactions carry nothing; a rider is
carried once and never after its call returned."""

from __future__ import annotations

import asyncio

from controlplane.store import Compare, DeleteOp, EtcdStore, GetOp, PutOp
from controlplane.store.contract import MAX_TXN_OPS
from controlplane.store.riders import Rider, riding


def _rider(prefix: str, n: int = 1) -> Rider:
    return Rider(tuple(PutOp(f"{prefix}audit/{i}", b"record") for i in range(n)))


async def _revision_of(store: EtcdStore, key: str) -> int:
    kv = await store.get(key)
    return kv.mod_revision if kv is not None else 0


async def test_a_failed_compare_writes_neither_change_nor_record(store: EtcdStore, prefix: str) -> None:
    seen = await store.put(prefix + "k", b"v1")
    rider = _rider(prefix)
    with riding(rider):
        lost = await store.txn([Compare.unchanged(prefix + "k", seen - 1)], [PutOp(prefix + "k", b"v2")])
        assert not lost.succeeded and not rider.attached
        assert await store.get(prefix + "audit/0") is None
        kv = await store.get(prefix + "k")
        assert kv is not None and kv.value == b"v1"
        # the retry that commits carries the record, at the change's revision
        won = await store.txn([Compare.unchanged(prefix + "k", seen)], [PutOp(prefix + "k", b"v2")])
        assert won.succeeded and rider.revision == won.revision
        assert (
            await _revision_of(store, prefix + "audit/0")
            == won.revision
            == await _revision_of(store, prefix + "k")
        )
        # carried once: a later write of the same call leaves the record alone
        later = await store.put(prefix + "other", b"x")
        assert later > won.revision and await _revision_of(store, prefix + "audit/0") == won.revision
    assert rider.closed


async def test_put_delete_and_create_carry_the_record(store: EtcdStore, prefix: str) -> None:
    r1 = _rider(prefix + "p/")
    with riding(r1):
        rev = await store.put(prefix + "k", b"v")
    assert r1.revision == rev == await _revision_of(store, prefix + "p/audit/0")

    r2 = _rider(prefix + "d/")
    with riding(r2):
        assert await store.delete(prefix + "k") == 1
    assert r2.attached and await _revision_of(store, prefix + "d/audit/0") == r2.revision
    assert await store.get(prefix + "k") is None

    r3 = _rider(prefix + "c/")
    with riding(r3):
        taken = await store.create(prefix + "new", b"1")
    assert taken.succeeded and await _revision_of(store, prefix + "c/audit/0") == taken.revision
    r4 = _rider(prefix + "c2/")
    with riding(r4):
        again = await store.create(prefix + "new", b"2")  # exists: the compare fails
    assert not again.succeeded and not r4.attached and await store.get(prefix + "c2/audit/0") is None


async def test_reads_full_transactions_and_closed_riders_carry_nothing(store: EtcdStore, prefix: str) -> None:
    await store.put(prefix + "k", b"v")
    rider = _rider(prefix)
    with riding(rider):
        await store.txn([], [GetOp(prefix + "k")])  # a read in a transaction is no change
        await store.get(prefix + "k")
        full = [PutOp(f"{prefix}full/{i}", b"x") for i in range(MAX_TXN_OPS)]
        assert (await store.txn([], full)).succeeded  # no room left: the record cannot ride
        assert not rider.attached
        late = asyncio.Event()

        async def background() -> None:  # started by the call, writing after the call returned
            await late.wait()
            await store.put(prefix + "late", b"x")

        task = asyncio.create_task(background())
    late.set()
    await task
    assert rider.closed and not rider.attached
    assert await store.get(prefix + "audit/0") is None
    await store.delete(prefix + "full/", prefix=True)


async def test_the_record_rides_with_deletes_in_a_transaction(store: EtcdStore, prefix: str) -> None:
    await store.put(prefix + "a", b"1")
    rider = _rider(prefix, n=2)
    with riding(rider):
        done = await store.txn([Compare(prefix + "a", "value", "==", b"1")], [DeleteOp(prefix + "a")])
    assert done.succeeded and rider.revision == done.revision
    assert [await _revision_of(store, f"{prefix}audit/{i}") for i in range(2)] == [done.revision] * 2
