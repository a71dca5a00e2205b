"""The lease keep-alive stream: one LeaseKeepAlive stream shared by every lease of a process.

TIME-CRITICAL: each refresh is bounded by the request timeout; a silent stream (a paused member) is
dropped so that the next refresh opens a new one (round-robin picks another member). etcd answers
keep-alives in order on the stream, so one FIFO of waiters per lease id is enough.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any

import grpc
from aetcd import rpc

from kunlun_common.errors import TemporaryError

_METADATA = (("hasleader", "true"),)
_EOF: Any = grpc.aio.EOF  # type: ignore[attr-defined]  # (grpc-stubs lags grpcio)


class LeaseKeeper:
    """One LeaseKeepAlive stream shared by every lease of the process (responses come in order)."""

    def __init__(self, stub: Any, timeout_s: float) -> None:
        self._stub = stub
        self._timeout = timeout_s
        self._call: Any = None
        self._reader: asyncio.Task[None] | None = None
        self._waiting: dict[int, collections.deque[asyncio.Future[int]]] = collections.defaultdict(
            collections.deque
        )
        self._lock = asyncio.Lock()

    async def _ensure(self) -> Any:
        if self._call is None:
            self._call = self._stub.LeaseKeepAlive(metadata=_METADATA)
            self._reader = asyncio.create_task(self._read(self._call), name="lease-keepalive-reader")
        return self._call

    async def _read(self, call: Any) -> None:
        try:
            while True:
                resp = await call.read()
                if resp is _EOF:
                    raise TemporaryError("lease keep-alive stream closed")
                q = self._waiting.get(int(resp.ID))
                if q:
                    fut = q.popleft()
                    if not fut.done():
                        fut.set_result(int(resp.TTL))
        except asyncio.CancelledError:
            raise
        except (grpc.aio.AioRpcError, TemporaryError) as e:
            self._reset(call, TemporaryError(f"lease keep-alive stream failed: {e}"))

    def _reset(self, call: Any, err: Exception) -> None:
        if self._call is not call:
            return
        self._call = None
        call.cancel()
        for q in self._waiting.values():
            while q:
                fut = q.popleft()
                if not fut.done():
                    fut.set_exception(err)

    async def refresh(self, lease_id: int) -> int:
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        start = time.monotonic()
        async with self._lock:
            call = await self._ensure()
            self._waiting[lease_id].append(fut)
            try:
                async with asyncio.timeout(self._timeout):
                    await call.write(rpc.LeaseKeepAliveRequest(ID=lease_id))
            except (grpc.aio.AioRpcError, TimeoutError, asyncio.InvalidStateError) as e:
                self._reset(call, TemporaryError(f"lease keep-alive write failed: {e}"))
        try:
            left = max(0.01, self._timeout - (time.monotonic() - start))
            async with asyncio.timeout(left):
                return await fut
        except TimeoutError:
            # a silent stream (paused member): start over on a new stream next time
            self._reset(call, TemporaryError("lease keep-alive timed out"))
            raise TemporaryError(
                f"etcd did not answer the keep-alive of lease {lease_id:x} within {self._timeout}s"
            ) from None

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        if self._call is not None:
            self._call.cancel()
        self._call = None
