"""Certificates for a cluster: one CA plus a certificate per process, role in the subject.

Identity and role come only from the peer certificate: the subject's CN is the identity (a node
name for agents) and its OU is the role. Layout of a certificate folder (one for every binary):

    DIR/ca.crt  DIR/ca.key
    DIR/<role>/<name>.crt  DIR/<role>/<name>.key     role in ROLES

`kunlun-cli certs init DIR` writes a whole folder; `kunlun-cli certs issue` adds one certificate.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kunlun_common.errors import ConfigError

ROLES = ("etcd", "replica", "agent", "gateway", "operator", "viewer", "monitoring")
ORG = "kunlun-platform"
DEFAULT_HOSTS = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class CertPaths:
    """Where one process finds its CA, certificate and key."""

    ca: Path
    """The cluster CA certificate that every peer must be signed by."""
    cert: Path
    """This process's certificate (PEM)."""
    key: Path
    """This process's private key (PEM, mode 0600)."""


def paths_for(cert_dir: str | os.PathLike[str], role: str, name: str) -> CertPaths:
    """The conventional paths of `name`'s certificate with `role` inside a certificate folder."""
    base = Path(cert_dir)
    return CertPaths(base / "ca.crt", base / role / f"{name}.crt", base / role / f"{name}.key")


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def create_ca(cert_dir: str | os.PathLike[str], days: int = 3650) -> None:
    """Create DIR/ca.crt and DIR/ca.key unless they exist."""
    base = Path(cert_dir)
    if (base / "ca.crt").exists() and (base / "ca.key").exists():
        return
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORG),
            x509.NameAttribute(NameOID.COMMON_NAME, "kunlun-ca"),
        ]
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now() - dt.timedelta(minutes=5))
        .not_valid_after(_now() + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
        .sign(key, hashes.SHA256())
    )
    _write_key(base / "ca.key", key)
    _write_cert(base / "ca.crt", cert)


def _load_ca(base: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    ca_cert = x509.load_pem_x509_certificate((base / "ca.crt").read_bytes())
    ca_key = serialization.load_pem_private_key((base / "ca.key").read_bytes(), password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ConfigError(f"{base / 'ca.key'}: expected an EC private key")
    return ca_cert, ca_key


def issue(
    cert_dir: str | os.PathLike[str],
    role: str,
    name: str,
    hosts: Iterable[str] = DEFAULT_HOSTS,
    days: int = 825,
    not_before: dt.datetime | None = None,
    not_after: dt.datetime | None = None,
    overwrite: bool = False,
) -> CertPaths:
    """Issue `name`'s certificate for `role`, signed by the folder's CA (server and client usage)."""
    if role not in ROLES:
        raise ConfigError(f"unknown role {role!r}: expected one of {', '.join(ROLES)}")
    base = Path(cert_dir)
    paths = paths_for(base, role, name)
    if paths.cert.exists() and paths.key.exists() and not overwrite:
        return paths
    ca_cert, ca_key = _load_ca(base)
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = []
    for h in dict.fromkeys([*hosts, name]):
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORG),
            x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role),
            x509.NameAttribute(NameOID.COMMON_NAME, name),
        ]
    )
    start = not_before or (_now() - dt.timedelta(minutes=5))
    end = not_after or (_now() + dt.timedelta(days=days))
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    _write_key(paths.key, key)
    _write_cert(paths.cert, cert)
    return paths


@dataclass(frozen=True)
class ClusterCerts:
    """What `init_cluster_certs` should create."""

    etcd_members: tuple[str, ...] = ("etcd-1", "etcd-2", "etcd-3")
    """Names of the etcd members."""
    replicas: tuple[str, ...] = ("replica-1", "replica-2", "replica-3")
    """Names of the control-plane replicas."""
    nodes: tuple[str, ...] = ("node-a", "node-b")
    """Node names; each agent certificate is bound to its node."""
    gateways: tuple[str, ...] = ("gateway-1", "gateway-2", "gateway-3")
    """Names of the gateways."""
    operators: tuple[str, ...] = ("admin",)
    """Operator identities (may change state)."""
    viewers: tuple[str, ...] = ("viewer",)
    """Viewer identities (read only)."""
    monitors: tuple[str, ...] = ("prometheus",)
    """Monitoring identities: may scrape every process's metrics exporter and list scrape targets."""
    hosts: tuple[str, ...] = DEFAULT_HOSTS
    """Extra SANs (addresses and host names) for every server certificate."""


def init_cluster_certs(cert_dir: str | os.PathLike[str], spec: ClusterCerts = ClusterCerts()) -> list[Path]:
    """Create (idempotently) the CA and every certificate named by `spec`; return the cert paths."""
    create_ca(cert_dir)
    out: list[Path] = []
    for role, names in (
        ("etcd", spec.etcd_members),
        ("replica", spec.replicas),
        ("agent", spec.nodes),
        ("gateway", spec.gateways),
        ("operator", spec.operators),
        ("viewer", spec.viewers),
        ("monitoring", spec.monitors),
    ):
        for name in names:
            out.append(issue(cert_dir, role, name, hosts=spec.hosts).cert)
    return out
