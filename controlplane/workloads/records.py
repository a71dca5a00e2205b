"""Reading and writing workload goal state in etcd (API side) and deriving workload phases."""

from __future__ import annotations

import uuid

from controlplane import keys
from controlplane.store import KV, Compare, EtcdStore, PutOp
from controlplane.workloads.spec import same_engine_spec, spec_json
from kunlun_common.api import workload_pb2
from kunlun_common.clock import now_ms
from kunlun_common.errors import NotFoundError, PermanentError, TemporaryError
from kunlun_common.messages import msg
from kunlun_common.states import PLACED, InstancePhase, WorkloadChange, WorkloadPhase


class NotFound(NotFoundError):
    """No workload by that name or id."""


class Conflict(TemporaryError):
    """Someone else changed the record first; re-read and retry."""


MAX_HISTORY = 50
"""Workload history entries kept (older ones are counted per phase in `history_dropped`)."""
MAX_RECORD_BYTES = 1 << 20
"""Largest encoded workload record written (etcd refuses requests over 1.5 MiB by default)."""


def add_history(w: workload_pb2.Workload, event: workload_pb2.PhaseEvent) -> None:
    """Append an event, keeping the last MAX_HISTORY and counting the dropped ones per phase."""
    w.history.append(event)
    extra = len(w.history) - MAX_HISTORY
    if extra > 0:
        for old in w.history[:extra]:
            w.history_dropped[old.phase] = w.history_dropped.get(old.phase, 0) + 1
        del w.history[:extra]


def encode_checked(w: workload_pb2.Workload) -> bytes:
    """The record's bytes; PermanentError (naming the size and the limit) when it is too big to write."""
    data = keys.encode_message(w)
    if len(data) > MAX_RECORD_BYTES:
        raise PermanentError(
            msg(
                "workload.workload_record_would_bytes",
                "workload {name!r}: the record would be {count} bytes, over the {max_record_bytes}-byte limit; shorten the spec (env, engine_args) and submit again",
                name=w.spec.name,
                count=len(data),
                max_record_bytes=MAX_RECORD_BYTES,
            )
        )
    return data


def decode_workload(kv: KV) -> workload_pb2.Workload:
    w = workload_pb2.Workload()
    keys.decode_message(kv.value, w)
    return w


def decode_instance(kv: KV) -> workload_pb2.Instance:
    i = workload_pb2.Instance()
    keys.decode_message(kv.value, i)
    return i


async def resolve(store: EtcdStore, name_or_id: str) -> tuple[workload_pb2.Workload, KV]:
    """Find a workload by name or id."""
    kv = await store.get(keys.workload(name_or_id))
    if kv is None:
        ref = await store.get(keys.workload_name(name_or_id))
        if ref is not None:
            kv = await store.get(keys.workload(str(keys.decode(ref.value)["id"])))
    if kv is None:
        raise NotFound(
            msg(
                "workload.not_found",
                "workload {name!r} not found; see `kunlun-cli workload list`",
                name=name_or_id,
            )
        )
    return decode_workload(kv), kv


async def submit(
    store: EtcdStore, spec: workload_pb2.WorkloadSpec, who: str
) -> tuple[workload_pb2.Workload, str]:
    """Create or update a workload by name (idempotent). Returns (workload, created|updated|unchanged)."""
    for _ in range(5):
        ref = await store.get(keys.workload_name(spec.name))
        if ref is None:
            wid = "w-" + uuid.uuid4().hex[:10]
            w = workload_pb2.Workload(
                id=wid,
                spec=spec,
                generation=1,
                created_at_unix_ms=now_ms(),
                created_by=who,
                updated_by=who,
                history=[
                    workload_pb2.PhaseEvent(phase=WorkloadChange.SUBMITTED, at_unix_ms=now_ms(), by=who)
                ],
            )
            res = await store.txn(
                [Compare.absent(keys.workload_name(spec.name))],
                [
                    PutOp(keys.workload_name(spec.name), keys.encode({"id": wid})),
                    PutOp(keys.workload(wid), encode_checked(w)),
                ],
            )
            if res.succeeded:
                return w, "created"
            continue
        w, kv = await resolve(store, str(keys.decode(ref.value)["id"]))
        if w.deleting:
            raise PermanentError(
                msg(
                    "workload.being_deleted",
                    "workload {name!r} is being deleted; submit again once it is gone",
                    name=spec.name,
                )
            )
        if spec_json(w.spec) == spec_json(spec):
            return w, "unchanged"
        new_generation = not same_engine_spec(w.spec, spec)
        w.spec.CopyFrom(spec)
        w.updated_by = who
        if new_generation:  # replaced by a rolling update (controlplane/scheduler/rolling.py)
            w.generation += 1
        why = f"generation {w.generation}" if new_generation else "replicas/rolling settings only"
        add_history(
            w, workload_pb2.PhaseEvent(phase=WorkloadChange.UPDATED, at_unix_ms=now_ms(), by=who, reason=why)
        )
        res = await store.txn(
            [Compare.unchanged(kv.key, kv.mod_revision)], [PutOp(kv.key, encode_checked(w))]
        )
        if res.succeeded:
            return w, "updated"
    raise Conflict(
        msg(
            "workload.workload_changed_concurrently_retry",
            "workload {name!r} changed concurrently; retry",
            name=spec.name,
        )
    )


async def update(
    store: EtcdStore,
    name_or_id: str,
    change: str,
    who: str,
    *,
    replicas: int | None = None,
    delete: bool = False,
) -> workload_pb2.Workload:
    """Scale or mark for deletion (compare-and-set on the record)."""
    for _ in range(5):
        w, kv = await resolve(store, name_or_id)
        if replicas is not None:
            if w.spec.replicas == replicas:
                return w
            w.spec.replicas = replicas  # not a new generation: running instances stay where they are
        if delete:
            if w.deleting:
                return w
            w.deleting = True
        w.updated_by = who
        add_history(w, workload_pb2.PhaseEvent(phase=change, at_unix_ms=now_ms(), by=who))
        res = await store.txn(
            [Compare.unchanged(kv.key, kv.mod_revision)], [PutOp(kv.key, encode_checked(w))]
        )
        if res.succeeded:
            return w
    raise Conflict(
        msg(
            "workload.workload_changed_concurrently_retry_2",
            "workload {name_or_id!r} changed concurrently; retry",
            name_or_id=name_or_id,
        )
    )


async def cordon(store: EtcdStore, node: str, cordon: bool, drain: bool, who: str) -> bool:
    """Record a node's cordon (and drain) goal state; returns whether it is cordoned now."""
    if await store.get(keys.node(node)) is None:
        raise NotFoundError(
            msg(
                "node.not_registered",
                "node {node!r} is not registered; see `kunlun-cli node list`",
                node=node,
            )
        )
    cordoned = cordon or drain
    record = {"cordoned": cordoned, "drain": drain, "by": who, "at_ms": now_ms()}
    await store.put(keys.cordon(node), keys.encode(record))
    return cordoned


def workload_phase(w: workload_pb2.Workload, instances: list[workload_pb2.Instance]) -> WorkloadPhase:
    if w.deleting:
        return WorkloadPhase.DELETING
    if w.spec.replicas == 0:
        return WorkloadPhase.STOPPED
    live = [i for i in instances if i.phase != InstancePhase.STOPPED]
    if len(live) < w.spec.replicas:
        placed = [i for i in live if i.phase in PLACED]
        return WorkloadPhase.PENDING if not placed else WorkloadPhase.DEGRADED
    if all(i.phase == InstancePhase.RUNNING for i in live):
        return WorkloadPhase.RUNNING
    if all(i.phase in PLACED for i in live):
        return WorkloadPhase.SCHEDULED
    if any(i.phase == InstancePhase.FAILED for i in live):
        failed = all(i.phase == InstancePhase.FAILED for i in live)
        return WorkloadPhase.FAILED if failed else WorkloadPhase.DEGRADED
    if not any(i.phase in PLACED for i in live):
        return WorkloadPhase.PENDING
    return WorkloadPhase.DEGRADED
