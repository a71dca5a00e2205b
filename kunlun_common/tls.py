"""Loading and checking TLS material, and reading identity and role from a peer certificate.

Every control-plane hop is mutual TLS. A process refuses to start with a missing, expired or
foreign certificate, or one whose role does not fit the process, and says which file and why.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.x509.oid import NameOID

from kunlun_common.errors import ConfigError
from kunlun_common.messages import Message, msg, msg_list
from kunlun_common.pki import CA_NAMES, REPLICA_CA, ROLES, CertPaths


@dataclass(frozen=True)
class Identity:
    """Who a certificate says its holder is."""

    name: str
    """The subject's common name (a node name for agents)."""
    role: str
    """The subject's organizational unit: one of kunlun_common.pki.ROLES."""

    def __str__(self) -> str:
        return f"{self.role}:{self.name}"


@dataclass(frozen=True)
class TlsMaterial:
    """PEM bytes ready for gRPC credentials, plus the identity they carry."""

    ca: bytes
    cert: bytes
    key: bytes
    identity: Identity
    paths: CertPaths
    replica_ca: bytes = b""
    """The replica CA certificate (empty when the folder has none)."""


def identity_of(cert: x509.Certificate) -> Identity:
    """Identity and role from a certificate's subject (CN and OU).

    The role `replica` counts only on a certificate issued by the replica CA, and no other role
    counts on one: a cluster-CA certificate that calls itself a replica has no role (empty)."""
    cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    ous = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
    issuers = cert.issuer.get_attributes_for_oid(NameOID.COMMON_NAME)
    name = str(cns[0].value) if cns else ""
    role = str(ous[0].value) if ous else ""
    by_replica_ca = bool(issuers) and str(issuers[0].value) == CA_NAMES[REPLICA_CA]
    if (role == "replica") != by_replica_ca:
        role = ""
    return Identity(name=name, role=role)


def identity_from_pem(pem: bytes) -> Identity:
    return identity_of(x509.load_pem_x509_certificate(pem))


def _read(path: Path, what: Message) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(
            msg_list(
                "tls.file_missing",
                "{parts} {path} does not exist; create certificates with `kunlun-cli certs init DIR` and "
                "point the config at DIR",
                [what],
                bullet="",
                path=str(path),
            )
        ) from None
    except OSError as e:
        raise ConfigError(
            msg_list(
                "tls.file_unreadable",
                "{parts} {path} cannot be read ({reason}); create certificates with `kunlun-cli certs init "
                "DIR` and point the config at DIR",
                [what],
                bullet="",
                path=str(path),
                reason=e.strerror,
            )
        ) from None


def load_tls(
    paths: CertPaths, expect_roles: tuple[str, ...] | None = None, now: dt.datetime | None = None
) -> TlsMaterial:
    """Read and check a CA/cert/key triple: present, parseable, current, signed by that CA, right role."""
    ca_pem = _read(paths.ca, msg("tls.what.ca", "CA certificate"))
    cert_pem = _read(paths.cert, msg("tls.what.cert", "certificate"))
    key_pem = _read(paths.key, msg("tls.what.key", "private key"))
    try:
        ca = x509.load_pem_x509_certificate(ca_pem)
    except ValueError:
        raise ConfigError(
            msg("tls.ca_not_pem", "CA certificate {path} is not a PEM certificate", path=str(paths.ca))
        ) from None
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError:
        raise ConfigError(
            msg("tls.cert_not_pem", "certificate {path} is not a PEM certificate", path=str(paths.cert))
        ) from None
    when = now or dt.datetime.now(dt.UTC)
    if cert.not_valid_after_utc < when:
        raise ConfigError(
            msg(
                "tls.cert_expired",
                "certificate {path} expired on {when} UTC; issue a new one with `kunlun-cli certs issue`",
                path=str(paths.cert),
                when=f"{cert.not_valid_after_utc:%Y-%m-%d %H:%M}",
            )
        )
    if cert.not_valid_before_utc > when:
        raise ConfigError(
            msg(
                "tls.cert_not_yet_valid",
                "certificate {path} is not valid before {when} UTC",
                path=str(paths.cert),
                when=f"{cert.not_valid_before_utc:%Y-%m-%d %H:%M}",
            )
        )
    replica_ca_path = paths.replica_ca or paths.ca.with_name(REPLICA_CA)
    replica_ca_pem = replica_ca_path.read_bytes() if replica_ca_path.exists() else b""
    issuer_path = paths.ca
    if f"CN={CA_NAMES[REPLICA_CA]}" in cert.issuer.rfc4514_string() and replica_ca_pem:
        ca, issuer_path = x509.load_pem_x509_certificate(replica_ca_pem), replica_ca_path
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, Exception) as e:  # InvalidSignature has no common base
        raise ConfigError(
            msg(
                "tls.wrong_ca",
                "certificate {path} was not issued by the CA {ca} ({error}); "
                "use certificates from the same `certs init` folder",
                path=str(paths.cert),
                ca=str(issuer_path),
                error=type(e).__name__,
            )
        ) from None
    ident = identity_of(cert)
    if ident.role not in ROLES:
        raise ConfigError(
            msg(
                "tls.no_role",
                "certificate {path} has no Kunlun role (OU={role!r}); expected one of {roles}",
                path=str(paths.cert),
                role=ident.role,
                roles=str(ROLES),
            )
        )
    if expect_roles is not None and ident.role not in expect_roles:
        raise ConfigError(
            msg(
                "tls.wrong_role",
                "certificate {path} is for role {role!r} ({name}); this process needs a certificate with role {roles}",
                path=str(paths.cert),
                role=ident.role,
                name=ident.name,
                roles=" or ".join(expect_roles),
            )
        )
    return TlsMaterial(
        ca=ca_pem, cert=cert_pem, key=key_pem, identity=ident, paths=paths, replica_ca=replica_ca_pem
    )


def _replica_ca(tls: TlsMaterial) -> bytes:
    if not tls.replica_ca:
        raise ConfigError(
            msg(
                "tls.no_replica_ca",
                "no replica CA ({file}) beside {ca}; copy it from the `kunlun-cli certs init` folder",
                file=REPLICA_CA,
                ca=str(tls.paths.ca),
            )
        )
    return tls.replica_ca


def server_credentials(tls: TlsMaterial, clients: str = "any") -> grpc.ServerCredentials:
    """Server credentials that require and verify a client certificate (mTLS).

    clients="any": certificates of the cluster CA and of the replica CA (a replica's API);
    clients="replica": replica certificates only (an agent's NodeService)."""
    roots = _replica_ca(tls) if clients == "replica" else tls.ca + tls.replica_ca
    return grpc.ssl_server_credentials(
        [(tls.key, tls.cert)], root_certificates=roots, require_client_auth=True
    )


def channel_credentials(tls: TlsMaterial, server_role: str = "replica") -> grpc.ChannelCredentials:
    """Client credentials presenting our certificate and trusting only servers of `server_role`:
    "replica" trusts the replica CA alone, so no agent, gateway or user certificate can pose as a
    replica; "agent" trusts the cluster CA (the caller also checks the node's name)."""
    roots = _replica_ca(tls) if server_role == "replica" else tls.ca
    return grpc.ssl_channel_credentials(
        root_certificates=roots, private_key=tls.key, certificate_chain=tls.cert
    )


def peer_identity(auth_context: dict[str, list[bytes]]) -> Identity | None:
    """The verified client identity from a gRPC auth context, or None if there is none."""
    pems = auth_context.get("x509_pem_cert")
    if not pems:
        return None
    return identity_from_pem(pems[0])


def peer_certificate(auth_context: dict[str, list[bytes]]) -> x509.Certificate | None:
    """The verified client certificate from a gRPC auth context, or None if there is none."""
    pems = auth_context.get("x509_pem_cert")
    return x509.load_pem_x509_certificate(pems[0]) if pems else None


def server_certificate(
    address: str, ca: bytes, cert_file: Path | None = None, key_file: Path | None = None, timeout: float = 3.0
) -> x509.Certificate:
    """Open one TLS connection to `address` (host:port), verified against `ca`, presenting the given
    client certificate, and return the certificate the server presented (blocking: run it in a
    thread). Used to read the serial and expiry of what a server presents *now*."""
    import socket
    import ssl

    host, _, port = address.rpartition(":")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False  # only reading the certificate; the chain is still verified
    ctx.load_verify_locations(cadata=ca.decode())
    ctx.set_alpn_protocols(["h2", "http/1.1"])
    if cert_file is not None and key_file is not None:
        ctx.load_cert_chain(str(cert_file), str(key_file))
    with (
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout) as sock,
        ctx.wrap_socket(sock) as tls_sock,
    ):
        der = tls_sock.getpeercert(binary_form=True)
    if not der:
        raise ConfigError(msg("tls.no_peer_cert", "{address} presented no certificate", address=address))
    return x509.load_der_x509_certificate(der)
