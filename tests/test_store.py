"""The store contract against a real 3-member TLS etcd cluster."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from controlplane.store import KV, Compare, DeleteOp, EtcdStore, GetOp, PutOp, Resync, WatchEvent
from controlplane.store.contract import MAX_TXN_OPS
from devcluster.etcd_cluster import EtcdCluster
from kunlun_common.errors import ConfigError, PermanentError, TemporaryError
from tests.conftest import store_settings


async def test_put_get_and_prefix(store: EtcdStore, prefix: str) -> None:
    rev = await store.put(prefix + "a", b"1")
    await store.put(prefix + "b", b"2")
    kv = await store.get(prefix + "a")
    assert kv is not None and kv.value == b"1" and kv.mod_revision == rev
    kvs, at = await store.get_prefix(prefix)
    assert [k.key for k in kvs] == [prefix + "a", prefix + "b"]
    assert at >= rev
    assert await store.get(prefix + "missing") is None
    assert await store.delete(prefix, prefix=True) == 2
    assert (await store.get_prefix(prefix))[0] == []


async def test_create_is_compare_and_set(store: EtcdStore, prefix: str) -> None:
    first = await store.create(prefix + "k", b"first")
    second = await store.create(prefix + "k", b"second")
    assert first.succeeded and not second.succeeded
    assert second.reads[0][0].value == b"first"
    kv = await store.get(prefix + "k")
    assert kv is not None and kv.value == b"first"


async def test_txn_compares_mod_revision(store: EtcdStore, prefix: str) -> None:
    rev = await store.put(prefix + "k", b"v1")
    ok = await store.txn([Compare.unchanged(prefix + "k", rev)], [PutOp(prefix + "k", b"v2")])
    assert ok.succeeded
    stale = await store.txn(
        [Compare.unchanged(prefix + "k", rev)], [PutOp(prefix + "k", b"v3")], [GetOp(prefix + "k")]
    )
    assert not stale.succeeded and stale.reads[0][0].value == b"v2"
    both = await store.txn([], [PutOp(prefix + "x", b"1"), DeleteOp(prefix + "k")])
    assert both.succeeded
    assert await store.get(prefix + "k") is None


async def test_txn_over_etcd_limit_is_refused_before_sending(store: EtcdStore, prefix: str) -> None:
    ops = [PutOp(f"{prefix}{i}", b"x") for i in range(MAX_TXN_OPS + 1)]
    with pytest.raises(PermanentError, match="128"):
        await store.txn([], ops)
    assert (await store.get_prefix(prefix))[0] == []
    full = await store.txn([], ops[:MAX_TXN_OPS])
    assert full.succeeded and len((await store.get_prefix(prefix))[0]) == MAX_TXN_OPS


async def test_lease_keepalive_expiry_and_revoke(store: EtcdStore, prefix: str) -> None:
    lease = await store.lease_grant(2)
    await store.put(prefix + "live", b"x", lease)
    assert await store.lease_keepalive(lease) > 0
    _, rev = await store.get_prefix(prefix)
    # stop refreshing: the key must disappear by itself (watch for the delete)
    async with asyncio.timeout(20):
        async for ev in store.watch_prefix(prefix, rev + 1):
            if isinstance(ev, WatchEvent) and ev.kind == "delete":
                assert ev.kv.key == prefix + "live"
                break
    assert await store.lease_keepalive(lease) == 0  # a lost lease renews with TTL 0
    assert await store.lease_time_to_live(lease) == -1
    lease2 = await store.lease_grant(30)
    await store.put(prefix + "other", b"y", lease2)
    await store.lease_revoke(lease2)
    assert await store.get(prefix + "other") is None
    await store.lease_revoke(lease2)  # revoking twice is fine


async def _collect(store: EtcdStore, prefix: str, start: int, n: int, out: list[WatchEvent | Resync]) -> None:
    async for ev in store.watch_prefix(prefix, start):
        out.append(ev)
        if sum(1 for e in out if isinstance(e, WatchEvent)) >= n:
            return


async def test_watch_resumes_across_member_restarts(store: EtcdStore, etcd: EtcdCluster, prefix: str) -> None:
    _, rev = await store.get_prefix(prefix)
    seen: list[WatchEvent | Resync] = []
    total = 30
    watcher = asyncio.create_task(_collect(store, prefix, rev + 1, total, seen))
    written = 0
    for member in etcd.members:  # restart every member once while writing: the stream must move
        for _ in range(total // len(etcd.members) // 2):
            await store.put(f"{prefix}{written:03d}", str(written).encode())
            written += 1
        await asyncio.to_thread(member.proc.kill)
        member.proc.start()
        for _ in range(total // len(etcd.members) - total // len(etcd.members) // 2):
            await store.put(f"{prefix}{written:03d}", str(written).encode())
            written += 1
    async with asyncio.timeout(60):
        await watcher
    keys = [e.kv.key for e in seen if isinstance(e, WatchEvent)]
    assert keys == [f"{prefix}{i:03d}" for i in range(total)]  # every event once, in order
    revs = [e.kv.mod_revision for e in seen if isinstance(e, WatchEvent)]
    assert revs == sorted(set(revs))


async def test_watch_relists_after_compaction(store: EtcdStore, prefix: str) -> None:
    first = await store.put(prefix + "a", b"1")
    await store.put(prefix + "a", b"2")
    last = await store.put(prefix + "b", b"3")
    await store.compact(last)
    got: list[WatchEvent | Resync] = []
    async with asyncio.timeout(20):
        async for ev in store.watch_prefix(prefix, first):
            got.append(ev)
            break
    assert isinstance(got[0], Resync)
    assert {kv.key: kv.value for kv in got[0].kvs} == {prefix + "a": b"2", prefix + "b": b"3"}
    assert got[0].revision >= last


async def test_unreachable_etcd_is_a_temporary_error(cert_dir: Path) -> None:
    s = EtcdStore(
        store_settings(cert_dir, ("https://127.0.0.1:1",), request_timeout_s=0.5, retry_deadline_s=1.5)
    )
    try:
        with pytest.raises(TemporaryError, match=r"UNAVAILABLE|DEADLINE"):
            await s.get("/x")
    finally:
        await s.close()


async def test_wrong_tls_files_are_config_errors(cert_dir: Path, etcd: EtcdCluster) -> None:
    settings = store_settings(cert_dir, etcd.endpoints)
    bad = type(settings)(**{**settings.__dict__, "cert_path": str(cert_dir / "nope.crt")})
    with pytest.raises(ConfigError, match=r"nope\.crt"):
        await EtcdStore(bad).connect()


async def test_foreign_ca_is_refused(tmp_path: Path, etcd: EtcdCluster) -> None:
    from kunlun_common.pki import ClusterCerts, init_cluster_certs

    init_cluster_certs(tmp_path, ClusterCerts())
    s = EtcdStore(store_settings(tmp_path, etcd.endpoints, request_timeout_s=1.0, retry_deadline_s=2.0))
    try:
        with pytest.raises(TemporaryError):
            await s.get("/x")
    finally:
        await s.close()


def test_kv_type_is_plain_data() -> None:
    kv = KV("k", b"v", 1, 2, 1, 0)
    assert kv.key == "k" and kv.mod_revision == 2


async def test_watch_delivers_every_event_of_a_transaction(store: EtcdStore, prefix: str) -> None:
    await store.put(prefix + "gone", b"0")
    _, rev = await store.get_prefix(prefix)
    res = await store.txn(
        [], [PutOp(prefix + "a", b"1"), PutOp(prefix + "b", b"2"), DeleteOp(prefix + "gone")]
    )
    await store.put(prefix + "c", b"3")
    seen: list[tuple[str, str]] = []
    async with asyncio.timeout(20):
        async for ev in store.watch_prefix(prefix, rev + 1):
            assert isinstance(ev, WatchEvent)
            seen.append((ev.kind, ev.kv.key[len(prefix) :]))
            if len(seen) == 4:
                break
    assert sorted(seen[:3]) == [("delete", "gone"), ("put", "a"), ("put", "b")]
    assert seen[3] == ("put", "c")
    assert res.succeeded
