"""One lease refreshed from a thread of its own, over a blocking gRPC channel of its own.

TIME-CRITICAL, and isolated from the event loop: a replica's liveness lease (it binds the alive
keys of every node the replica serves) must not expire because the loop is busy. A keep-alive
written by the loop waits behind every callback queued before its answer; under a registration
storm that was seconds, and the lease of a replica with thousands of nodes is one lease. This
thread needs the GIL only for a few microseconds per refresh.

A watchdog ties it to the loop: the thread refreshes only while the loop showed it is alive
(`beat()`) within `loop_grace_s`. A loop that is wedged for longer lets the lease expire, so the
nodes it can no longer serve are marked dead (as a dead process's would be), instead of a thread
keeping their keys alive forever.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import grpc
import structlog
from aetcd import rpc

from controlplane.store.etcd import EtcdStore

log = structlog.get_logger("keepalive-thread")
_METADATA = (("hasleader", "true"),)


class KeepAliveThread:
    """Refreshes `lease()` every `period_s` from its own thread; calls `answered(lease, ttl, sent)`
    from that thread after each answer (`sent`: monotonic time the keep-alive was written).
    `answered` must be quick and thread-safe (an attribute write, or a `call_soon_threadsafe`)."""

    def __init__(
        self,
        store: EtcdStore,
        lease: Callable[[], int],
        answered: Callable[[int, int, float], None],
        period_s: float,
        timeout_s: float,
        loop_grace_s: float,
    ) -> None:
        self.store = store
        self.lease = lease
        self.answered = answered
        self.period_s = period_s
        self.timeout_s = timeout_s
        self.loop_grace_s = loop_grace_s
        self.loop_seen = time.monotonic()
        self.sent = 0
        """Keep-alives written (tests, benchmarks)."""
        self.skipped_for_loop = 0
        """Refreshes not sent because the loop had not beaten within `loop_grace_s`."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="liveness-keepalive", daemon=True)

    def beat(self) -> None:
        """The event loop is alive (called from it at least once a period)."""
        self.loop_seen = time.monotonic()

    def start(self) -> None:
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, join_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(join_s)

    def _run(self) -> None:
        channel: grpc.Channel | None = None
        creds: object = None
        stub = None
        next_at = time.monotonic()
        try:
            while not self._stop.wait(max(0.0, next_at - time.monotonic())):
                next_at += self.period_s
                if next_at < time.monotonic():
                    next_at = time.monotonic() + self.period_s
                lease = self.lease()
                if not lease:
                    continue
                if time.monotonic() - self.loop_seen > self.loop_grace_s:
                    self.skipped_for_loop += 1
                    continue
                if channel is None or creds is not self.store.credentials_in_use:
                    if channel is not None:
                        channel.close()
                    creds = self.store.credentials_in_use
                    channel, stub = self.store.sync_lease_stub()
                assert stub is not None
                sent = time.monotonic()
                self.sent += 1
                call = stub.LeaseKeepAlive(
                    iter([rpc.LeaseKeepAliveRequest(ID=lease)]), timeout=self.timeout_s, metadata=_METADATA
                )
                try:
                    resp = next(call)
                except (grpc.RpcError, StopIteration) as e:
                    log.warning(
                        "liveness keep-alive failed", lease=f"{lease:x}", error=str(e).splitlines()[0]
                    )
                    continue
                finally:
                    call.cancel()
                self.answered(lease, int(resp.TTL), sent)
        except Exception:  # never silently: the loop's own refresh takes over (it sees no answers)
            log.exception("liveness keep-alive thread ended")
        finally:
            if channel is not None:
                channel.close()
