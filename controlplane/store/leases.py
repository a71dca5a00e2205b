"""The lease keep-alive streams: a few LeaseKeepAlive streams shared by every lease of a process.

TIME-CRITICAL: each refresh is bounded by the request timeout. etcd answers keep-alives in order on
a stream, so one FIFO of waiters per lease id (per stream) is enough.

Isolation: a refresh that times out fails alone. It leaves the refreshes in flight with it to
their own answers or deadlines; if the stream has not answered anything since that refresh was
written (a paused member), the stream is retired: new refreshes open a new one (round-robin picks
another member) while the old one drains. A stream that breaks (error, end of stream) hands each
of its unanswered refreshes back to its caller, which re-sends it on a new stream within its own
deadline: only what was lost is sent again.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from typing import Any

import grpc
from aetcd import rpc

from kunlun_common.errors import TemporaryError
from kunlun_common.messages import msg

_METADATA = (("hasleader", "true"),)
_EOF: Any = grpc.aio.EOF  # type: ignore[attr-defined]  # (grpc-stubs lags grpcio)


class _StreamLost(Exception):
    """The stream a refresh was written on broke before answering it (re-send on a new stream)."""


class _Stream:
    """One LeaseKeepAlive call, its reader and its waiters."""

    def __init__(self, call: Any) -> None:
        self.call = call
        self.waiting: dict[int, collections.deque[asyncio.Future[int]]] = collections.defaultdict(
            collections.deque
        )
        self.answered_at = 0.0
        self.retired = False
        self.reader: asyncio.Task[None] | None = None
        self.slot: _Slot | None = None

    def in_flight(self) -> int:
        return sum(len(q) for q in self.waiting.values())

    def forget(self, lease_id: int, fut: asyncio.Future[int]) -> None:
        q = self.waiting.get(lease_id)
        if q is not None:
            with contextlib.suppress(ValueError):
                q.remove(fut)
            if not q:
                del self.waiting[lease_id]

    def fail_all(self, err: Exception) -> None:
        for q in self.waiting.values():
            while q:
                fut = q.popleft()
                if not fut.done():
                    fut.set_exception(err)
        self.waiting.clear()

    def close(self) -> None:
        self.retired = True
        self.call.cancel()
        if self.reader is not None and self.reader is not asyncio.current_task():
            self.reader.cancel()


class _Slot:
    """One of the keeper's streams (re-opened when retired) and the lock that orders its writes."""

    def __init__(self) -> None:
        self.stream: _Stream | None = None
        self.lock = asyncio.Lock()


class LeaseKeeper:
    """A few LeaseKeepAlive streams shared by every lease of the process; a lease always uses the
    same one (`lease id % streams`), so its answers come in order.

    Several streams, because etcd answers the keep-alives of one stream one after another (a
    follower forwards each to the leader and waits): a replica refreshing hundreds of node leases
    on one stream would wait hundreds of round trips for the last one.
    """

    def __init__(self, stub: Any, timeout_s: float, streams: int = 8) -> None:
        self._stub = stub
        self._timeout = timeout_s
        self._slots = [_Slot() for _ in range(max(1, streams))]
        self._draining: set[_Stream] = set()
        self.timeouts = 0
        """Refreshes that timed out (each failed alone)."""
        self.resent = 0
        """Refreshes re-sent on a new stream after theirs broke."""

    def _ensure(self, slot: _Slot) -> _Stream:
        if slot.stream is None:
            s = _Stream(self._stub.LeaseKeepAlive(metadata=_METADATA))
            s.slot = slot
            s.reader = asyncio.create_task(self._read(s), name="lease-keepalive-reader")
            slot.stream = s
        return slot.stream

    async def _read(self, s: _Stream) -> None:
        try:
            while True:
                resp = await s.call.read()
                if resp is _EOF:
                    raise TemporaryError(
                        msg("store.lease.lease_keep_alive_stream", "lease keep-alive stream closed")
                    )
                s.answered_at = time.monotonic()
                q = s.waiting.get(int(resp.ID))
                if q:
                    fut = q.popleft()
                    if not q:
                        del s.waiting[int(resp.ID)]
                    if not fut.done():
                        fut.set_result(int(resp.TTL))
                if s.retired and not s.waiting:
                    self._drop(s)
                    return
        except asyncio.CancelledError as e:
            task = asyncio.current_task()
            if task is None or task.cancelling():
                raise
            self._broken(
                s,
                TemporaryError(
                    msg(
                        "store.lease.stream_ended_reload",
                        "lease keep-alive stream ended: its channel was closed ({error})",
                        error=repr(e),
                    )
                ),
            )
        except (grpc.aio.AioRpcError, TemporaryError) as e:
            self._broken(s, e)

    def _retire(self, s: _Stream) -> None:
        """New refreshes go to a new stream; this one lives until its waiters are done."""
        if s.slot is not None and s.slot.stream is s:
            s.slot.stream = None
        s.retired = True
        if s.in_flight():
            self._draining.add(s)
        else:
            self._drop(s)

    def _drop(self, s: _Stream) -> None:
        self._draining.discard(s)
        if s.slot is not None and s.slot.stream is s:
            s.slot.stream = None
        s.close()

    def _broken(self, s: _Stream, e: BaseException) -> None:
        s.fail_all(_StreamLost(str(e)))
        self._drop(s)

    async def refresh(self, lease_id: int, timeout_s: float | None = None) -> int:
        """Refresh one lease; its TTL (0: the lease is gone). TemporaryError after the deadline."""
        timeout = self._timeout if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        last = ""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.timeouts += 1
                raise TemporaryError(
                    msg(
                        "store.lease.etcd_did_not_answer",
                        "etcd did not answer the keep-alive of lease {lease_id:x} within {timeout}s{value}",
                        lease_id=lease_id,
                        timeout=timeout,
                        value=f" ({last})" if last else "",
                    )
                )
            fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
            slot = self._slots[lease_id % len(self._slots)]
            async with slot.lock:
                s = self._ensure(slot)
                s.waiting[lease_id].append(fut)
                written_at = time.monotonic()
                try:  # the stream's own bound, not the caller's: a short caller deadline is no stream fault
                    async with asyncio.timeout(self._timeout):
                        await s.call.write(rpc.LeaseKeepAliveRequest(ID=lease_id))
                except (grpc.aio.AioRpcError, TimeoutError, asyncio.InvalidStateError) as e:
                    self._broken(
                        s,
                        TemporaryError(
                            msg(
                                "store.lease.lease_keep_alive_write",
                                "lease keep-alive write failed: {e}",
                                e=e,
                            )
                        ),
                    )
            try:
                async with asyncio.timeout(max(0.001, deadline - time.monotonic())):
                    return await fut
            except _StreamLost as e:
                self.resent += 1
                last = str(e)
                await asyncio.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
                continue
            except TimeoutError:
                s.forget(lease_id, fut)
                if s.answered_at < written_at:
                    self._retire(s)  # silent since we wrote: a paused member; others drain
                elif s.retired and not s.in_flight():
                    self._drop(s)
                self.timeouts += 1
                raise TemporaryError(
                    msg(
                        "store.lease.etcd_did_not_answer_2",
                        "etcd did not answer the keep-alive of lease {lease_id:x} within {timeout}s",
                        lease_id=lease_id,
                        timeout=timeout,
                    )
                ) from None

    def switch(self, stub: Any) -> None:
        """Use another channel's LeaseStub (a reloaded client certificate): every open stream is
        retired (it drains the refreshes written on it), new refreshes open streams on `stub`."""
        self._stub = stub
        for slot in self._slots:
            if slot.stream is not None:
                self._retire(slot.stream)

    async def close(self) -> None:
        for s in [*self._draining, *(slot.stream for slot in self._slots if slot.stream is not None)]:
            s.fail_all(TemporaryError(msg("store.lease.lease_keep_alive_closed", "lease keep-alive closed")))
            s.close()
        self._draining.clear()
        for slot in self._slots:
            slot.stream = None
