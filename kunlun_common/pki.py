"""Certificates for a cluster: three CAs, a certificate per process, role in the subject.

Identity and role come only from the peer certificate: the subject's CN is the identity (a node
name for agents) and its OU is the role. Three CAs keep trust boundaries apart (as Kubernetes
keeps a separate etcd CA):

- the cluster CA (`ca.crt`) issues agent, gateway, operator and viewer certificates;
- the replica CA (`replica-ca.crt`) issues replica certificates only, so an agent, gateway or CLI
  that trusts only it for servers can never be talked to by anything but a replica;
- the etcd CA (`etcd-ca.crt`) issues the etcd members' server/peer certificates and the etcd
  client certificates (`etcd-client/kunlun`, `etcd-client/kunlun-admin`) that only replicas and
  the administrator hold; etcd trusts nothing else.

Layout of a certificate folder (`kunlun-cli certs init DIR`):

    DIR/ca.crt  DIR/replica-ca.crt  DIR/etcd-ca.crt
    DIR/<role>/<name>.crt  DIR/<role>/<name>.key          role in ROLES
    DIR/etcd-client/kunlun.crt|key  DIR/etcd-client/kunlun-admin.crt|key

The CA private keys are written apart, to `DIR-ca-keys/` (mode 0700), never into DIR: copy DIR's
certificates to the hosts, keep `DIR-ca-keys/` on the machine where certificates are made.
`bundle()` copies one component's own certificate plus the CA certificates it needs into a
folder of its own, which is what a launcher hands each process.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kunlun_common.errors import ConfigError

ROLES = ("etcd", "replica", "agent", "gateway", "operator", "viewer", "monitoring")
SERVER_ROLES = ("etcd", "replica", "agent", "gateway")
"""Roles whose certificates also serve (server usage and host SANs); the rest are clients only."""
ORG = "kunlun-platform"
DEFAULT_HOSTS = ("127.0.0.1", "localhost", "::1")
DEFAULT_DAYS = 90
"""Lifetime of an issued certificate; `cluster status` warns 30 days before expiry."""
CA_DAYS = 3650

CLUSTER_CA = "ca.crt"
REPLICA_CA = "replica-ca.crt"
ETCD_CA = "etcd-ca.crt"
CA_NAMES = {CLUSTER_CA: "kunlun-ca", REPLICA_CA: "kunlun-replica-ca", ETCD_CA: "kunlun-etcd-ca"}
"""CA certificate file -> the CA's common name."""
ETCD_CLIENT = "etcd-client"
ETCD_USER = "kunlun"
"""etcd user (= CN of the replicas' etcd client certificate); its role covers the cluster prefix."""
ETCD_ADMIN = "kunlun-admin"
ETCD_PEER_NAME = "etcd-peer.kunlun"
"""A SAN on every etcd member certificate; members accept peers only with it
(`--peer-cert-allowed-hostname`), so an etcd client certificate cannot speak raft."""
"""etcd user with the root role, for snapshot, defragmentation and member changes only."""


def issuer_file(role: str) -> str:
    """The CA certificate file that issues certificates of `role`."""
    if role in ("etcd", ETCD_CLIENT):
        return ETCD_CA
    if role == "replica":
        return REPLICA_CA
    return CLUSTER_CA


@dataclass(frozen=True)
class CertPaths:
    """Where one process finds its CA, certificate and key."""

    ca: Path
    """The CA that issues the certificates of this process's clients (the cluster CA; the etcd CA
    for etcd members and etcd clients)."""
    cert: Path
    """This process's certificate (PEM)."""
    key: Path
    """This process's private key (PEM, mode 0600)."""
    replica_ca: Path | None = None
    """The replica CA; default: `replica-ca.crt` beside `ca`."""


def paths_for(cert_dir: str | os.PathLike[str], role: str, name: str) -> CertPaths:
    """The conventional paths of `name`'s certificate with `role` inside a certificate folder."""
    base = Path(cert_dir)
    ca = base / (ETCD_CA if role in ("etcd", ETCD_CLIENT) else CLUSTER_CA)
    return CertPaths(ca, base / role / f"{name}.crt", base / role / f"{name}.key", base / REPLICA_CA)


def etcd_client_paths(cert_dir: str | os.PathLike[str], user: str = ETCD_USER) -> CertPaths:
    """A replica's (or the administrator's) etcd client certificate."""
    return paths_for(cert_dir, ETCD_CLIENT, user)


def ca_key_dir(cert_dir: str | os.PathLike[str]) -> Path:
    """Where `certs init DIR` keeps the CA private keys: beside DIR, never inside it."""
    base = Path(cert_dir)
    return base.parent / f"{base.name}-ca-keys"


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)  # a reader sees the old key or the new one, never a partial file


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    os.replace(tmp, path)


def _ca_key_path(cert_dir: Path, ca_file: str) -> Path:
    return ca_key_dir(cert_dir) / ca_file.replace(".crt", ".key")


def create_ca(cert_dir: str | os.PathLike[str], days: int = CA_DAYS) -> None:
    """Create the three CAs (certificates in DIR, keys in `ca_key_dir(DIR)`) unless they exist."""
    base = Path(cert_dir)
    keys = ca_key_dir(base)
    keys.mkdir(parents=True, exist_ok=True)
    os.chmod(keys, 0o700)
    for ca_file, cn in CA_NAMES.items():
        if (base / ca_file).exists() and _ca_key_path(base, ca_file).exists():
            continue
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name(
            [x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORG), x509.NameAttribute(NameOID.COMMON_NAME, cn)]
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
        _write_key(_ca_key_path(base, ca_file), key)
        _write_cert(base / ca_file, cert)


def _load_ca(base: Path, ca_file: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key_path = _ca_key_path(base, ca_file)
    try:
        ca_cert = x509.load_pem_x509_certificate((base / ca_file).read_bytes())
        ca_key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    except FileNotFoundError as e:
        raise ConfigError(
            f"{e.filename} does not exist; issue certificates on the machine that ran `kunlun-cli certs init "
            f"{base}` (the CA keys live in {ca_key_dir(base)})"
        ) from None
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ConfigError(f"{key_path}: expected an EC private key")
    return ca_cert, ca_key


def _sans(names: Iterable[str]) -> list[x509.GeneralName]:
    sans: list[x509.GeneralName] = []
    for h in dict.fromkeys(names):
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    return sans


def _san_names(role: str, name: str, hosts: Iterable[str]) -> list[str]:
    if role not in SERVER_ROLES:
        return [name]
    return [*hosts, name, *((ETCD_PEER_NAME,) if role == "etcd" else ())]


def issue(
    cert_dir: str | os.PathLike[str],
    role: str,
    name: str,
    hosts: Iterable[str] = DEFAULT_HOSTS,
    days: int = DEFAULT_DAYS,
    not_before: dt.datetime | None = None,
    not_after: dt.datetime | None = None,
    overwrite: bool = False,
) -> CertPaths:
    """Issue `name`'s certificate for `role`, signed by the CA for that role (see issuer_file).

    Server roles get server and client usage and `hosts` plus `name` as SANs; operator, viewer and
    etcd-client certificates are client-only and carry no host names.
    """
    if role not in (*ROLES, ETCD_CLIENT):
        raise ConfigError(f"unknown role {role!r}: expected one of {', '.join(ROLES)}")
    base = Path(cert_dir)
    paths = paths_for(base, role, name)
    if paths.cert.exists() and paths.key.exists() and not overwrite:
        return paths
    ca_cert, ca_key = _load_ca(base, issuer_file(role))
    key = ec.generate_private_key(ec.SECP256R1())
    server = role in SERVER_ROLES
    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORG)]
    if role != ETCD_CLIENT:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role))
    attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, name))
    start = not_before or (_now() - dt.timedelta(minutes=5))
    end = not_after or (_now() + dt.timedelta(days=days))
    usages = (
        [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
        if server
        else [ExtendedKeyUsageOID.CLIENT_AUTH]
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name(attrs))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(_sans(_san_names(role, name, hosts))), critical=False)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
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
    """SANs (addresses and host names) of every server certificate that has none of its own."""
    host_map: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Per-certificate SANs: name -> that host's real names and addresses (replaces `hosts`)."""


def init_cluster_certs(cert_dir: str | os.PathLike[str], spec: ClusterCerts = ClusterCerts()) -> list[Path]:
    """Create (idempotently) the CAs and every certificate named by `spec`; return the cert paths."""
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
        (ETCD_CLIENT, (ETCD_USER, ETCD_ADMIN)),
    ):
        for name in names:
            out.append(issue(cert_dir, role, name, hosts=spec.host_map.get(name, spec.hosts)).cert)
    if not (Path(cert_dir) / ETCD_CRL).exists():
        write_crl(cert_dir, ())  # etcd needs its --client-crl-file from the start
    return out


@dataclass(frozen=True)
class Renewed:
    """One certificate `renew` replaced."""

    role: str
    name: str
    old_serial: int
    new_serial: int
    not_after: dt.datetime


def certificates(cert_dir: str | os.PathLike[str]) -> list[tuple[str, str]]:
    """(role, name) of every certificate in a `certs init` folder."""
    base = Path(cert_dir)
    return [(role, p.stem) for role in (*ROLES, ETCD_CLIENT) for p in sorted((base / role).glob("*.crt"))]


def renew(cert_dir: str | os.PathLike[str], role: str, name: str, days: int = DEFAULT_DAYS) -> Renewed:
    """Re-issue `role/name` with a new key and serial, the same names and addresses, for `days`
    (the key and certificate files are each replaced atomically, key first)."""
    paths = paths_for(cert_dir, role, name)
    try:
        old = x509.load_pem_x509_certificate(paths.cert.read_bytes())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{paths.cert}: cannot read the certificate to renew ({e})") from None
    hosts: list[str] = []
    try:
        san = old.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        hosts = [
            *san.get_values_for_type(x509.DNSName),
            *(str(a) for a in san.get_values_for_type(x509.IPAddress)),
        ]
    except x509.ExtensionNotFound:
        pass
    new_paths = issue(cert_dir, role, name, hosts=hosts or DEFAULT_HOSTS, days=days, overwrite=True)
    new = x509.load_pem_x509_certificate(new_paths.cert.read_bytes())
    return Renewed(role, name, old.serial_number, new.serial_number, new.not_valid_after_utc)


CRL_DIR = "crl"
ETCD_CRL = f"{CRL_DIR}/etcd.crl"
"""The etcd members' `--client-crl-file` (DER), signed by the etcd CA: etcd reads it on every new
client connection and refuses a certificate whose serial it lists."""


def write_crl(cert_dir: str | os.PathLike[str], serials: Iterable[int], days: int = 30) -> Path:
    """Write DIR/crl/etcd.crl listing `serials` (needs the etcd CA key, in `ca_key_dir(DIR)`)."""
    base = Path(cert_dir)
    ca_cert, ca_key = _load_ca(base, ETCD_CA)
    now = _now()
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(ca_cert.subject)
        .last_update(now - dt.timedelta(minutes=5))
        .next_update(now + dt.timedelta(days=days))
    )
    for serial in sorted(set(serials)):
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(now).build()
        )
    crl = builder.sign(ca_key, hashes.SHA256())
    out = base / ETCD_CRL
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_bytes(crl.public_bytes(serialization.Encoding.DER))
    os.replace(tmp, out)
    return out


PRODUCTION_CRL = "/etc/kunlun/certs/" + ETCD_CRL
"""Where `kunlun-installer install --role etcd` puts the CRL that the etcd unit passes to etcd."""


def check_crl(crl_path: str | os.PathLike[str], ca_path: str | os.PathLike[str]) -> int:
    """Check that `crl_path` is a DER or PEM CRL signed by the CA certificate at `ca_path` and
    still current; return how many serials it lists. Raises ConfigError naming the file and fix."""
    fix = (
        "write it with `kunlun-cli certs init DIR` or `certs revoke ... --dir DIR` and copy DIR/crl/etcd.crl"
    )
    try:
        data = Path(crl_path).read_bytes()
        ca = x509.load_pem_x509_certificate(Path(ca_path).read_bytes())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{crl_path} / {ca_path}: cannot read ({e}); {fix}") from None
    try:
        crl = (
            x509.load_pem_x509_crl(data)
            if data.lstrip().startswith(b"-----")
            else x509.load_der_x509_crl(data)
        )
    except ValueError as e:
        raise ConfigError(f"{crl_path}: not a CRL ({e}); {fix}") from None
    if crl.issuer != ca.subject or not crl.is_signature_valid(ca.public_key()):  # type: ignore[arg-type]
        raise ConfigError(f"{crl_path}: not signed by the CA in {ca_path}; {fix}")
    next_update = crl.next_update_utc
    if next_update is not None and next_update < _now():
        raise ConfigError(f"{crl_path}: expired on {next_update:%Y-%m-%d}; {fix} again")
    return len(list(crl))


def certificate_serial(path: str | os.PathLike[str]) -> int:
    """The serial number of the PEM certificate at `path`."""
    return x509.load_pem_x509_certificate(Path(path).read_bytes()).serial_number


def find_certificate(cert_dir: str | os.PathLike[str], name: str) -> Path:
    """`role/name` or a bare `name` -> its certificate file in a `certs init` folder."""
    base = Path(cert_dir)
    if "/" in name:
        role, _, cn = name.partition("/")
        found = [base / role / f"{cn}.crt"] if (base / role / f"{cn}.crt").is_file() else []
    else:
        found = sorted(p for p in base.glob(f"*/{name}.crt") if p.parent.name != CRL_DIR)
    if len(found) != 1:
        what = (
            "no certificate"
            if not found
            else f"{len(found)} certificates ({', '.join(str(p) for p in found)})"
        )
        raise ConfigError(
            f"{what} named {name!r} in {base}; give ROLE/NAME (e.g. viewer/viewer) or the serial"
        )
    return found[0]


def bundle(cert_dir: str | os.PathLike[str], dest: str | os.PathLike[str], role: str, name: str) -> Path:
    """Copy into `dest` only what one process needs: its own certificate and key, the CA
    certificates it trusts, and for a replica its etcd client certificate (never a CA key, never
    another process's key, never the etcd admin certificate). Returns `dest`, a folder laid out
    like a `certs init` folder, so `--cert-dir=dest` works."""
    src, out = Path(cert_dir), Path(dest)
    files = [
        f"{role}/{name}.crt",
        f"{role}/{name}.key",
        *((ETCD_CA,) if role == "etcd" else (CLUSTER_CA, REPLICA_CA)),
    ]
    if role == "replica":
        files += [ETCD_CA, f"{ETCD_CLIENT}/{ETCD_USER}.crt", f"{ETCD_CLIENT}/{ETCD_USER}.key"]
    if role == "etcd" and (src / ETCD_CRL).exists():
        files.append(ETCD_CRL)
    out.mkdir(parents=True, exist_ok=True)
    os.chmod(out, 0o700)
    for rel in files:
        target = out / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".tmp")
        shutil.copyfile(src / rel, tmp)
        os.chmod(tmp, 0o600 if rel.endswith(".key") else 0o644)
        os.replace(tmp, target)
    return out
