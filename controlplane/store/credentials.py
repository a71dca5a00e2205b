"""The replica's etcd client certificate: read, checked, and handed to gRPC.

Read at the first connection and again on SIGHUP (`EtcdStore.reload_credentials`, after
`kunlun-cli certs rotate`). A pair that is unreadable, expired, not issued by the etcd CA, or whose
key does not belong to the certificate (e.g. caught between the two file writes) is refused with
the file and the reason; on a reload the current certificate then stays in use.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from kunlun_common.errors import ConfigError
from kunlun_common.messages import msg


@dataclass(frozen=True)
class ClientPair:
    """An etcd client certificate ready for gRPC."""

    ca: bytes
    cert: bytes
    key: bytes
    serial: str
    """The certificate's serial (hex), for logs: which certificate the replica presents to etcd."""

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )


def read_pair(ca_path: str, cert_path: str, key_path: str, check: bool = True) -> ClientPair:
    """Read the three files; with `check`, refuse an expired certificate, one not issued by the CA,
    or a key of another certificate (raises ConfigError naming the file)."""
    files = []
    for p in (ca_path, cert_path, key_path):
        try:
            files.append(Path(p).read_bytes())
        except OSError as e:
            raise ConfigError(
                msg(
                    "store.credentials.etcd_tls_file_cannot",
                    "etcd TLS file {p} cannot be read ({strerror}); check store settings",
                    p=p,
                    strerror=e.strerror,
                )
            ) from None
    ca_pem, cert_pem, key_pem = files
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError:
        raise ConfigError(
            msg(
                "store.credentials.etcd_client_certificate_not",
                "etcd client certificate {cert_path} is not a PEM certificate",
                cert_path=cert_path,
            )
        ) from None
    pair = ClientPair(ca_pem, cert_pem, key_pem, f"{cert.serial_number:x}")
    if not check:
        return pair
    if cert.not_valid_after_utc < dt.datetime.now(dt.UTC):
        raise ConfigError(
            msg(
                "store.credentials.etcd_client_certificate_expired",
                "etcd client certificate {cert_path} expired on {expired}",
                cert_path=cert_path,
                expired=f"{cert.not_valid_after_utc:%Y-%m-%d}",
            )
        )
    try:
        cert.verify_directly_issued_by(x509.load_pem_x509_certificate(ca_pem))
        key = serialization.load_pem_private_key(key_pem, password=None)
    except Exception as e:  # InvalidSignature, ValueError, TypeError: no common base
        raise ConfigError(
            msg(
                "store.credentials.etcd_client_certificate_does",
                "etcd client certificate {cert_path} does not fit {ca_path} / {key_path} ({name})",
                cert_path=cert_path,
                ca_path=ca_path,
                key_path=key_path,
                name=type(e).__name__,
            )
        ) from None
    spki, der = serialization.PublicFormat.SubjectPublicKeyInfo, serialization.Encoding.DER
    if cert.public_key().public_bytes(der, spki) != key.public_key().public_bytes(der, spki):
        raise ConfigError(
            msg(
                "store.credentials.does_not_belong_half",
                "{key_path} does not belong to {cert_path} (half-written?)",
                key_path=key_path,
                cert_path=cert_path,
            )
        )
    return pair
