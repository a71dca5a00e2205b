"""EtcdStore: the store contract implemented on a real etcd v3 cluster, over mutual TLS.

Client library
--------------
We use the etcd v3 gRPC stubs that ship inside `aetcd==1.0.0` (pinned), driven through our own
`grpc.aio.secure_channel`. aetcd is asyncio-native and maintained and its generated stubs work with
protobuf >= 4 (which our own generated code needs; etcd3 0.12 fails to import there), but its
`Client.connect()` only builds insecure channels (upstream issue 37) and its watcher hides
compaction. Using the stubs directly gives us TLS, supervised watches that resume from the last
revision and re-list on compaction, and one multiplexed lease keep-alive stream. `etcd-sdk-python`
was the alternative: synchronous, and it locks an endpoint out for 300 s after one failure.

One channel targets every member (`ipv4:h1:p1,h2:p2,...` with round-robin), so a killed member
costs at most one request timeout. Requests carry `hasleader=true` so a member cut off from the
raft leader refuses them instead of serving stale data.

Call classes
------------
- CAS (atomic compare-and-set): `txn`, `create`. Applied at one revision or not at all; never
  retried automatically, because a timed-out transaction may have been applied: callers re-read and
  recompute (fenced writes and allocation compares make that safe).
- Time-critical: `lease_keepalive` (leader lease, node liveness): one attempt bounded by
  `request_timeout_s`; callers decide within their own renew deadline.
- Idempotent, retried with jitter until `retry_deadline_s`: `get`, `get_prefix`, `put`, `delete`,
  `lease_grant`, `lease_revoke`, `lease_time_to_live`.
Errors: `TemporaryError` (unreachable, no quorum, timeout: retry can help), `PermanentError`
(invalid request: it cannot), `LeaseNotFound` (a lease that expired or was revoked).
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlparse

import grpc
import structlog
from aetcd import rpc

from controlplane.store.contract import (
    KV,
    MAX_TXN_OPS,
    Compare,
    DeleteOp,
    GetOp,
    Op,
    PutOp,
    Resync,
    StoreSettings,
    TxnResult,
    WatchEvent,
    prefix_end,
)
from controlplane.store.credentials import read_pair
from controlplane.store.leases import LeaseKeeper
from controlplane.store.riders import Rider, boarding
from controlplane.store.wire import LeaseNotFound, _compare, _kv, _op, _read, channel_closed, translate
from kunlun_common.errors import ConfigError, PermanentError, TemporaryError
from kunlun_common.messages import msg
from kunlun_common.pki import ETCD_PEER_NAME
from kunlun_common.retry import backoff_delay, retry_until

log = structlog.get_logger("store")
T = TypeVar("T")
_METADATA = (("hasleader", "true"),)
_EOF: Any = grpc.aio.EOF  # type: ignore[attr-defined]  # (grpc-stubs lags grpcio)


@dataclass(frozen=True)
class MemberStatus:
    """Health of one etcd member, asked directly at its endpoint."""

    endpoint: str
    name: str
    member_id: int
    healthy: bool
    leader: bool
    db_size_bytes: int
    error: str


def host_port(endpoint: str) -> tuple[str, int]:
    """Parse 'https://h:p' or 'h:p' into (host, port)."""
    url = urlparse(endpoint if "://" in endpoint else f"https://{endpoint}")
    if not url.hostname or not url.port:
        raise ConfigError(
            msg(
                "store.etcd_endpoint_expected_https",
                "etcd endpoint {endpoint!r}: expected https://HOST:PORT, e.g. https://127.0.0.1:2379",
                endpoint=endpoint,
            )
        )
    return url.hostname, url.port


def _target(endpoints: Sequence[str]) -> str:
    addrs = []
    for ep in endpoints:
        host, port = host_port(ep)
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        ip = str(infos[0][4][0])
        addrs.append(f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}")
    scheme = "ipv6" if all(a.startswith("[") for a in addrs) else "ipv4"
    return f"{scheme}:{','.join(addrs)}"


class EtcdStore:
    """Async access to etcd; see the module docstring for which calls are CAS and time-critical."""

    def __init__(self, settings: StoreSettings) -> None:
        self.settings = settings
        self._channel: grpc.aio.Channel | None = None
        self._kv: Any = None
        self._lease: Any = None
        self._watch: Any = None
        self._keeper: LeaseKeeper | None = None
        self._creds: grpc.ChannelCredentials | None = None
        self._retiring: set[asyncio.Task[None]] = set()
        self.client_serial = ""
        """The serial of the client certificate this store presents to etcd (hex; "" before connecting)."""
        # called after every request with (operation, seconds, failed); the replica's metrics
        self.observer: Callable[[str, float, bool], None] | None = None

    # ----------------------------------------------------------------- lifecycle
    def _credentials(self) -> grpc.ChannelCredentials:
        s = self.settings
        pair = read_pair(s.ca_path, s.cert_path, s.key_path, check=False)
        self.client_serial = pair.serial
        return pair.credentials()

    def _server_name(self) -> str:
        """The name every member's certificate must carry (see StoreSettings.server_name)."""
        if self.settings.server_name:
            return self.settings.server_name
        hosts = {host_port(ep)[0] for ep in self.settings.endpoints}
        # members on several hosts: the name every member certificate carries and only the etcd CA
        # issues (kunlun_common.pki.ETCD_PEER_NAME) — a role check, not a name override
        return hosts.pop() if len(hosts) == 1 else ETCD_PEER_NAME

    def channel_options(self) -> list[tuple[str, str | int]]:
        name = self._server_name()
        return [
            # one channel balances over every member, so the name checked is one they all carry
            ("grpc.ssl_target_name_override", name),
            ("grpc.default_authority", name),
            ("grpc.lb_policy_name", "round_robin"),
            ("grpc.keepalive_time_ms", 5000),
            ("grpc.keepalive_timeout_ms", 3000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.initial_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", 2000),
            ("grpc.max_receive_message_length", 64 * 1024 * 1024),
        ]

    def sync_lease_stub(self) -> tuple[grpc.Channel, Any]:
        """A blocking channel of its own and its Lease stub, with the store's current client
        certificate (for a thread that must not depend on the event loop: `keepalive_thread`)."""
        assert self._creds is not None, "connect() first"
        ch = grpc.secure_channel(
            _target(self.settings.endpoints), self._creds, options=self.channel_options()
        )
        return ch, rpc.LeaseStub(ch)

    @property
    def credentials_in_use(self) -> object:
        """Changes when `reload_credentials` switched to a new client certificate."""
        return self._creds

    def _new_channel(self, target: str) -> grpc.aio.Channel:
        assert self._creds is not None
        return grpc.aio.secure_channel(target, self._creds, options=self.channel_options())

    async def connect(self) -> None:
        """Open the channel (lazy: the first call connects). Raises ConfigError for bad TLS files."""
        if self._channel is not None:
            return
        self._creds = self._credentials()
        self._channel = self._new_channel(_target(self.settings.endpoints))
        self._kv = rpc.KVStub(self._channel)
        self._lease = rpc.LeaseStub(self._channel)
        self._watch = rpc.WatchStub(self._channel)
        self._keeper = LeaseKeeper(self._lease, self.settings.request_timeout_s)

    def reload_credentials(self, grace_s: float = 5.0) -> bool:
        """Re-read the client certificate (SIGHUP after `kunlun-cli certs rotate`); True if a new
        one is now in use. A broken or unchanged pair keeps the current one (logged).

        New requests, watches and lease keep-alive streams go over a new channel that presents the
        new certificate; the old channel is closed after `grace_s`, which ends the requests still
        on it (each is retried on the new channel, as after any lost connection), its watches
        (they resume from their last revision: caches lose nothing) and its keep-alive streams
        (retired at once: the next refresh of every lease uses the new channel, so leases, the
        leader's included, stay alive). Afterwards etcd sees only the new certificate, so the old
        one can be revoked at etcd (`certs revoke SERIAL --dir DIR`)."""
        s = self.settings
        try:
            pair = read_pair(s.ca_path, s.cert_path, s.key_path)
        except ConfigError as e:
            log.error("etcd client certificate reload refused; keeping the current one", error=str(e))
            return False
        if self._channel is None:  # not connected yet: the first connection reads the files
            return False
        if pair.serial == self.client_serial:
            log.info("etcd client certificate reload: unchanged", serial=pair.serial)
            return False
        old, previous = self._channel, self.client_serial
        self._creds = pair.credentials()
        self.client_serial = pair.serial
        self._channel = self._new_channel(_target(self.settings.endpoints))
        self._kv = rpc.KVStub(self._channel)
        self._lease = rpc.LeaseStub(self._channel)
        self._watch = rpc.WatchStub(self._channel)
        if self._keeper is not None:
            self._keeper.switch(self._lease)
        task = asyncio.get_running_loop().create_task(self._retire(old, grace_s), name="etcd-old-channel")
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)
        log.info(
            "etcd client certificate reloaded",
            serial=pair.serial,
            previous=previous,
            old_channel_closes_in_s=grace_s,
        )
        return True

    async def _retire(self, channel: grpc.aio.Channel, grace_s: float) -> None:
        await asyncio.sleep(grace_s)
        await channel.close(None)
        log.info("etcd channel of the previous client certificate closed")

    async def close(self) -> None:
        for t in list(self._retiring):
            t.cancel()
        await asyncio.gather(*self._retiring, return_exceptions=True)
        if self._keeper is not None:
            await self._keeper.close()
        if self._channel is not None:
            await self._channel.close(None)
        self._channel = None

    async def _call(self, what: str, fn: Callable[[], Awaitable[T]], *, retry: bool = True) -> T:
        await self.connect()

        async def once() -> T:
            try:
                return await fn()
            except grpc.aio.AioRpcError as e:
                raise translate(e, what) from None
            except asyncio.CancelledError:
                if not channel_closed():
                    raise
                raise TemporaryError(
                    msg(
                        "store.etcd_its_channel_was",
                        "etcd {what}: its channel was closed (certificate reload)",
                        what=what,
                    ),
                    delay=0.05,
                ) from None

        observer = self.observer
        if observer is None:
            return await (once() if not retry else retry_until(once, self.settings.retry_deadline_s))
        t0 = time.perf_counter()
        failed = True
        try:
            out = await (once() if not retry else retry_until(once, self.settings.retry_deadline_s))
            failed = False
            return out
        finally:
            observer(what.split(" ", 1)[0], time.perf_counter() - t0, failed)

    @property
    def _timeout(self) -> float:
        return self.settings.request_timeout_s

    # ----------------------------------------------------------------- reads
    async def get(self, key: str) -> KV | None:
        """Read one key (linearizable). Idempotent; retried."""
        req = rpc.RangeRequest(key=key.encode())
        resp = await self._call(
            f"get {key}", lambda: self._kv.Range(req, timeout=self._timeout, metadata=_METADATA)
        )
        return _kv(resp.kvs[0]) if resp.kvs else None

    async def get_prefix(self, prefix: str, revision: int = 0) -> tuple[list[KV], int]:
        """Read every key under prefix at one revision (linearizable); returns (kvs, revision)."""
        req = rpc.RangeRequest(key=prefix.encode(), range_end=prefix_end(prefix), revision=revision)
        resp = await self._call(
            f"get prefix {prefix}", lambda: self._kv.Range(req, timeout=self._timeout, metadata=_METADATA)
        )
        return [_kv(m) for m in resp.kvs], int(resp.header.revision)

    async def get_range(
        self, start: str, end: bytes, limit: int = 0, revision: int = 0
    ) -> tuple[list[KV], int, bool]:
        """Read keys in [start, end) at one revision (0: the current one), at most `limit` (0: no
        limit), in key order (linearizable). Returns (kvs, header revision, more): the header names
        the current revision even when an older one was read. A revision older than
        etcd's compaction is refused with a PermanentError naming it. Idempotent; retried."""
        req = rpc.RangeRequest(key=start.encode(), range_end=end, limit=limit, revision=revision)
        resp = await self._call(
            f"get range {start}", lambda: self._kv.Range(req, timeout=self._timeout, metadata=_METADATA)
        )
        return [_kv(m) for m in resp.kvs], int(resp.header.revision), bool(resp.more)

    async def cluster_id(self) -> int:
        """The etcd cluster's id (changes when a cluster is restored from a backup as a new one)."""
        req = rpc.RangeRequest(key=b"/kunlun/", count_only=True)  # inside the prefix RBAC lets us read
        resp = await self._call(
            "cluster id", lambda: self._kv.Range(req, timeout=self._timeout, metadata=_METADATA)
        )
        return int(resp.header.cluster_id)

    async def revision(self) -> int:
        """The store's current revision."""
        # a key inside the cluster prefix: etcd's RBAC lets the replicas' user read nothing else
        req = rpc.RangeRequest(key=b"/kunlun/", count_only=True)
        resp = await self._call(
            "revision", lambda: self._kv.Range(req, timeout=self._timeout, metadata=_METADATA)
        )
        return int(resp.header.revision)

    # ----------------------------------------------------------------- writes
    async def put(self, key: str, value: bytes, lease: int = 0) -> int:
        """Unconditional write (not CAS); returns the revision. Retried (idempotent). Carries the
        current call's rider (`riders.py`) in the same transaction, if one waits."""
        op = PutOp(key, value, lease)
        rider = boarding([op])
        if rider is not None:
            resp = await self._carry(f"put {key}", [op], rider)
            return int(resp.header.revision)
        req = rpc.PutRequest(key=key.encode(), value=value, lease=lease)
        resp = await self._call(
            f"put {key}", lambda: self._kv.Put(req, timeout=self._timeout, metadata=_METADATA)
        )
        return int(resp.header.revision)

    async def delete(self, key: str, prefix: bool = False) -> int:
        """Delete a key (or a prefix); returns how many keys were deleted. Carries a waiting rider."""
        op = DeleteOp(key, prefix)
        rider = boarding([op])
        if rider is not None:
            resp = await self._carry(f"delete {key}", [op], rider)
            return int(resp.responses[0].response_delete_range.deleted)
        req = rpc.DeleteRangeRequest(key=key.encode(), range_end=prefix_end(key) if prefix else b"")
        resp = await self._call(
            f"delete {key}", lambda: self._kv.DeleteRange(req, timeout=self._timeout, metadata=_METADATA)
        )
        return int(resp.deleted)

    async def _carry(self, what: str, ops: list[Op], rider: Rider) -> Any:
        """An idempotent write and the rider's records in one unconditional transaction (retried:
        both are plain puts/deletes of fixed keys)."""
        req = rpc.TxnRequest(success=[_op(o) for o in [*ops, *rider.ops]])
        resp = await self._call(what, lambda: self._kv.Txn(req, timeout=self._timeout, metadata=_METADATA))
        rider.revision = int(resp.header.revision)
        return resp

    async def txn(
        self, compares: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()
    ) -> TxnResult:
        """ATOMIC compare-and-set: if every compare holds apply `success`, else `failure`.

        Single attempt (a timed-out transaction may have been applied; the caller re-reads).
        At most MAX_TXN_OPS operations per branch. A waiting rider (`riders.py`) joins the success
        branch when it writes: committed with it, or not at all.
        """
        if len(success) > MAX_TXN_OPS or len(failure) > MAX_TXN_OPS or len(compares) > MAX_TXN_OPS:
            raise PermanentError(
                msg(
                    "store.transaction_with_more_than",
                    "transaction with more than {max_txn_ops} operations (etcd's limit)",
                    max_txn_ops=MAX_TXN_OPS,
                )
            )
        rider = boarding(success)
        req = rpc.TxnRequest(
            compare=[_compare(c) for c in compares],
            success=[_op(o) for o in [*success, *(rider.ops if rider is not None else ())]],
            failure=[_op(o) for o in failure],
        )
        resp = await self._call(
            "txn", lambda: self._kv.Txn(req, timeout=self._timeout, metadata=_METADATA), retry=False
        )
        if rider is not None and resp.succeeded:
            rider.revision = int(resp.header.revision)
        reads = [
            [_kv(m) for m in r.response_range.kvs]
            for r in resp.responses
            if r.WhichOneof("response") == "response_range"
        ]
        return TxnResult(succeeded=bool(resp.succeeded), revision=int(resp.header.revision), reads=reads)

    async def create(self, key: str, value: bytes, lease: int = 0) -> TxnResult:
        """ATOMIC: write key only if it does not exist; on failure the result reads the current value."""
        return await self.txn([Compare.absent(key)], [PutOp(key, value, lease)], [GetOp(key)])

    # ----------------------------------------------------------------- leases
    async def lease_grant(self, ttl: int) -> int:
        """Grant a lease of ttl seconds; returns its id."""
        req = rpc.LeaseGrantRequest(TTL=ttl)
        resp = await self._call(
            "lease grant", lambda: self._lease.LeaseGrant(req, timeout=self._timeout, metadata=_METADATA)
        )
        if resp.error:
            raise TemporaryError(
                msg("store.etcd_lease_grant_failed", "etcd lease grant failed: {error}", error=resp.error)
            )
        return int(resp.ID)

    async def lease_keepalive(self, lease_id: int, timeout_s: float | None = None) -> int:
        """TIME-CRITICAL: refresh a lease once; returns its TTL. 0 means the lease is lost.

        One attempt bounded by `timeout_s` (default request_timeout_s); raises TemporaryError when
        etcd did not answer.
        """
        await self.connect()
        assert self._keeper is not None
        return await self._keeper.refresh(lease_id, timeout_s)

    async def lease_revoke(self, lease_id: int) -> None:
        """Revoke a lease (deletes its keys at once). A lease already gone is fine."""
        req = rpc.LeaseRevokeRequest(ID=lease_id)
        try:
            await self._call(
                "lease revoke",
                lambda: self._lease.LeaseRevoke(req, timeout=self._timeout, metadata=_METADATA),
            )
        except LeaseNotFound:
            pass

    async def lease_time_to_live(self, lease_id: int) -> int:
        """Remaining TTL of a lease in seconds; -1 if it does not exist."""
        req = rpc.LeaseTimeToLiveRequest(ID=lease_id)
        resp = await self._call(
            "lease ttl", lambda: self._lease.LeaseTimeToLive(req, timeout=self._timeout, metadata=_METADATA)
        )
        return int(resp.TTL)

    # ----------------------------------------------------------------- watches
    async def watch_prefix(self, prefix: str, start_revision: int) -> AsyncIterator[WatchEvent | Resync]:
        """Supervised watch of every key under prefix, from start_revision on. Never ends by itself.

        After any stream error it resumes from the last seen revision + 1 (with jittered backoff);
        a stream silent for watch_idle_timeout_s (a paused member) is re-opened. When etcd has
        compacted the revision it needs, it yields a Resync (the whole prefix, re-listed) and
        continues from there. Events arrive in revision order, none twice.
        """
        await self.connect()
        next_rev = start_revision
        attempt = 0
        while True:
            call = self._watch.Watch(metadata=_METADATA)
            try:
                await call.write(
                    rpc.WatchRequest(
                        create_request=rpc.WatchCreateRequest(
                            key=prefix.encode(),
                            range_end=prefix_end(prefix),
                            start_revision=next_rev,
                            progress_notify=True,
                        )
                    )
                )
                while True:
                    # asyncio.timeout, not wait_for: Python 3.11's wait_for can swallow a cancellation
                    async with asyncio.timeout(self.settings.watch_idle_timeout_s):
                        resp = await _read(call)
                    if resp is _EOF:
                        raise TemporaryError(msg("store.watch_stream_closed", "watch stream closed"))
                    attempt = 0
                    if resp.compact_revision:
                        log.warning(
                            "watch compacted; re-listing",
                            prefix=prefix,
                            needed=next_rev,
                            compacted=int(resp.compact_revision),
                        )
                        kvs, rev = await self.get_prefix(prefix)
                        next_rev = rev + 1
                        yield Resync(kvs, rev)
                        break
                    if resp.canceled:
                        raise TemporaryError(
                            msg(
                                "store.watch_canceled",
                                "watch canceled: {cancel_reason}",
                                cancel_reason=resp.cancel_reason,
                            )
                        )
                    # one transaction = several events at the same revision: skip only revisions
                    # delivered before this response, and move on once the whole response is out
                    first_new = next_rev
                    for ev in resp.events:
                        kv = _kv(ev.kv)
                        if kv.mod_revision < first_new:
                            continue
                        yield WatchEvent("delete" if ev.type == 1 else "put", kv)
                        next_rev = max(next_rev, kv.mod_revision + 1)
                    if not resp.events and resp.header.revision >= next_rev and not resp.created:
                        # progress notify: nothing under our prefix up to this revision
                        next_rev = int(resp.header.revision) + 1
            except (grpc.aio.AioRpcError, TemporaryError, TimeoutError) as e:
                delay = backoff_delay(attempt, 0.1, 2.0)
                attempt += 1
                log.info(
                    "watch interrupted; resuming",
                    prefix=prefix,
                    from_revision=next_rev,
                    error=str(e)[:200],
                    retry_in=round(delay, 2),
                )
                await asyncio.sleep(delay)
            finally:
                call.cancel()

    # ----------------------------------------------------------------- maintenance
    async def member_statuses(self) -> list[MemberStatus]:
        """Ask every configured endpoint for its status, each on its own channel (time-bounded)."""
        await self.connect()

        async def one(ep: str) -> MemberStatus:
            ch = self._new_channel(_target([ep]))
            try:
                m = rpc.MaintenanceStub(ch)
                st = await m.Status(rpc.StatusRequest(), timeout=self._timeout)
                members = await rpc.ClusterStub(ch).MemberList(rpc.MemberListRequest(), timeout=self._timeout)
                me = int(st.header.member_id)
                name = next((mm.name for mm in members.members if int(mm.ID) == me), "")
                errors = "; ".join(st.errors)
                return MemberStatus(
                    ep, name, me, not errors and st.leader != 0, st.leader == me, int(st.dbSize), errors
                )
            except grpc.aio.AioRpcError as e:
                return MemberStatus(ep, "", 0, False, False, 0, f"{e.code().name}: {e.details()}")
            finally:
                await ch.close(None)

        return list(await asyncio.gather(*(one(ep) for ep in self.settings.endpoints)))

    async def compact(self, revision: int) -> None:
        req = rpc.CompactionRequest(revision=revision, physical=False)
        await self._call("compact", lambda: self._kv.Compact(req, timeout=self._timeout, metadata=_METADATA))
