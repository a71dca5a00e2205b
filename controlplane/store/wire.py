"""Conversions between the store contract and etcd's wire types, and the meaning of etcd's errors
(which ones a retry can help with)."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from aetcd import rpc

from controlplane.store.contract import KV, Compare, DeleteOp, GetOp, Op, PutOp, prefix_end
from kunlun_common.errors import PermanentError, TemporaryError
from kunlun_common.messages import msg

_TEMPORARY_CODES = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.INTERNAL,
}
_CMP_RESULT = {"==": 0, ">": 1, "<": 2, "!=": 3}
_CMP_TARGET = {"version": 0, "create": 1, "mod": 2, "value": 3, "lease": 4}


class LeaseNotFound(PermanentError):
    """The lease expired or was revoked."""


def channel_closed() -> bool:
    """Whether a CancelledError just raised by a gRPC call means its channel was closed under it
    (grpc.aio raises CancelledError, not AioRpcError, there: `reload_credentials` closes the old
    channel) rather than a cancellation of the running task, which Task.cancelling() counts."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() == 0


async def _read(call: Any) -> Any:
    try:
        return await call.read()
    except asyncio.CancelledError:
        if not channel_closed():
            raise
        raise TemporaryError(
            msg(
                "store.wire.watch_stream_ended_its",
                "watch stream ended: its channel was closed (certificate reload)",
            )
        ) from None


def _kv(m: Any) -> KV:
    return KV(
        key=m.key.decode(),
        value=bytes(m.value),
        create_revision=int(m.create_revision),
        mod_revision=int(m.mod_revision),
        version=int(m.version),
        lease=int(m.lease),
    )


def translate(e: grpc.aio.AioRpcError, what: str) -> Exception:
    """Map a gRPC error from etcd onto TemporaryError / PermanentError with a clear message."""
    detail = e.details() or str(e.code())
    if "lease not found" in detail:
        return LeaseNotFound(msg("store.etcd", "etcd {what}: {detail}", what=what, detail=detail))
    if e.code() in _TEMPORARY_CODES or "no leader" in detail or "timed out" in detail:
        return TemporaryError(
            msg(
                "store.etcd_failed",
                "etcd {what} failed: {name}: {detail}",
                what=what,
                name=e.code().name,
                detail=detail,
            ),
            delay=0.2,
        )
    return PermanentError(
        msg(
            "store.etcd_refused",
            "etcd {what} refused: {name}: {detail}",
            what=what,
            name=e.code().name,
            detail=detail,
        )
    )


def _compare(c: Compare) -> Any:
    kw: dict[str, Any] = {
        "result": _CMP_RESULT[c.op],
        "target": _CMP_TARGET[c.target],
        "key": c.key.encode(),
    }
    field = {
        "version": "version",
        "create": "create_revision",
        "mod": "mod_revision",
        "value": "value",
        "lease": "lease",
    }[c.target]
    kw[field] = c.value
    return rpc.Compare(**kw)


def _op(o: Op) -> Any:
    if isinstance(o, PutOp):
        return rpc.RequestOp(request_put=rpc.PutRequest(key=o.key.encode(), value=o.value, lease=o.lease))
    if isinstance(o, DeleteOp):
        end = prefix_end(o.key) if o.prefix else b""
        return rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=o.key.encode(), range_end=end))
    if isinstance(o, GetOp):
        end = prefix_end(o.key) if o.prefix else b""
        return rpc.RequestOp(request_range=rpc.RangeRequest(key=o.key.encode(), range_end=end))
    raise PermanentError(msg("store.unknown_op", "unknown op {o!r}", o=o))
