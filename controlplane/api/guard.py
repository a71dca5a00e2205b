"""What the `@rpc` wrapper does around authorization on a live replica: refuse revoked client
certificates, note which certificates are in use, and audit every operator call (the record in
the transaction of the change the call makes: controlplane/audit.py).

grpc-python has no hook into certificate verification, so revocation is enforced here, on the
verified peer certificate of each call: a revoked serial is answered UNAUTHENTICATED before the
role table is even consulted, and open streams of that certificate end when the revocation
arrives (`stream_revoked`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import grpc
import structlog
from cryptography import x509
from google.protobuf.message import Message

from controlplane.api.auth import PERMISSIONS, WRITERS, Ctx, abort
from controlplane.audit import AUDITED_IN_TXN, AuditLog, object_of
from controlplane.certs_state import Revocations, SeenCertificates, serial_hex
from controlplane.store.riders import Rider
from kunlun_common.messages import msg
from kunlun_common.tls import identity_of, peer_certificate

log = structlog.get_logger("auth")


def caller_certificate(context: Ctx) -> x509.Certificate | None:
    return peer_certificate(context.auth_context())  # type: ignore[arg-type]


@dataclass
class CallGuard:
    """Shared by every servicer of one replica."""

    revocations: Revocations
    seen: SeenCertificates
    audit_log: AuditLog

    async def admit(self, context: Ctx, method: str) -> x509.Certificate | None:
        """Abort a call whose client certificate was revoked; note the certificate otherwise."""
        cert = caller_certificate(context)
        if cert is None:
            return None
        serial = serial_hex(cert.serial_number)
        if self.revocations.revoked(serial):
            log.warning(
                "refused revoked certificate", method=method, identity=str(identity_of(cert)), serial=serial
            )
            await abort(
                context,
                grpc.StatusCode.UNAUTHENTICATED,
                msg(
                    "auth.revoked",
                    "certificate serial {serial} ({identity}) was revoked; ask an operator for a new one",
                    serial=serial,
                    identity=str(identity_of(cert)),
                ),
            )
        await self.seen.saw(cert)
        return cert

    def audited(self, method: str) -> bool:
        return PERMISSIONS.get(method) is WRITERS and method.rsplit("/", 1)[-1] not in AUDITED_IN_TXN

    def _who(self, context: Ctx) -> tuple[str, str]:
        cert = caller_certificate(context)
        ident = str(identity_of(cert)) if cert is not None else "anonymous"
        return ident, serial_hex(cert.serial_number) if cert is not None else ""

    def rider(self, context: Ctx, method: str, request: Message) -> Rider:
        """The call's audit record, to ride in the transaction of the change it makes."""
        ident, serial = self._who(context)
        return self.audit_log.rider(method.rsplit("/", 1)[-1], ident, serial, object_of(request))

    async def audit(self, context: Ctx, method: str, request: Message, code: str) -> None:
        ident, serial = self._who(context)
        await self.audit_log.record(method.rsplit("/", 1)[-1], ident, serial, object_of(request), code)

    async def until_revoked(self, cert: x509.Certificate | None) -> None:
        """Return once `cert`'s serial is revoked (never for a call without a certificate)."""
        if cert is None:
            await asyncio.Event().wait()
            return
        serial = serial_hex(cert.serial_number)
        while not self.revocations.revoked(serial):
            await self.revocations.changed.wait()
