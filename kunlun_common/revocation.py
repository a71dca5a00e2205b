"""The revocation list as agents and gateways hold it: fetched from the replicas every few seconds
(`SecurityService.ListRevocations`) and checked against the serial of each client certificate
they are presented (the agent's NodeService, every process's metrics exporter).

grpc-python offers no certificate-verification hook, so the check happens on the verified peer
certificate after the handshake, before any work is done for the caller. If the replicas cannot be
reached the last list fetched stays in force (revocations are never forgotten for lack of news).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Sequence

import grpc
import structlog
from cryptography import x509

from kunlun_common.api import security_pb2, security_pb2_grpc
from kunlun_common.tls import TlsMaterial, channel_credentials

log = structlog.get_logger("revocation")
POLL_S = 2.0
"""How often agents and gateways fetch the list (a revocation reaches them within about this)."""


class RevokedSerials:
    """Revoked certificate serials (lower-case hex), replaced whole on each fetch."""

    def __init__(self) -> None:
        self.serials: frozenset[str] = frozenset()
        self.fetches = 0

    def update(self, serials: Sequence[str]) -> None:
        new = frozenset(serials)
        if new != self.serials:
            log.info("revocation list updated", size=len(new), added=sorted(new - self.serials)[:10])
        self.serials = new
        self.fetches += 1

    def revoked(self, cert: x509.Certificate) -> bool:
        return f"{cert.serial_number:x}" in self.serials


async def follow(
    endpoints: Sequence[str],
    material: Callable[[], TlsMaterial],
    revoked: RevokedSerials,
    interval_s: float = POLL_S,
) -> None:
    """Fetch the list from any replica every `interval_s` (with jitter) until cancelled.

    `material` returns the process's current certificate (it changes on reload); a new channel is
    opened when it does or when a replica stops answering."""
    channel: grpc.aio.Channel | None = None
    key: tuple[str, int] | None = None
    start = random.randrange(len(endpoints)) if endpoints else 0
    try:
        while True:
            for i in range(len(endpoints)):
                ep = endpoints[(start + i) % len(endpoints)]
                m = material()
                if channel is None or key != (ep, id(m)):
                    if channel is not None:
                        await channel.close(None)
                    channel, key = grpc.aio.secure_channel(ep, channel_credentials(m)), (ep, id(m))
                try:
                    resp = await security_pb2_grpc.SecurityServiceStub(channel).ListRevocations(
                        security_pb2.ListRevocationsRequest(), timeout=3.0
                    )
                except grpc.aio.AioRpcError as e:
                    if e.code() == grpc.StatusCode.UNIMPLEMENTED:  # a replica of an older release
                        break
                    await channel.close(None)
                    channel = None
                    continue  # the next replica
                revoked.update([r.serial for r in resp.revocations])
                start = (start + i) % len(endpoints)  # stay with the replica that answered
                break
            await asyncio.sleep(interval_s * random.uniform(0.8, 1.2))
    finally:
        if channel is not None:
            await channel.close(None)
