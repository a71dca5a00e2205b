"""Refusing servers whose certificate was revoked.

grpc-python gives a client no access to the certificate the server presented (grpc/grpc#7710 and
#10927: the auth context exists on the server side only), so a client cannot check a replica's
serial on its gRPC connection. Instead, before each (re)connection, the client opens one TLS
connection of its own to the same address, verified exactly as gRPC verifies it (the same roots,
the endpoint's host name checked against the certificate, the server's role), reads the serial
the server presents, and refuses the server if that serial is revoked. While the session lasts,
the client compares that serial with every new revocation list and leaves the server when it
appears there.

Why the probe is sound: the probe and the gRPC connection reach the same address and trust the
same roots. A server holding only a revoked certificate cannot pass the probe; one that could
present a different, unrevoked certificate of the same role to the probe needs no revoked one.
A server whose certificate is revoked while a client is connected is left as soon as the client's
list shows it (within about one revocation poll, `revocation.POLL_S`, per replica).
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from pathlib import Path

from cryptography import x509

from kunlun_common.tls import TlsMaterial, identity_of


class RevokedServer(OSError):
    """The server presented a revoked certificate: try another server. An OSError, so the
    connection loops that fail over on network errors fail over on this too."""


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def presented_certificate(
    address: str, material: TlsMaterial, server_role: str = "replica", timeout: float = 3.0
) -> x509.Certificate:
    """The certificate the server at `address` (host:port) presents, verified as gRPC verifies it:
    chain to the roots for `server_role` (the replica CA for replicas, the cluster CA otherwise),
    host name or address of `address` among its names, and its role. Blocking: run it in a thread.
    Raises ssl.SSLError / OSError when the server fails any of these or cannot be reached."""
    host, port = _split(address)
    roots = material.replica_ca if server_role == "replica" else material.ca
    if not roots:
        raise ssl.SSLError(f"no CA certificate to verify {server_role} servers ({material.paths.ca})")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # check_hostname and CERT_REQUIRED by default
    ctx.load_verify_locations(cadata=roots.decode())
    ctx.set_alpn_protocols(["h2"])
    _load_client_cert(ctx, material)
    with (
        socket.create_connection((host, port), timeout=timeout) as sock,
        ctx.wrap_socket(sock, server_hostname=host) as tls_sock,
    ):
        der = tls_sock.getpeercert(binary_form=True)
    if not der:
        raise ssl.SSLError(f"{address} presented no certificate")
    cert = x509.load_der_x509_certificate(der)
    ident = identity_of(cert)
    if ident.role != server_role:
        raise ssl.SSLError(
            f"{address} presented a certificate of role {ident.role or 'none'!r} ({ident.name}); "
            f"expected a {server_role}"
        )
    return cert


def _load_client_cert(ctx: ssl.SSLContext, material: TlsMaterial) -> None:
    """Present our certificate, as the gRPC connection will (ssl loads chains from files only)."""
    cert, key = material.paths.cert, material.paths.key
    if Path(cert).exists() and Path(key).exists():
        try:
            ctx.load_cert_chain(str(cert), str(key))
        except (ssl.SSLError, OSError):
            pass  # caught mid-rotation: the server's certificate is still read (TLS 1.3)


def serial_hex(cert: x509.Certificate) -> str:
    """A serial as revocation lists hold it: lower-case hex without leading zeros."""
    return f"{cert.serial_number:x}"


async def checked_server(
    address: str,
    material: TlsMaterial,
    revoked: frozenset[str],
    server_role: str = "replica",
    connect_timeout_s: float = 3.0,
) -> str:
    """The serial the server at `address` presents, after checking it is not in `revoked`.

    Raises RevokedServer for a revoked serial, ssl.SSLError / OSError when the server cannot be
    verified or reached (each means: try another server)."""
    cert = await asyncio.to_thread(presented_certificate, address, material, server_role, connect_timeout_s)
    serial = serial_hex(cert)
    if serial in revoked:
        raise RevokedServer(
            f"{address} presents certificate {serial} ({identity_of(cert)}), which was revoked; "
            "not connecting to it (issue the server a new certificate with `kunlun-cli certs rotate`)"
        )
    return serial


def serials_in_crl(path: Path) -> frozenset[str]:
    """The serials a CRL file (DER or PEM) lists, as `serial_hex` writes them. The file is local
    configuration (like the CA file beside it), so its signature is not what is trusted here."""
    data = Path(path).read_bytes()
    crl = x509.load_pem_x509_crl(data) if data.lstrip().startswith(b"-----") else x509.load_der_x509_crl(data)
    return frozenset(f"{r.serial_number:x}" for r in crl)
