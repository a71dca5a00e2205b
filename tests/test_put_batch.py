"""PutBatcher against real etcd: many snapshot puts leave in one transaction (one revision), the
newest value of a key wins, and a batch that etcd refuses fails every caller in it."""

from __future__ import annotations

import asyncio

import pytest

from controlplane.put_batch import PutBatcher
from controlplane.store import EtcdStore
from controlplane.store.contract import MAX_TXN_OPS
from kunlun_common.errors import KunlunError


async def test_puts_within_the_linger_share_one_transaction(store: EtcdStore, prefix: str) -> None:
    batcher = PutBatcher(store, linger_s=0.2)
    try:
        rev0 = await store.revision()
        n = MAX_TXN_OPS + 22  # more than one transaction can carry
        await asyncio.gather(*(batcher.put(f"{prefix}t/{i:04d}", f"v{i}".encode()) for i in range(n)))
        assert batcher.puts == n and batcher.transactions == 2
        assert await store.revision() == rev0 + 2  # one revision per transaction, not per put
        kvs, _ = await store.get_prefix(f"{prefix}t/")
        assert sorted(kv.value for kv in kvs) == sorted(f"v{i}".encode() for i in range(n))

        # a key put twice before its batch leaves: one write, the newest value, both callers answered
        await asyncio.gather(batcher.put(f"{prefix}t/x", b"old"), batcher.put(f"{prefix}t/x", b"new"))
        kv = await store.get(f"{prefix}t/x")
        assert kv is not None and kv.value == b"new"
    finally:
        await batcher.close()


async def test_a_refused_batch_fails_each_caller(store: EtcdStore, prefix: str) -> None:
    batcher = PutBatcher(store, linger_s=0.05)
    try:
        too_big = b"x" * (2 * 1024 * 1024)  # over etcd's request size limit: the transaction is refused
        results = await asyncio.gather(
            batcher.put(f"{prefix}big/a", b"small"),
            batcher.put(f"{prefix}big/b", too_big),
            return_exceptions=True,
        )
        assert all(isinstance(r, KunlunError) for r in results), results
        assert await store.get(f"{prefix}big/a") is None  # all or nothing
        await batcher.put(f"{prefix}big/a", b"small")  # and the batcher goes on
        assert (await store.get(f"{prefix}big/a")) is not None
    finally:
        await batcher.close()


async def test_close_answers_every_waiting_caller(store: EtcdStore, prefix: str) -> None:
    batcher = PutBatcher(store, linger_s=10.0)
    waiting = asyncio.create_task(batcher.put(f"{prefix}c", b"v"))
    for _ in range(10):  # the put is queued behind the long linger
        await asyncio.sleep(0)
    assert not waiting.done()
    await batcher.close()
    with pytest.raises(KunlunError):
        await waiting
