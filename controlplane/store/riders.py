"""Records that ride in the transaction of a change: how an API call's audit record is committed
together with the change it records, or not at all.

The `@rpc` wrapper opens a `Rider` (the audit record as a put) around an operator call's handler
(`riding`). The first write the handler makes through the store (`put`, `delete`, `txn` with a
write in its success branch, `create`) carries the rider's operations in the same etcd
transaction: if the write commits, so does the record (same revision); if its compare fails or
it is not applied, neither is. The rider is then attached and later writes carry nothing. A
handler that writes nothing (refused, invalid input, a read) leaves the rider unattached, and the
wrapper writes the record of that outcome on its own afterwards.

The rider lives in a context variable, so it follows the handler into the tasks it starts; it is
closed when the handler returns, after which no write picks it up. Two concurrent writes of one
handler may both carry it: its keys are fixed when it is made, so that writes the same record twice.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field

from controlplane.store.contract import MAX_TXN_OPS, DeleteOp, Op, PutOp

_CURRENT: ContextVar[Rider | None] = ContextVar("kunlun_store_rider", default=None)


@dataclass
class Rider:
    """Operations to commit with the next write of the current call."""

    ops: tuple[PutOp, ...]
    revision: int = 0
    """The revision of the write that carried them (0: none yet)."""
    closed: bool = field(default=False)
    """Set when the call returned: no later write carries them."""

    @property
    def attached(self) -> bool:
        return self.revision > 0


@contextlib.contextmanager
def riding(rider: Rider | None) -> Iterator[Rider | None]:
    """Let the writes made inside the block carry `rider` (None: nothing rides)."""
    token = _CURRENT.set(rider)
    try:
        yield rider
    finally:
        if rider is not None:
            rider.closed = True
        _CURRENT.reset(token)


def boarding(success: Sequence[Op]) -> Rider | None:
    """The rider the write `success` should carry now, or None: no open unattached rider, no
    write among `success`, or no room left in the transaction (etcd's MAX_TXN_OPS)."""
    r = _CURRENT.get()
    if r is None or r.closed or r.attached or not r.ops:
        return None
    if not any(isinstance(o, (PutOp, DeleteOp)) for o in success):
        return None
    if len(success) + len(r.ops) > MAX_TXN_OPS:
        return None
    return r
