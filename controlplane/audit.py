"""The audit log: one etcd record per change made (or refused) through the API, its reader, and
the retention bound the leader enforces.

| key                                    | written by                  | value (JSON)                     |
|----------------------------------------|-----------------------------|----------------------------------|
| audit/api/<ms>-<replica>-<n>           | the `@rpc` wrapper (any replica): in the change's transaction, else after the call | {"schema","at_ms","identity","action","object","result","replica","serial"} |
| audit/package-trust/<ms>-<key id>-<op> | PackageService, in the change's own transaction | {"schema","op","key_id","name","by","at_ms"} |

Which calls: every unary RPC whose role entry is the operators' (WRITERS in controlplane/api/auth.py),
whatever its outcome, so a viewer's refused attempt is on record too; reads are not audited. Only
identity, action, object and result are kept: never a request body, so no secret reaches the log.

The record of a change is committed in the change's own etcd transaction (controlplane/store/
riders.py): the first write the handler makes carries it, so the record exists if and only if the
change committed, at the same revision, with result OK; a replica dying at any point cannot split
them. A call that changed nothing (refused, invalid, failed before writing) gets its record after
the call, with the status it ended with; a call that committed and then failed gets a second
record with that status. Add/RemoveTrustedKey and SetPackagePolicy write their own record (the
package-trust form) in their transaction, so the wrapper skips them.

Retention: the leader deletes records older than `max_age_days` and the oldest beyond
`max_records`, every `prune_interval_s` (`prune`).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import structlog
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from controlplane import keys
from controlplane.store import EtcdStore
from controlplane.store.contract import MAX_TXN_OPS, DeleteOp, PutOp
from controlplane.store.riders import Rider
from kunlun_common.api import security_pb2
from kunlun_common.clock import now_ms
from kunlun_common.errors import KunlunError

log = structlog.get_logger("audit")
API = keys.AUDIT + "api/"
PACKAGE_TRUST = keys.AUDIT + "package-trust/"
AUDITED_IN_TXN = frozenset({"AddTrustedKey", "RemoveTrustedKey", "SetPackagePolicy"})
"""Methods that write their own audit record in the change's transaction."""
OBJECT_FIELDS = ("name", "node", "id", "key_id", "workload", "workload_name", "serial", "digest")
"""Request fields that name what a call is about, in order of preference (one level deep too)."""
MAX_LIST = 10_000


@dataclass(frozen=True)
class AuditSettings:
    """Retention of the audit log (enforced by the leader)."""

    max_records: int = 10_000
    """Most records kept; the oldest beyond this are deleted."""
    max_age_days: float = 90.0
    """Records older than this are deleted."""
    prune_interval_s: float = 60.0
    """How often the leader enforces the two bounds."""


def object_of(request: Message) -> str:
    """What a request names: the first non-empty field of OBJECT_FIELDS, at top level or inside a
    message field (e.g. `spec.name`); empty when none."""
    found = _named(request)
    for fd in request.DESCRIPTOR.fields:
        if found:
            break
        if fd.type == FieldDescriptor.TYPE_MESSAGE:
            try:
                present = request.HasField(fd.name)
            except ValueError:  # repeated fields and maps have no presence
                continue
            if present:
                found = _named(getattr(request, fd.name))
    return found


def _named(msg: Message) -> str:
    names = {fd.name for fd in msg.DESCRIPTOR.fields}
    for f in OBJECT_FIELDS:
        value = getattr(msg, f) if f in names else None
        if isinstance(value, str) and value:
            return value[:256]
    return ""


class AuditLog:
    """Writes the wrapper's records (one replica's writer)."""

    def __init__(self, store: EtcdStore, replica: str) -> None:
        self.store = store
        self.replica = replica
        self._seq = itertools.count()

    def _record(self, action: str, identity: str, serial: str, obj: str, result: str) -> tuple[str, bytes]:
        at = now_ms()
        rec = {
            "at_ms": at,
            "identity": identity,
            "action": action,
            "object": obj,
            "result": result,
            "replica": self.replica,
            "serial": serial,
        }
        return f"{API}{at:013d}-{self.replica}-{next(self._seq):06d}", keys.encode(rec)

    def rider(self, action: str, identity: str, serial: str, obj: str) -> Rider:
        """The record of a change (result OK), to commit in the change's own transaction."""
        key, value = self._record(action, identity, serial, obj, "OK")
        return Rider((PutOp(key, value),))

    async def record(self, action: str, identity: str, serial: str, obj: str, result: str) -> None:
        """Write one record on its own; a failure is logged, never raised."""
        key, value = self._record(action, identity, serial, obj, result)
        try:
            await asyncio.wait_for(self.store.put(key, value), 5.0)
        except (KunlunError, TimeoutError) as e:
            log.warning("audit record not written", action=action, identity=identity, error=str(e)[:200])


def entry_of(raw: bytes) -> security_pb2.AuditEntry | None:
    """An audit record (either form) as an entry; None for a record that cannot be read."""
    try:
        d = keys.decode(raw)
    except ValueError:
        return None
    if "action" in d:
        return security_pb2.AuditEntry(
            at_unix_ms=int(d.get("at_ms", 0)),
            identity=str(d.get("identity", "")),
            action=str(d["action"]),
            object=str(d.get("object", "")),
            result=str(d.get("result", "")),
            replica=str(d.get("replica", "")),
            serial=str(d.get("serial", "")),
        )
    if "op" in d and "key_id" in d:  # PackageService's own records
        return security_pb2.AuditEntry(
            at_unix_ms=int(d.get("at_ms", 0)),
            identity=str(d.get("by", "")),
            action="AddTrustedKey" if d["op"] == "add" else "RemoveTrustedKey",
            object=str(d["key_id"]),
            result="OK",
        )
    return None


def matches(e: security_pb2.AuditEntry, req: security_pb2.ListAuditRequest) -> bool:
    if req.since_unix_ms and e.at_unix_ms < req.since_unix_ms:
        return False
    if req.identity and req.identity not in (e.identity, e.identity.partition(":")[2]):
        return False
    return not req.object or e.object == req.object


async def read_all(store: EtcdStore) -> list[tuple[str, security_pb2.AuditEntry]]:
    """Every readable record as (key, entry), oldest first."""
    kvs, _ = await store.get_prefix(keys.AUDIT)
    out = []
    for kv in kvs:
        e = entry_of(kv.value)
        if e is not None:
            out.append((kv.key, e))
    out.sort(key=lambda ke: (ke[1].at_unix_ms, ke[0]))
    return out


async def query(store: EtcdStore, req: security_pb2.ListAuditRequest) -> list[security_pb2.AuditEntry]:
    """The newest `req.limit` entries (default 1000) that match the filters, oldest first."""
    limit = req.limit if 0 < req.limit <= MAX_LIST else 1000
    found = [e for _, e in await read_all(store) if matches(e, req)]
    return found[-limit:]


def to_prune(entries: Iterable[tuple[str, int]], settings: AuditSettings, now: int) -> list[str]:
    """Keys to delete from (key, at_ms) pairs: older than the age bound, then the oldest beyond
    the count bound. Pure, for tests."""
    ordered = sorted(entries, key=lambda ka: (ka[1], ka[0]))
    cutoff = now - int(settings.max_age_days * 86_400_000)
    old = [k for k, at in ordered if at < cutoff]
    kept = [k for k, at in ordered if at >= cutoff]
    excess = max(0, len(kept) - settings.max_records)
    return old + kept[:excess]


async def prune(store: EtcdStore, settings: AuditSettings, now: int | None = None) -> int:
    """Enforce the retention bounds once; return how many records were deleted."""
    kvs, _ = await store.get_prefix(keys.AUDIT)
    pairs: list[tuple[str, int]] = []
    for kv in kvs:
        e = entry_of(kv.value)
        pairs.append((kv.key, e.at_unix_ms if e is not None else 0))
    doomed = to_prune(pairs, settings, now_ms() if now is None else now)
    for i in range(0, len(doomed), MAX_TXN_OPS):
        await store.txn([], [DeleteOp(k) for k in doomed[i : i + MAX_TXN_OPS]], [])
    return len(doomed)


async def retention_loop(store: EtcdStore, settings: AuditSettings, *_: Any) -> None:
    """Leader-only: enforce the bounds every `prune_interval_s` (logs what it deleted)."""
    while True:
        try:
            deleted = await prune(store, settings)
            if deleted:
                log.info("audit retention", deleted=deleted, max_records=settings.max_records)
        except KunlunError as e:
            log.warning("audit retention failed; retrying next round", error=str(e)[:200])
        await asyncio.sleep(settings.prune_interval_s)
