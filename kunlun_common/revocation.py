"""The revocation list as agents and gateways hold it: fetched from the replicas every few seconds
(`SecurityService.ListRevocations`) and checked against the serial of each client certificate
they are presented (the agent's NodeService, every process's metrics exporter) and of each
replica they connect to (`server_check.py`).

grpc-python offers no certificate-verification hook, so the check happens on the verified peer
certificate after the handshake, before any work is done for the caller. If the replicas cannot be
reached the last list fetched stays in force (revocations are never forgotten for lack of news).

The list only grows within a process: a revocation is permanent (the control plane has no
"unrevoke"), so what one replica reported stays in force even if another reports less. The fetch
moves to the next replica at every poll, so one replica that hides revocations (a compromised one,
or one whose own certificate was revoked) cannot keep them from a process for more than one
round; a replica whose own certificate is on the list is never asked.

A fresh process knows no revocation at all, so before it trusts any server it fetches the list
from every replica at once and keeps the union (`first_fetch`): a replica whose certificate was
revoked, or anyone holding such a certificate and posing as a replica, is then refused from the
first connection on, and one replica hiding revocations cannot hide them on its own. The agent's
NodeService refuses callers until that first list is in (`RevokedSerials.fetches`).
"""

from __future__ import annotations

import asyncio
import random
import ssl
from collections.abc import Callable, Iterable, Sequence

import grpc
import structlog
from cryptography import x509

from kunlun_common.api import security_pb2, security_pb2_grpc
from kunlun_common.retry import backoff_delay
from kunlun_common.server_check import RevokedServer, checked_server
from kunlun_common.tls import TlsMaterial, channel_credentials

log = structlog.get_logger("revocation")
POLL_S = 2.0
"""How often agents and gateways fetch the list (a revocation reaches them within about this)."""


class RevokedSerials:
    """Revoked certificate serials (lower-case hex), as fetched from the replicas (only grows)."""

    def __init__(self, serials: Iterable[str] = ()) -> None:
        self.serials: frozenset[str] = frozenset(serials)
        self.fetches = 0
        self._changed = asyncio.Event()

    def update(self, serials: Sequence[str]) -> None:
        new = self.serials | frozenset(s.lower().lstrip("0") for s in serials)
        if new != self.serials:
            log.info("revocation list updated", size=len(new), added=sorted(new - self.serials)[:10])
            self.serials = new
            self._changed.set()  # wakes the current waiters; later ones wait on a fresh event
            self._changed = asyncio.Event()
        self.fetches += 1

    def revoked(self, cert: x509.Certificate) -> bool:
        return f"{cert.serial_number:x}" in self.serials

    async def wait_revoked(self, address: str, serial: str) -> None:
        """Return never while `serial` (a server's) stays unrevoked; raise RevokedServer once it is."""
        while serial not in self.serials:
            await self._changed.wait()
        raise RevokedServer(f"{address}'s certificate {serial} was revoked; leaving it for another replica")


async def _ask(ep: str, m: TlsMaterial, timeout_s: float) -> list[str]:
    """The list one replica holds (a replica of an older release that does not serve it: none).
    Raises OSError / ssl.SSLError / grpc.aio.AioRpcError when the replica cannot be asked."""
    await checked_server(ep, m, frozenset(), connect_timeout_s=timeout_s)
    async with grpc.aio.secure_channel(ep, channel_credentials(m)) as ch:
        try:
            resp = await security_pb2_grpc.SecurityServiceStub(ch).ListRevocations(
                security_pb2.ListRevocationsRequest(), timeout=timeout_s
            )
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                return []
            raise
    return [r.serial for r in resp.revocations]


async def first_fetch(
    endpoints: Sequence[str],
    material: Callable[[], TlsMaterial],
    revoked: RevokedSerials,
    timeout_s: float = 3.0,
) -> int:
    """Before a fresh process trusts any server: ask every replica at once (each within
    `timeout_s`) and keep the union of their lists. Repeats, with backoff and jitter, until at
    least one replica answered (none answering means no replica could be used anyway); returns how
    many answered."""
    rounds = 0
    while True:
        m = material()
        answers = await asyncio.gather(*(_ask(ep, m, timeout_s) for ep in endpoints), return_exceptions=True)
        lists = [a for a in answers if isinstance(a, list)]
        if lists:
            revoked.update([s for one in lists for s in one])
            log.info(
                "revocation list fetched", replicas=len(lists), of=len(endpoints), size=len(revoked.serials)
            )
            return len(lists)
        rounds += 1
        if rounds == 1:
            log.warning(
                "revocation list not fetched yet: no replica answered; no replica is trusted before it",
                reasons=sorted({f"{type(a).__name__}: {a}"[:200] for a in answers}),
            )
        await asyncio.sleep(backoff_delay(rounds, 0.2, 3.0))


async def follow(
    endpoints: Sequence[str],
    material: Callable[[], TlsMaterial],
    revoked: RevokedSerials,
    interval_s: float = POLL_S,
) -> None:
    """Fetch the list from a replica every `interval_s` (with jitter), a different replica each
    time, until cancelled. A replica that cannot be verified, presents a revoked certificate or
    does not answer is skipped for the next one.

    `material` returns the process's current certificate (it changes on reload). One channel per
    replica is kept; it is opened after checking the certificate the replica presents (one extra
    TLS handshake per channel) and closed when that certificate is revoked, when the replica stops
    answering, or when our own certificate changed."""
    n = len(endpoints)
    start = random.randrange(n) if n else 0
    channels: dict[str, tuple[grpc.aio.Channel, int, str]] = {}

    async def drop(ep: str) -> None:
        held = channels.pop(ep, None)
        if held is not None:
            await held[0].close(None)

    try:
        while True:
            for i in range(n):
                ep = endpoints[(start + i) % n]
                m = material()
                held = channels.get(ep)
                if held is not None and (held[1] != id(m) or held[2] in revoked.serials):
                    await drop(ep)
                    held = None
                if held is None:
                    try:
                        serial = await checked_server(ep, m, revoked.serials)
                    except (RevokedServer, ssl.SSLError, OSError, ValueError) as e:
                        log.debug("revocation list not fetched from this replica", replica=ep, reason=str(e))
                        continue
                    held = channels[ep] = (grpc.aio.secure_channel(ep, channel_credentials(m)), id(m), serial)
                try:
                    resp = await security_pb2_grpc.SecurityServiceStub(held[0]).ListRevocations(
                        security_pb2.ListRevocationsRequest(), timeout=3.0
                    )
                except grpc.aio.AioRpcError as e:
                    if e.code() == grpc.StatusCode.UNIMPLEMENTED:  # a replica of an older release
                        break
                    await drop(ep)
                    continue  # the next replica
                revoked.update([r.serial for r in resp.revocations])
                start = (start + i + 1) % n  # the next poll asks the next replica
                break
            await asyncio.sleep(interval_s * random.uniform(0.8, 1.2))
    finally:
        for ep in list(channels):
            await drop(ep)
