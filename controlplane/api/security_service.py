"""SecurityService: the audit log, the certificates in use, and certificate revocation."""

from __future__ import annotations

import asyncio

import structlog
from cryptography import x509

from controlplane import audit, certs_state
from controlplane.api.auth import Ctx
from controlplane.api.rpc import Servicer, rpc
from controlplane.store import EtcdStore
from controlplane.store.etcd import host_port
from kunlun_common.api import security_pb2, security_pb2_grpc
from kunlun_common.clock import now_ms
from kunlun_common.pki import CertPaths
from kunlun_common.tls import Identity, TlsMaterial, server_certificate

log = structlog.get_logger("security")


class SecurityService(Servicer, security_pb2_grpc.SecurityServiceServicer):
    SERVICE = "kunlun.v1.SecurityService"

    def __init__(
        self, store: EtcdStore, own: TlsMaterial, etcd_endpoints: tuple[str, ...], etcd_paths: CertPaths
    ) -> None:
        self.store = store
        self.own = own
        self.etcd_endpoints = etcd_endpoints
        self.etcd_paths = etcd_paths

    @rpc
    async def ListAudit(
        self, request: security_pb2.ListAuditRequest, context: Ctx, who: Identity
    ) -> security_pb2.ListAuditResponse:
        return security_pb2.ListAuditResponse(entries=await audit.query(self.store, request))

    async def _etcd_member_certs(self) -> list[security_pb2.CertificateInfo]:
        """What each etcd member presents right now (one TLS handshake each, in threads)."""
        ca = self.etcd_paths.ca.read_bytes()

        def one(ep: str) -> x509.Certificate | None:
            host, port = host_port(ep)
            try:
                return server_certificate(f"{host}:{port}", ca, self.etcd_paths.cert, self.etcd_paths.key)
            except (OSError, ValueError) as e:
                log.info("etcd member certificate unreadable", endpoint=ep, error=str(e)[:200])
                return None

        found = await asyncio.gather(*(asyncio.to_thread(one, ep) for ep in self.etcd_endpoints))
        out = []
        for cert in found:
            if cert is None:
                continue
            cns = [a.value for a in cert.subject if a.oid == x509.NameOID.COMMON_NAME]
            out.append(
                security_pb2.CertificateInfo(
                    role="etcd",
                    name=str(cns[0]) if cns else "?",
                    serial=certs_state.serial_hex(cert.serial_number),
                    not_after_unix_ms=int(cert.not_valid_after_utc.timestamp() * 1000),
                    seen_at_unix_ms=now_ms(),
                    source="etcd member",
                )
            )
        return out

    @rpc
    async def ListCertificates(
        self, request: security_pb2.ListCertificatesRequest, context: Ctx, who: Identity
    ) -> security_pb2.ListCertificatesResponse:
        seen, members = await asyncio.gather(certs_state.inventory(self.store), self._etcd_member_certs())
        return security_pb2.ListCertificatesResponse(certificates=[*seen, *members])

    @rpc
    async def RevokeCertificate(
        self, request: security_pb2.RevokeCertificateRequest, context: Ctx, who: Identity
    ) -> security_pb2.RevokeCertificateResponse:
        rev = await certs_state.revoke(self.store, request.serial, request.name, request.reason, str(who))
        log.warning("certificate revoked", serial=rev.serial, name=rev.name, by=str(who))
        return security_pb2.RevokeCertificateResponse(revocation=rev)

    @rpc
    async def ListRevocations(
        self, request: security_pb2.ListRevocationsRequest, context: Ctx, who: Identity
    ) -> security_pb2.ListRevocationsResponse:
        return security_pb2.ListRevocationsResponse(
            revocations=await certs_state.list_revocations(self.store)
        )
