"""The one wrapper every RPC handler of a replica goes through.

`@rpc` (unary answers) and `@rpc_stream` (server or bidirectional streams) do, for every call:

1. authorize the caller by the method's full name (`/<Servicer.SERVICE>/<handler name>`) against
   the single role table, `controlplane/api/auth.py` PERMISSIONS (default deny); the handler receives
   the caller's identity as its third argument;
2. map the domain errors the handler (or the domain modules it calls) raises to gRPC status codes,
   once, with `STATUS_OF` below; the message goes to the client unchanged, so it names the field
   and the fix. An error raised with a `Message` (`raise NotFoundError(msg("id", "template", ...))`)
   also sends its stable id and values in the trailing metadata, which kunlun-cli shows in its
   reader's language (kunlun_common/messages.py); the details stay the English text. Anything else propagates (gRPC answers UNKNOWN and logs it), and so does an abort
   the handler made itself.

Every unary call is also timed and counted by method and final status code through the servicer's
`observe_call` (the replica's `kunlun_api_request_duration_seconds`, controlplane/metrics.py);
streams are not timed (they live as long as their client).

Handlers therefore validate by raising `InvalidInput`, `NotFoundError`, ... and never catch to
translate. A new RPC: its line in PERMISSIONS, then a decorated method on its servicer.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn, TypeVar

import grpc
from google.protobuf import empty_pb2
from google.protobuf.message import Message

from controlplane.api.auth import Ctx, abort, authorize
from controlplane.store.riders import Rider, riding
from kunlun_common.errors import (
    ConcurrentChange,
    ConfigError,
    InvalidInput,
    KunlunError,
    NotFoundError,
    PermanentError,
    PermissionRefused,
    TemporaryError,
)
from kunlun_common.messages import msg
from kunlun_common.tls import Identity

if TYPE_CHECKING:
    from controlplane.api.drain import DrainState
    from controlplane.api.guard import CallGuard

STATUS_OF: tuple[tuple[type[Exception], grpc.StatusCode], ...] = (
    (InvalidInput, grpc.StatusCode.INVALID_ARGUMENT),
    (ConfigError, grpc.StatusCode.INVALID_ARGUMENT),  # a spec or config text the caller sent
    (NotFoundError, grpc.StatusCode.NOT_FOUND),
    (PermissionRefused, grpc.StatusCode.PERMISSION_DENIED),
    (ConcurrentChange, grpc.StatusCode.ABORTED),
    (TemporaryError, grpc.StatusCode.UNAVAILABLE),  # retrying can help
    (PermanentError, grpc.StatusCode.FAILED_PRECONDITION),  # the state or the input must change
)
"""Domain error -> status code; the first matching class wins (subclasses before their bases)."""


def status_of(e: BaseException) -> grpc.StatusCode | None:
    """The status code a domain error maps to; None for anything else."""
    for cls, code in STATUS_OF:
        if isinstance(e, cls):
            return code
    return None


async def fail(context: Ctx, e: Exception) -> NoReturn:
    """Abort the call with the status of domain error `e`; re-raise anything else."""
    code = status_of(e)
    if code is None:
        raise e
    localizable = e.localizable if isinstance(e, KunlunError) else None
    await abort(context, code, localizable if localizable is not None else str(e))


class Servicer:
    """Base of the replicas' servicers: names the gRPC service their handlers belong to."""

    SERVICE: ClassVar[str]
    """The full service name, e.g. "kunlun.v1.WorkloadService"."""
    observe_call: Callable[[str, str, float], None] | None = None
    """Told (method, status code name, seconds) after every unary call; the replica's API metrics."""
    guard: CallGuard | None = None
    """Revocation check, certificate inventory and audit (controlplane/api/guard.py); None in unit
    tests that serve a servicer alone."""
    drain: DrainState | None = None
    """The replica's drain (controlplane/api/drain.py): once it begins, streams end with UNAVAILABLE
    so that agents and gateways reconnect to another replica; None in unit tests."""

    def method(self, name: str) -> str:
        """The full method name of handler `name`, as PERMISSIONS lists it."""
        return f"/{self.SERVICE}/{name}"


S = TypeVar("S", bound=Servicer)
Req = TypeVar("Req")
Resp = TypeVar("Resp")


def rpc(
    handler: Callable[[S, Req, Ctx, Identity], Coroutine[Any, Any, Resp]],
) -> Callable[[S, Req, Ctx], Coroutine[Any, Any, Resp]]:
    """Wrap a unary handler `(self, request, context, who) -> response` (see the module docstring)."""
    name = handler.__name__

    @functools.wraps(handler)
    async def call(self: S, request: Req, context: Ctx) -> Resp:
        t0 = time.perf_counter()
        code = "OK"
        method = self.method(name)
        audited = self.guard is not None and self.guard.audited(method)
        # a client stream (PushPackage) is audited without its messages: they are the payload
        said = request if isinstance(request, Message) else empty_pb2.Empty()
        rider: Rider | None = None
        try:
            if self.guard is not None:
                await self.guard.admit(context, method)
            who = await authorize(context, method)
            if audited and self.guard is not None:
                rider = self.guard.rider(context, method, said)
            with riding(rider):  # the record commits with the call's first write (store/riders.py)
                return await handler(self, request, context, who)
        except Exception as e:
            code = _code_name(e, context)
            await fail(context, e)
        finally:
            if self.observe_call is not None:
                self.observe_call(name, code, time.perf_counter() - t0)
            if audited and self.guard is not None and (rider is None or not rider.attached or code != "OK"):
                # nothing committed (refused, invalid, no write), or committed and then failed
                await self.guard.audit(context, method, said, code)

    call.__rpc_method__ = name  # type: ignore[attr-defined]
    return call


def _code_name(e: Exception, context: Ctx) -> str:
    """The status code a failed call ends with: the domain error's, else the one the handler (or the
    authorization) aborted with, else UNKNOWN."""
    code = status_of(e)
    if code is not None:
        return str(code.name)
    try:
        aborted = context.code()
    except Exception:  # pragma: no cover - older grpc without ServicerContext.code()
        aborted = None
    if isinstance(aborted, grpc.StatusCode):
        return str(aborted.name)
    if isinstance(aborted, int):
        return next((c.name for c in grpc.StatusCode if c.value[0] == aborted), "UNKNOWN")
    return "UNKNOWN"


def rpc_stream(
    handler: Callable[[S, Req, Ctx, Identity], AsyncIterator[Resp]],
) -> Callable[[S, Req, Ctx], AsyncIterator[Resp]]:
    """Wrap a streaming handler `(self, request, context, who)` that yields responses."""
    name = handler.__name__

    @functools.wraps(handler)
    async def call(self: S, request: Req, context: Ctx) -> AsyncIterator[Resp]:
        guard, drain = self.guard, self.drain
        cert = await guard.admit(context, self.method(name)) if guard is not None else None
        who = await authorize(context, self.method(name))
        if drain is not None and drain.begun.is_set():
            await abort(context, grpc.StatusCode.UNAVAILABLE, drain.message())
        items = handler(self, request, context, who)
        revoked = asyncio.ensure_future(guard.until_revoked(cert)) if guard is not None else None
        draining = asyncio.ensure_future(drain.begun.wait()) if drain is not None else None
        if drain is not None:
            drain.opened()
        nxt: asyncio.Future[Resp] | None = None
        try:
            it = items.__aiter__()
            while True:
                nxt = asyncio.ensure_future(it.__anext__())
                waiting = {f for f in (nxt, revoked, draining) if f is not None}
                await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if not nxt.done():
                    nxt.cancel()
                    await asyncio.gather(nxt, return_exceptions=True)
                    if drain is not None and drain.begun.is_set():  # the replica drains: go elsewhere
                        drain.streams_ended += 1
                        await abort(context, grpc.StatusCode.UNAVAILABLE, drain.message())
                    # the caller's certificate was revoked: end its stream
                    await abort(
                        context,
                        grpc.StatusCode.UNAUTHENTICATED,
                        msg("auth.revoked_stream", "the client certificate was revoked"),
                    )
                try:
                    item = nxt.result()
                except StopAsyncIteration:
                    break
                yield item
        except Exception as e:
            await fail(context, e)
        finally:
            for f in (revoked, draining, nxt):
                if f is not None and not f.done():
                    f.cancel()
                    await asyncio.gather(f, return_exceptions=True)
                elif f is not None and not f.cancelled():
                    f.exception()  # retrieved (the handler's end while the client went away): no log noise
            try:
                if isinstance(items, AsyncGenerator):  # the client went away: the handler's cleanup runs now
                    await items.aclose()
            finally:
                if drain is not None:
                    drain.closed()

    call.__rpc_method__ = name  # type: ignore[attr-defined]
    return call
