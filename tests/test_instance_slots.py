"""At most one live instance per ordinal, now that instance ids are unique per incarnation.

Ids carry the revision of the snapshot a decision was made from, so two decisions from different
snapshots name different ids and `Compare.absent` on the instance key no longer collides. The
ordinal's slot key is the guard: these tests commit the scheduler's own units to a real etcd."""

from __future__ import annotations

import uuid

from controlplane import keys
from controlplane.scheduler.actions import create_instance, remove_instance
from controlplane.store import EtcdStore
from controlplane.store.contract import KV
from kunlun_common.api import workload_pb2


async def _commit(store: EtcdStore, unit: object) -> bool:
    from controlplane.scheduler.actions import Unit

    assert isinstance(unit, Unit)
    return (await store.txn(unit.compares, unit.ops)).succeeded


async def test_a_stale_snapshot_cannot_create_a_second_instance_of_an_ordinal(store: EtcdStore) -> None:
    wid = f"w-{uuid.uuid4().hex[:10]}"
    w = workload_pb2.Workload(id=wid, generation=1, spec=workload_pb2.WorkloadSpec(name=wid, replicas=1))
    wkv = KV(keys.workload(wid), b"", 3, 3, 1, 0)
    first = create_instance(w, wkv, 0, "r1", revision=100)
    assert await _commit(store, first)
    # a later tick whose snapshot missed that creation (another revision, so another id)
    again = create_instance(w, wkv, 0, "r1", revision=104)
    assert again.what != first.what
    assert not await _commit(store, again)
    assert [kv.key for kv in (await store.get_prefix(keys.INSTANCES + wid))[0]] == [
        keys.instance(f"{wid}-0-100")
    ]
    # a canary of the same ordinal is another slot
    assert await _commit(store, create_instance(w, wkv, 0, "r1", revision=104, variant="canary"))


async def test_removal_frees_the_slot_for_a_new_incarnation(store: EtcdStore) -> None:
    wid = f"w-{uuid.uuid4().hex[:10]}"
    w = workload_pb2.Workload(id=wid, generation=1, spec=workload_pb2.WorkloadSpec(name=wid, replicas=1))
    wkv = KV(keys.workload(wid), b"", 3, 3, 1, 0)
    assert await _commit(store, create_instance(w, wkv, 0, "r1", revision=200))
    kv = await store.get(keys.instance(f"{wid}-0-200"))
    assert kv is not None
    inst = workload_pb2.Instance()
    keys.decode_message(kv.value, inst)
    assert await _commit(store, remove_instance(inst, kv, {}))
    assert await store.get(keys.instance_slot(wid, 0)) is None
    assert await _commit(store, create_instance(w, wkv, 0, "r1", revision=230))
    slot = await store.get(keys.instance_slot(wid, 0))
    assert slot is not None and keys.decode(slot.value)["instance"] == f"{wid}-0-230"
