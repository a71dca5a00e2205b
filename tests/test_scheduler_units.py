"""One tick's decisions never name a key twice (etcd refuses such a transaction, and two decisions
built from the same record must not both commit)."""

from __future__ import annotations

from controlplane.scheduler.actions import Unit, disjoint, pack, unit_keys
from controlplane.store import Compare, DeleteOp, Op, PutOp


def _unit(what: str, *keys: str) -> Unit:
    ops: list[Op] = [PutOp(k, b"x") for k in keys[1:]]
    ops.append(DeleteOp(keys[0]))
    return Unit(what, [Compare.absent(keys[0])], ops)


def test_a_later_decision_on_a_taken_key_is_deferred() -> None:
    release = _unit("release i1 (spec updated)", "/i/1", "/alloc/a")
    drain = _unit("move i1 off drained node", "/i/1", "/alloc/b")
    other = _unit("place i2", "/i/2", "/alloc/c")
    kept, deferred = disjoint([release, drain, other])
    assert [u.what for u in kept] == ["release i1 (spec updated)", "place i2"]
    assert [u.what for u in deferred] == ["move i1 off drained node"]


def test_no_packed_transaction_names_a_key_twice() -> None:
    units = [_unit(f"u{i}", f"/i/{i % 7}", f"/alloc/{i}") for i in range(40)]
    kept, _ = disjoint(units)
    for batch in pack(kept, limit=10):
        seen: list[str] = [k for u in batch for k in sorted(unit_keys(u))]
        assert len(seen) == len(set(seen))
    assert len(kept) == 7
