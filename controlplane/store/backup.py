"""Backing up and restoring the cluster's keys, as etcd's `kunlun-admin` user.

Why a consistent range read and not etcd's snapshot (Maintenance.Snapshot):
- a snapshot is restored member by member with `etcdutl snapshot restore` into new data folders,
  with every member stopped: host work on every etcd host, not a command. A range read is written
  back through the normal client API into any empty cluster, from one place;
- a snapshot brings back what must not come back: leases and the keys bound to them (the leader
  key, replica and gateway records, node liveness), which would name processes that no longer
  exist until their leases expire, and etcd's own users and roles;
- the read is one revision of the whole `/kunlun/` prefix (the first page fixes the revision, the
  next pages ask for the same one), so it is as consistent as a snapshot of our keys.

What is never restored (`RestorePolicy.never`): every key bound to a lease and the election keys.
The restored cluster elects a leader afresh; replicas re-register; agents reconnect and their
replicas write new liveness keys; node readiness and instance placement are re-established by
the new leader's loops (graces count from the new term, so instances whose agents come back in
time stay where they are, the others are placed again).

Order: keys are written in the order of their original create revisions, in transactions of at
most 128 puts; the keys of `RestorePolicy.ordered` prefixes (workloads: the scheduler's queue orders
their new instances by the workload's create revision) never share a transaction with another of
their kind created at another revision, so their create-revision order and ties survive exactly.
The revisions themselves are new.

Revisions: a fresh cluster starts its revisions at 1, behind the backup's. Agents order assignment
sets by (etcd cluster id, revision), and a new cluster id resets that order; a fresh cluster that
would have the backed-up cluster's id (same member names, peer URLs and cluster token) is refused.
"""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import grpc
from aetcd import rpc

from controlplane.store.admin import admin_channel, enable_auth_async
from controlplane.store.backup_file import BackupHeader, Record
from controlplane.store.contract import MAX_TXN_OPS, prefix_end
from kunlun_common.errors import PermanentError, TemporaryError
from kunlun_common.messages import msg

T = TypeVar("T")
PAGE = 500
"""Keys per range request of the backup read."""

Progress = Callable[[int, int], None]
"""Called with (keys done, keys in all) as the work goes on."""


class RestoreRefused(PermanentError):
    """The target etcd cluster is not one a backup may be restored into (running, not empty, or
    with the backed-up cluster's id); the message says why and what to do."""


@dataclass(frozen=True)
class AdminTarget:
    """Where the etcd members are and the folder holding the `kunlun-admin` certificate."""

    endpoints: tuple[str, ...]
    """etcd client URLs (https://HOST:PORT); tried in turn."""
    cert_dir: Path
    """Holds `etcd-ca.crt` and `etcd-client/kunlun-admin.crt|key`."""
    timeout_s: float = 10.0
    """Deadline of one request."""


@dataclass(frozen=True)
class RestorePolicy:
    """Which keys a backup carries and which a restore writes back."""

    prefix: str
    """Everything under it is backed up (the replicas' etcd permission)."""
    never: tuple[str, ...]
    """Key prefixes never restored (per-process and per-term keys); leased keys never are either."""
    live: tuple[str, ...]
    """Key prefixes whose presence means replicas are running against the cluster."""
    ordered: tuple[str, ...] = ()
    """Key prefixes whose keys must keep the order and ties of their create revisions."""
    marker: str = ""
    """A key that exists while a restore writes (first written, deleted last): replicas wait while
    it exists, and a later restore knows the earlier one was interrupted."""


@dataclass(frozen=True)
class RestoreResult:
    written: int
    left_out: int
    cluster_id: str
    revision: int


def kunlun_version() -> str:
    try:
        return importlib.metadata.version("kunlun-platform")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


async def first_answering(
    target: AdminTarget, what: str, fn: Callable[[str, grpc.aio.Channel], Awaitable[T]]
) -> T:
    """Run `fn(endpoint, channel)` on the first member that answers (unavailable: the next one)."""
    errors: list[str] = []
    for ep in target.endpoints:
        async with admin_channel(ep, target.cert_dir) as ch:
            try:
                return await fn(ep, ch)
            except grpc.aio.AioRpcError as e:
                if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    errors.append(f"{ep}: {e.code().name}: {(e.details() or '')[:160]}")
                    continue
                raise PermanentError(
                    msg(
                        "backup.etcd_refused",
                        "etcd {ep} refused {what}: {name}: {details}",
                        ep=ep,
                        what=what,
                        name=e.code().name,
                        details=e.details(),
                    )
                ) from None
    raise TemporaryError(
        msg(
            "backup.no_etcd_member_answered",
            "no etcd member answered {what} ({items}); check --etcd-endpoints",
            what=what,
            items="; ".join(errors),
        )
    )


async def _read_at_one_revision(
    ch: grpc.aio.Channel, policy: RestorePolicy, request_s: float, progress: Progress
) -> tuple[BackupHeader, list[Record]]:
    kv = rpc.KVStub(ch)
    start, end = policy.prefix.encode(), prefix_end(policy.prefix)
    first = await kv.Range(rpc.RangeRequest(key=start, range_end=end, count_only=True), timeout=request_s)
    revision, total = int(first.header.revision), int(first.count)
    records: list[Record] = []
    skipped: dict[str, int] = {}
    done = 0
    while True:
        resp = await kv.Range(
            rpc.RangeRequest(key=start, range_end=end, revision=revision, limit=PAGE), timeout=request_s
        )
        for m in resp.kvs:
            key = m.key.decode()
            if m.lease:
                skipped["leased"] = skipped.get("leased", 0) + 1
            elif key.startswith(policy.never):
                skipped["never_restored"] = skipped.get("never_restored", 0) + 1
            else:
                records.append(
                    Record(key, bytes(m.value), int(m.create_revision), int(m.mod_revision), int(m.version))
                )
        done += len(resp.kvs)
        progress(done, total)
        if not resp.more or not resp.kvs:
            break
        start = resp.kvs[-1].key + b"\0"
    now = dt.datetime.now(dt.UTC)
    header = BackupHeader(
        revision=revision,
        cluster_id=f"{int(first.header.cluster_id):x}",
        taken_at=now.isoformat(timespec="seconds"),
        taken_at_ms=int(now.timestamp() * 1000),
        prefix=policy.prefix,
        keys=len(records),
        kunlun_version=kunlun_version(),
        skipped=skipped,
    )
    return header, records


async def take_backup(
    target: AdminTarget, policy: RestorePolicy, progress: Progress = lambda d, t: None
) -> tuple[BackupHeader, list[Record]]:
    """Read every key under the prefix at one revision (linearizable first read). A page whose
    revision was compacted meanwhile restarts the read at a newer revision (at most 3 times)."""
    for _ in range(3):
        try:
            return await first_answering(
                target,
                "the backup read",
                lambda ep, ch: _read_at_one_revision(ch, policy, target.timeout_s, progress),
            )
        except PermanentError as e:
            if "compacted" not in str(e):
                raise
    raise TemporaryError(
        msg(
            "backup.etcd_compacted_revision_being",
            "etcd compacted the revision being read three times in a row; run the backup again",
        )
    )


async def _inspect(
    ch: grpc.aio.Channel, policy: RestorePolicy, request_s: float
) -> tuple[int, int, int, list[str]]:
    """(cluster id, revision, keys under the prefix, live keys) of the target."""
    kv = rpc.KVStub(ch)
    start, end = policy.prefix.encode(), prefix_end(policy.prefix)
    resp = await kv.Range(rpc.RangeRequest(key=start, range_end=end, count_only=True), timeout=request_s)
    live: list[str] = []
    for p in policy.live:
        r = await kv.Range(
            rpc.RangeRequest(key=p.encode(), range_end=prefix_end(p), keys_only=True, limit=10),
            timeout=request_s,
        )
        live += [m.key.decode() for m in r.kvs]
    return int(resp.header.cluster_id), int(resp.header.revision), int(resp.count), live


async def _wipe(ch: grpc.aio.Channel, policy: RestorePolicy, request_s: float) -> None:
    """Revoke every lease bound to a key under the prefix, then delete the prefix."""
    kv, lease = rpc.KVStub(ch), rpc.LeaseStub(ch)
    start, end = policy.prefix.encode(), prefix_end(policy.prefix)
    leases: set[int] = set()
    while True:
        r = await kv.Range(
            rpc.RangeRequest(key=start, range_end=end, keys_only=True, limit=PAGE), timeout=request_s
        )
        leases |= {int(m.lease) for m in r.kvs if m.lease}
        if not r.more or not r.kvs:
            break
        start = r.kvs[-1].key + b"\0"
    for lid in leases:
        try:
            await lease.LeaseRevoke(rpc.LeaseRevokeRequest(ID=lid), timeout=request_s)
        except grpc.aio.AioRpcError as e:
            if "lease not found" not in (e.details() or ""):
                raise
    await kv.DeleteRange(rpc.DeleteRangeRequest(key=policy.prefix.encode(), range_end=end), timeout=request_s)


async def _keys_after(
    ch: grpc.aio.Channel, policy: RestorePolicy, request_s: float
) -> tuple[dict[str, bool], int]:
    """Every key under the prefix (whether bound to a lease), read page by page, and the revision
    of the first page."""
    kv = rpc.KVStub(ch)
    start, end = policy.prefix.encode(), prefix_end(policy.prefix)
    present: dict[str, bool] = {}
    revision = 0
    while True:
        r = await kv.Range(
            rpc.RangeRequest(key=start, range_end=end, keys_only=True, limit=PAGE, revision=revision),
            timeout=request_s,
        )
        revision = revision or int(r.header.revision)
        present.update({m.key.decode(): bool(m.lease) for m in r.kvs})
        if not r.more or not r.kvs:
            return present, revision
        start = r.kvs[-1].key + b"\0"


async def _exists(ch: grpc.aio.Channel, key: str, request_s: float) -> bool:
    r = await rpc.KVStub(ch).Range(rpc.RangeRequest(key=key.encode(), count_only=True), timeout=request_s)
    return int(r.count) > 0


def creation_batches(records: list[Record], ordered: tuple[str, ...] = ()) -> list[list[Record]]:
    """The keys in the order they were created, in transactions of at most MAX_TXN_OPS puts.

    Keys under an `ordered` prefix keep the order and the ties of their original create
    revisions exactly (the scheduler's queue orders a workload's new instances by the workload's
    create revision): a transaction never holds two of them with different original revisions.
    Every other key only keeps its rough place in that order (nothing compares their creation)."""
    batches: list[list[Record]] = [[]]
    ordered_rev = -1  # original create revision of the ordered keys in the open batch (-1: none)
    for r in sorted(records, key=lambda r: (r.create_revision, r.key)):
        is_ordered = r.key.startswith(ordered) if ordered else False
        if len(batches[-1]) >= MAX_TXN_OPS or (is_ordered and ordered_rev not in (-1, r.create_revision)):
            batches.append([])
            ordered_rev = -1
        if is_ordered:
            ordered_rev = r.create_revision
        batches[-1].append(r)
    return [b for b in batches if b]


def restorable(records: list[Record], policy: RestorePolicy) -> list[Record]:
    return [r for r in records if not r.key.startswith(policy.never)]


async def restore_backup(
    target: AdminTarget,
    header: BackupHeader,
    records: list[Record],
    policy: RestorePolicy,
    force: bool = False,
    progress: Progress = lambda d, t: None,
) -> RestoreResult:
    """Write a validated backup into the target cluster (see the module docstring for the rules).

    Refuses, before writing anything: a cluster with live replicas or with keys under the prefix
    (unless `force`: then its leases are revoked and the prefix deleted first), and a cluster whose
    id is the backed-up one's but whose revision is behind the backup's (never, even with force).
    Writes in transactions of at most MAX_TXN_OPS puts; running it again with `force` after an
    interruption is safe."""
    todo = restorable(records, policy)

    async def run(ep: str, ch: grpc.aio.Channel) -> RestoreResult:
        ep_timeout = target.timeout_s
        await enable_auth_async(ep, target.cert_dir, policy.prefix)
        cluster_id, revision, count, live = await _inspect(ch, policy, ep_timeout)
        if f"{cluster_id:x}" == header.cluster_id and revision < header.revision:
            raise RestoreRefused(
                msg(
                    "backup.target_etcd_cluster_has",
                    "the target etcd cluster has the backed-up cluster's id {cluster_id} but revision {revision}, behind the backup's {revision2}: agents would ignore its assignments as old; create the fresh etcd cluster with a new cluster token (ETCD_INITIAL_CLUSTER_TOKEN / --initial-cluster-token) and restore again",
                    cluster_id=header.cluster_id,
                    revision=revision,
                    revision2=header.revision,
                )
            )
        if live and not force:
            raise RestoreRefused(
                msg(
                    "backup.replicas_are_running_against",
                    "replicas are running against this etcd cluster ({items} exist): stop every kunlun-platform first (systemctl stop kunlun-platform), or pass --force to replace the running cluster's state (its replicas re-elect; agents reconnect)",
                    items=", ".join(live[:5]),
                )
            )
        interrupted = bool(policy.marker) and await _exists(ch, policy.marker, ep_timeout)
        if interrupted and not force:
            raise RestoreRefused(
                msg(
                    "backup.earlier_restore_into_this",
                    "an earlier restore into this etcd cluster did not finish ({marker} is still there): run the restore again with --force (what it wrote is deleted first); replicas wait meanwhile",
                    marker=policy.marker,
                )
            )
        if count and not force:
            raise RestoreRefused(
                msg(
                    "backup.target_etcd_cluster_already",
                    "the target etcd cluster already holds {count} keys under {prefix}: restore onto a fresh etcd cluster, or pass --force to delete them first (e.g. to finish an interrupted restore)",
                    count=count,
                    prefix=policy.prefix,
                )
            )
        if count:
            await _wipe(ch, policy, ep_timeout)
        kv = rpc.KVStub(ch)
        if policy.marker:
            mark = json.dumps(
                {
                    "schema": 1,
                    "started_at_ms": int(time.time() * 1000),
                    "backup_revision": header.revision,
                    "backup_cluster_id": header.cluster_id,
                }
            ).encode()
            await kv.Put(rpc.PutRequest(key=policy.marker.encode(), value=mark), timeout=ep_timeout)
        done = 0
        for batch in creation_batches(todo, policy.ordered):
            ops = [
                rpc.RequestOp(request_put=rpc.PutRequest(key=r.key.encode(), value=r.value)) for r in batch
            ]
            await kv.Txn(rpc.TxnRequest(success=ops), timeout=ep_timeout)
            done += len(batch)
            progress(done, len(todo))
        present, end_rev = await _keys_after(ch, policy, ep_timeout)
        # replicas still running (`--force` under them) write their own per-process keys meanwhile
        # (leased or under `never`): those are expected; any other key, or a restored one missing, is not
        wanted = {r.key for r in todo} | ({policy.marker} if policy.marker else set())
        unexpected = [
            k
            for k, leased in present.items()
            if k not in wanted and not leased and not k.startswith(policy.never)
        ]
        missing = sorted(wanted - present.keys())
        if unexpected or missing:
            raise TemporaryError(
                msg(
                    "backup.after_restore_etcd_holds_keys",
                    "after the restore etcd holds {count} keys under {prefix} that the backup does not have (e.g. {key}) and lacks {count2} that it wrote (e.g. {key2}): something else wrote meanwhile; run the restore again with --force",
                    count=len(unexpected),
                    prefix=policy.prefix,
                    key=(unexpected or ["-"])[0],
                    count2=len(missing),
                    key2=(missing or ["-"])[0],
                )
            )
        if policy.marker:  # the last write: replicas may start
            end_rev = int(
                (
                    await kv.DeleteRange(
                        rpc.DeleteRangeRequest(key=policy.marker.encode()), timeout=ep_timeout
                    )
                ).header.revision
            )
        return RestoreResult(len(todo), len(records) - len(todo), f"{cluster_id:x}", end_rev)

    return await first_answering(target, "the restore", run)
