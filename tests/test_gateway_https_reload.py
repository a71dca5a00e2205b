"""A real kunlun-gateway process re-reads its HTTPS certificate (tls_cert/tls_key) on SIGHUP:
new connections get the new certificate, open ones carry on, and a broken pair keeps the old one."""

from __future__ import annotations

import shutil
import signal
import socket
import ssl
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509

from devcluster.procs import ManagedProcess, free_port, wait_for
from kunlun_common.pki import CLUSTER_CA, create_ca, issue, renew

pytestmark = pytest.mark.process


class Gw:
    def __init__(self, base: Path) -> None:
        self.certs = base / "certs"
        create_ca(self.certs)
        self.pair = issue(self.certs, "gateway", "gateway-1")
        self.port = free_port()
        cfg = base / "gateway.yaml"
        cfg.write_text(
            "name: gateway-1\n"
            f"listen: 127.0.0.1:{self.port}\n"
            "static_endpoints: ['chat=127.0.0.1:9']\n"
            f"tls_cert: {self.pair.cert}\n"
            f"tls_key: {self.pair.key}\n"
        )
        self.proc = ManagedProcess(
            "gw", [sys.executable, "-m", "gateway.main", "--config", str(cfg)], base / "gw.log"
        )
        self.client = ssl.create_default_context(cafile=str(self.certs / CLUSTER_CA))

    def connect(self) -> ssl.SSLSocket:
        raw = socket.create_connection(("127.0.0.1", self.port), timeout=5)
        try:
            return self.client.wrap_socket(raw, server_hostname="127.0.0.1")
        except BaseException:
            raw.close()
            raise

    def served_serial(self) -> int:
        """The serial of the certificate a new TLS connection is shown (verified against the CA)."""
        with self.connect() as s:
            der = s.getpeercert(binary_form=True)
            assert der is not None
            return x509.load_der_x509_certificate(der).serial_number

    def log_count(self, text: str) -> int:
        return self.proc.log_text().count(text)

    def hup_and_wait(self, line: str) -> None:
        before = self.log_count(line)
        self.proc.signal(signal.SIGHUP)
        wait_for(lambda: self.log_count(line) > before, 30, f"the gateway to log {line!r} after SIGHUP")


@pytest.fixture
def gw(tmp_path: Path) -> Iterator[Gw]:
    g = Gw(tmp_path)
    g.proc.start()
    try:

        def up() -> bool:
            assert g.proc.alive(), g.proc.log_text()[-2000:]
            try:
                g.served_serial()
                return True
            except OSError:
                return False

        wait_for(up, 60, "the gateway's HTTPS listener")
        yield g
    finally:
        g.proc.stop()


def request(s: ssl.SSLSocket) -> bytes:
    s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: gw\r\n\r\n")
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, f"connection closed after {data!r}"
        data += chunk
    return data.split(b"\r\n", 1)[0]


def test_sighup_serves_a_new_certificate_and_refuses_a_broken_pair(gw: Gw, tmp_path: Path) -> None:
    first = gw.served_serial()
    assert first == x509.load_pem_x509_certificate(gw.pair.cert.read_bytes()).serial_number
    open_conn = gw.connect()
    try:
        assert request(open_conn) == b"HTTP/1.1 200 OK"
        renewed = renew(gw.certs, "gateway", "gateway-1")
        assert renewed.new_serial != first
        assert gw.served_serial() == first, "nothing changes before the SIGHUP"
        gw.hup_and_wait("HTTPS certificate reloaded")
        assert gw.served_serial() == renewed.new_serial
        assert request(open_conn) == b"HTTP/1.1 200 OK", "an open connection carries on"
    finally:
        open_conn.close()

    # a key that belongs to another certificate (as if caught between the two file writes)
    saved_key = tmp_path / "saved.key"
    shutil.copyfile(gw.pair.key, saved_key)
    other = issue(gw.certs, "gateway", "gateway-2")
    shutil.copyfile(other.key, gw.pair.key)
    gw.hup_and_wait("HTTPS certificate reload refused")
    assert "is the key this certificate's?" in gw.proc.log_text()
    assert gw.served_serial() == renewed.new_serial
    # a certificate file that is not a certificate
    shutil.copyfile(saved_key, gw.pair.key)
    gw.pair.cert.write_text("not a certificate\n")
    gw.hup_and_wait("HTTPS certificate reload refused")
    assert "not a PEM certificate" in gw.proc.log_text()
    assert gw.served_serial() == renewed.new_serial
    assert gw.proc.alive()
