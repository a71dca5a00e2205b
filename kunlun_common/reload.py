"""Certificate reload without a restart (SIGHUP): `kunlun-cli certs rotate` writes new files, the
process re-reads them, and every *new* connection uses them while open ones carry on.

- servers: `server_credentials` hands gRPC a certificate fetcher that gRPC calls at each new
  handshake, so the next client sees the new certificate (grpc's dynamic SSL credentials);
- clients and exporters: listeners registered with `on_reload` swap their credentials (a new
  channel presents the new certificate; an open stream keeps its connection).

A reload that finds a broken pair (unreadable, expired, another identity, a key that does not
match the certificate: e.g. caught between the two file writes) keeps the old material, logs why,
and waits for the next SIGHUP.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc
import structlog
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from kunlun_common.errors import ConfigError
from kunlun_common.tls import TlsMaterial, load_tls

log = structlog.get_logger("tls")


def _key_matches(m: TlsMaterial) -> bool:
    cert = x509.load_pem_x509_certificate(m.cert)
    key = serialization.load_pem_private_key(m.key, password=None)
    spki = serialization.PublicFormat.SubjectPublicKeyInfo
    enc = serialization.Encoding.DER
    return bool(cert.public_key().public_bytes(enc, spki) == key.public_key().public_bytes(enc, spki))


class LiveTls:
    """A process's current certificate, replaced by `reload()`."""

    def __init__(self, material: TlsMaterial, expect_roles: tuple[str, ...] | None = None) -> None:
        self.material = material
        self.expect_roles = expect_roles
        self.reloads = 0
        self._listeners: list[Callable[[TlsMaterial], None]] = []

    def on_reload(self, fn: Callable[[TlsMaterial], None]) -> None:
        self._listeners.append(fn)

    def reload(self) -> bool:
        """Re-read the certificate files; True if new material is now in use."""
        old = self.material
        try:
            new = load_tls(old.paths, self.expect_roles)
            if not _key_matches(new):
                raise ConfigError(f"{old.paths.key} does not belong to {old.paths.cert} (half-written?)")
        except (ConfigError, ValueError, TypeError) as e:
            log.error("certificate reload refused; keeping the current certificate", error=str(e))
            return False
        if new.identity != old.identity:
            log.error(
                "certificate reload refused: the new certificate is for another identity",
                current=str(old.identity),
                found=str(new.identity),
            )
            return False
        if (new.cert, new.key, new.ca, new.replica_ca) == (old.cert, old.key, old.ca, old.replica_ca):
            log.info("certificate reload: files unchanged", cert=str(old.paths.cert))
            return False
        self.material = new
        self.reloads += 1
        for fn in self._listeners:
            fn(new)
        cert = x509.load_pem_x509_certificate(new.cert)
        log.info(
            "certificate reloaded",
            identity=str(new.identity),
            serial=f"{cert.serial_number:x}",
            not_after=cert.not_valid_after_utc.isoformat(),
        )
        return True

    def server_credentials(self, clients: str = "any") -> grpc.ServerCredentials:
        """mTLS server credentials that follow reloads (see kunlun_common.tls.server_credentials for
        `clients`)."""

        def config(m: TlsMaterial) -> grpc.ServerCertificateConfiguration:
            if clients == "replica" and not m.replica_ca:
                raise ConfigError(f"no replica CA beside {m.paths.ca}")
            roots = m.replica_ca if clients == "replica" else m.ca + m.replica_ca
            return grpc.ssl_server_certificate_configuration([(m.key, m.cert)], root_certificates=roots)

        served = [self.material]

        def fetch() -> grpc.ServerCertificateConfiguration | None:
            current = self.material
            if current is served[0]:
                return None  # unchanged: gRPC keeps what it has
            served[0] = current
            return config(current)

        # grpc documents None as "no change"; its type stubs do not
        fetcher: Callable[[], grpc.ServerCertificateConfiguration] = fetch  # type: ignore[assignment]
        return grpc.dynamic_ssl_server_credentials(
            config(self.material), fetcher, require_client_authentication=True
        )
