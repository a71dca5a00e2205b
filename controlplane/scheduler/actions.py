"""Leader decisions as etcd transaction units, and packing them into fenced commits.

A unit is the compares and operations of one decision (create an instance, place it, release it,
...). Units are packed into transactions of at most MAX_TXN_OPS operations and compares (etcd's
limit counts each list separately; the fence adds one compare and one failure read), and each
transaction is committed through the leader's Fence: atomically, or not at all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from controlplane import keys
from controlplane.store.contract import KV, MAX_TXN_OPS, Compare, DeleteOp, Op, PutOp
from kunlun_common.api import workload_pb2
from kunlun_common.clock import now_ms
from kunlun_common.messages import Message, msg, to_stored
from kunlun_common.states import InstancePhase


@dataclass
class Unit:
    """The compares and operations of one decision, and what to log about it."""

    what: str
    compares: list[Compare] = field(default_factory=list)
    ops: list[Op] = field(default_factory=list)


def set_reason(inst: workload_pb2.Instance, reason: Message) -> None:
    """The instance's reason: its English text, and beside it the message clients translate."""
    inst.reason, inst.reason_message = str(reason), to_stored(reason)


def _history(inst: workload_pb2.Instance, phase: str, by: str) -> None:
    inst.history.append(
        workload_pb2.PhaseEvent(
            phase=phase, at_unix_ms=now_ms(), by=by, reason=inst.reason, reason_message=inst.reason_message
        )
    )
    del inst.history[:-50]  # bounded history


def event(inst: workload_pb2.Instance, phase: str, by: str, reason: Message) -> None:
    inst.phase = phase
    set_reason(inst, reason)
    _history(inst, phase, by)


MAX_TXN_BYTES = 512 * 1024  # well under etcd's default --max-request-bytes (1.5 MiB)


def _size(u: Unit) -> int:
    return sum(len(o.key) + len(getattr(o, "value", b"")) + 16 for o in u.ops) + 48 * len(u.compares)


def unit_keys(u: Unit) -> set[str]:
    """Every key a unit compares or writes."""
    return {c.key for c in u.compares} | {o.key for o in u.ops}


def disjoint(units: list[Unit]) -> tuple[list[Unit], list[Unit]]:
    """Keep the first unit for every key; defer the later ones that touch a key already taken.

    One tick can reach the same instance twice (a spec update releases it while a drain moves it);
    etcd refuses a transaction that names a key twice, and two decisions built from the same record
    must not both commit. A deferred unit is recomputed on the next tick from the new state.
    """
    taken: set[str] = set()
    kept: list[Unit] = []
    deferred: list[Unit] = []
    for u in units:
        ks = unit_keys(u)
        if ks & taken:
            deferred.append(u)
            continue
        taken |= ks
        kept.append(u)
    return kept, deferred


def pack(units: list[Unit], limit: int = MAX_TXN_OPS - 1, max_bytes: int = MAX_TXN_BYTES) -> list[list[Unit]]:
    """Greedy packing of units into transactions within etcd's per-list limit and request size."""
    batches: list[list[Unit]] = []
    cur: list[Unit] = []
    n_cmp = n_ops = n_bytes = 0
    for u in units:
        size = _size(u)
        if cur and (
            n_cmp + len(u.compares) > limit or n_ops + len(u.ops) > limit or n_bytes + size > max_bytes
        ):
            batches.append(cur)
            cur, n_cmp, n_ops, n_bytes = [], 0, 0, 0
        cur.append(u)
        n_cmp += len(u.compares)
        n_ops += len(u.ops)
        n_bytes += size
    if cur:
        batches.append(cur)
    return batches


def instance_id(workload_id: str, ordinal: int, revision: int, variant: str = "") -> str:
    """`<workload id>-<ordinal>-<revision>` (a canary: `-c<ordinal>-`), unique per incarnation.

    `revision` is the etcd revision of the snapshot the decision was made from. An ordinal whose
    instance was removed and is wanted again gets a new id, because the removal itself raised the
    revision: the old instance's engine, possibly still stopping on a node cut off from the
    cluster, and the new one are two instances, never "one instance running twice". Since ids
    differ between snapshots, the guard against two live instances of one ordinal (a tick deciding
    from a snapshot that missed its own last creation) is the ordinal's slot key: creation needs it
    absent and writes it, removal deletes it (`keys.instance_slot`)."""
    return f"{workload_id}-{'c' if variant else ''}{ordinal}-{revision}"


def create_instance(
    w: workload_pb2.Workload,
    w_kv: KV,
    ordinal: int,
    by: str,
    revision: int,
    variant: str = "",
    successor: bool = False,
) -> Unit:
    """A Pending instance named by `instance_id`. A `successor` (rolling update) lives beside the old
    instance of its ordinal: it holds the ordinal's slot for its generation (`.../<n>/g<generation>`),
    so one successor per ordinal and generation, whatever snapshot a tick decided from."""
    inst = workload_pb2.Instance(
        id=instance_id(w.id, ordinal, revision, variant),
        workload_id=w.id,
        workload=w.spec.name,
        ordinal=ordinal,
        seq=w_kv.create_revision * 10000 + ordinal + (5000 if variant else 0),
        enqueued_at_unix_ms=now_ms(),
        generation=w.generation,
        variant=variant,
    )
    slot = keys.instance_slot(w.id, ordinal, variant)
    if successor:
        slot = inst.slot = f"{slot}/g{w.generation}"
    event(inst, InstancePhase.PENDING, by, msg("instance.waiting", "waiting for placement"))
    key = keys.instance(inst.id)
    return Unit(
        f"create {inst.id}",
        [Compare.absent(key), Compare.absent(slot)],
        [PutOp(key, keys.encode_message(inst)), PutOp(slot, keys.encode({"instance": inst.id}))],
    )


def _free_allocs(
    inst: workload_pb2.Instance, allocs: dict[str, tuple[str, KV]]
) -> tuple[list[Compare], list[Op]]:
    cmps: list[Compare] = []
    ops: list[Op] = []
    for dev in inst.target_devices:
        held = allocs.get(dev)
        if held and held[0] == inst.id:
            cmps.append(Compare.unchanged(held[1].key, held[1].mod_revision))
            ops.append(DeleteOp(held[1].key))
    return cmps, ops


def remove_instance(inst: workload_pb2.Instance, kv: KV, allocs: dict[str, tuple[str, KV]]) -> Unit:
    cmps, ops = _free_allocs(inst, allocs)
    return Unit(
        f"remove {inst.id}",
        [Compare.unchanged(kv.key, kv.mod_revision), *cmps],
        [
            DeleteOp(kv.key),
            DeleteOp(keys.instance_status(inst.id)),
            DeleteOp(inst.slot or keys.instance_slot(inst.workload_id, inst.ordinal, inst.variant)),
            *ops,
        ],
    )


def release_instance(
    inst: workload_pb2.Instance, kv: KV, allocs: dict[str, tuple[str, KV]], by: str, reason: Message
) -> Unit:
    """Back to the queue (rescheduling, preemption, spec change): free its devices in the same commit."""
    cmps, ops = _free_allocs(inst, allocs)
    new = workload_pb2.Instance()
    new.CopyFrom(inst)
    new.node = ""
    del new.target_devices[:]
    new.endpoint = ""
    new.enqueued_at_unix_ms = now_ms()
    event(new, InstancePhase.PENDING, by, reason)
    return Unit(
        f"release {inst.id}: {reason}",
        [Compare.unchanged(kv.key, kv.mod_revision), *cmps],
        [PutOp(kv.key, keys.encode_message(new)), DeleteOp(keys.instance_status(inst.id)), *ops],
    )


def place_instance(
    inst: workload_pb2.Instance,
    kv: KV,
    node: str,
    devices: tuple[str, ...],
    by: str,
    generation: int,
    allocs: dict[str, tuple[str, KV]] | None = None,
    reason: Message | None = None,
    spec: workload_pb2.WorkloadSpec | None = None,
) -> Unit:
    """Place (or move, when `allocs` holds its old allocations): each new device must still be free.

    `spec`: the spec it is placed with, recorded on the instance (replicas cleared) so that it keeps
    running it through later spec changes until a rolling update replaces it; None keeps its own."""
    old_cmps: list[Compare] = []
    old_ops: list[Op] = []
    if allocs is not None:
        old_cmps, old_ops = _free_allocs(inst, allocs)
    new = workload_pb2.Instance()
    new.CopyFrom(inst)
    new.node = node
    del new.target_devices[:]
    new.target_devices.extend(devices)
    new.unplaced_reasons.clear()
    new.generation = generation
    if spec is not None:
        new.spec.CopyFrom(spec)
        new.spec.ClearField("replicas")
    event(
        new,
        InstancePhase.SCHEDULED,
        by,
        reason or msg("instance.placed", "placed on {devices}", devices=", ".join(devices)),
    )
    alloc_value = keys.encode({"instance": inst.id, "workload": inst.workload_id, "at_ms": now_ms()})
    return Unit(
        f"place {inst.id} on {','.join(devices)}",
        [
            Compare.unchanged(kv.key, kv.mod_revision),
            *old_cmps,
            *(Compare.absent(keys.alloc(d)) for d in devices),
        ],
        [
            PutOp(kv.key, keys.encode_message(new)),
            *old_ops,
            *(PutOp(keys.alloc(d), alloc_value) for d in devices),
        ],
    )


def retire_instance(inst: workload_pb2.Instance, kv: KV, by: str, reason: Message) -> Unit:
    """Take a serving instance out of routing (a rolling update); its engine runs until removal."""
    new = workload_pb2.Instance()
    new.CopyFrom(inst)
    new.retiring = True
    set_reason(new, reason)
    _history(new, new.phase, by)
    return Unit(
        f"retire {inst.id}",
        [Compare.unchanged(kv.key, kv.mod_revision)],
        [PutOp(kv.key, keys.encode_message(new))],
    )


def note_unplaced(
    inst: workload_pb2.Instance,
    kv: KV,
    reasons: dict[str, str],
    reason: str,
    message: Callable[[], Message],
) -> Unit | None:
    """Record why an instance is not placed (only when that changed): `reason` is the English text,
    `message` makes it as a message (only when it is written: most ticks change nothing)."""
    if dict(inst.unplaced_reasons) == reasons and inst.reason == reason:
        return None
    new = workload_pb2.Instance()
    new.CopyFrom(inst)
    new.unplaced_reasons.clear()
    new.unplaced_reasons.update(reasons)
    m = message()
    new.reason = reason
    new.reason_message = to_stored(m) if str(m) == reason else ""
    return Unit(
        f"unplaced {inst.id}",
        [Compare.unchanged(kv.key, kv.mod_revision)],
        [PutOp(kv.key, keys.encode_message(new))],
    )
