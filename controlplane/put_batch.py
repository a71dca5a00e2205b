"""Plain puts of independent keys, coalesced into few etcd transactions (telemetry snapshots).

Every connected node writes a telemetry snapshot every `telemetry_snapshot_s`: at 1,000 nodes that
was 100 unary puts a second across the replicas, each its own gRPC call, its own etcd revision and
its own watch event on every replica. A `PutBatcher` gathers the puts that arrive within `linger_s`
and writes them in one unconditional transaction (at most etcd's MAX_TXN_OPS operations): one call
and one revision for up to 128 snapshots. Only for values that nothing compares against and whose
newest value wins; a failed batch fails each of its callers (a coarse snapshot is simply written
again next time).
"""

from __future__ import annotations

import asyncio
import contextvars

from controlplane.store import EtcdStore, PutOp
from controlplane.store.contract import MAX_TXN_OPS
from kunlun_common.errors import TemporaryError


class PutBatcher:
    """Coalesces `put(key, value)` calls into transactions of up to `max_ops` puts."""

    def __init__(self, store: EtcdStore, linger_s: float = 0.2, max_ops: int = MAX_TXN_OPS) -> None:
        self.store = store
        self.linger_s = linger_s
        self.max_ops = max(1, min(max_ops, MAX_TXN_OPS))
        self._pending: dict[str, tuple[bytes, list[asyncio.Future[None]]]] = {}
        self._flusher: asyncio.Task[None] | None = None
        self.transactions = 0
        """Transactions written (for benchmarks and tests)."""
        self.puts = 0
        """Puts carried by them."""

    async def put(self, key: str, value: bytes) -> None:
        """Write `value` under `key` with the next batch; returns once it committed (a newer put of
        the same key before the batch left replaces this value and commits with it)."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        _, waiters = self._pending.get(key, (b"", []))
        waiters.append(fut)
        self._pending[key] = (value, waiters)
        if self._flusher is None or self._flusher.done():
            # a clean context: a rider (audit record) of whoever triggered the batch must not join it
            self._flusher = asyncio.get_running_loop().create_task(
                self._flush(), name="put-batch", context=contextvars.Context()
            )
        await fut

    async def _flush(self) -> None:
        await asyncio.sleep(self.linger_s)
        while self._pending:
            keys = list(self._pending)[: self.max_ops]
            batch = {k: self._pending.pop(k) for k in keys}
            err: BaseException | None = TemporaryError("the put batcher was closed")
            try:
                res = await self.store.txn([], [PutOp(k, v) for k, (v, _) in batch.items()])
                err = (
                    None if res.succeeded else TemporaryError(f"a batch of {len(batch)} puts was not applied")
                )
            except Exception as e:  # every caller hears of it; the flusher itself goes on
                err = e
            finally:  # also when cancelled (close): no caller waits forever
                self.transactions += 1
                self.puts += len(batch)
                for _, waiters in batch.values():
                    for f in waiters:
                        if not f.done():
                            if err is None:
                                f.set_result(None)
                            else:
                                f.set_exception(err)

    async def close(self) -> None:
        if self._flusher is not None and not self._flusher.done():
            self._flusher.cancel()
            await asyncio.gather(self._flusher, return_exceptions=True)
        for _, waiters in self._pending.values():
            for f in waiters:
                if not f.done():
                    f.set_exception(TemporaryError("the put batcher was closed"))
        self._pending.clear()
