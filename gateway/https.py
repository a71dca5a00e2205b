"""The gateway's own HTTPS certificate (`tls_cert`/`tls_key`), re-read on SIGHUP.

The listener keeps one `ssl.SSLContext` for its whole life (asyncio binds it to the server);
a reload loads the new pair into that same context, so every handshake from then on presents the
new certificate while open connections carry on. The files are read once into a private temporary
folder and first loaded into a scratch context: a pair that does not load (unreadable, not PEM,
a key of another certificate, caught between the two file writes), an expired certificate, or a
key of another type (OpenSSL keeps one certificate per key type in a context, so the old one
would still be served to some clients) is refused, the old certificate stays, and the refusal
is logged.
"""

from __future__ import annotations

import datetime as dt
import os
import ssl
import tempfile
from pathlib import Path

import structlog
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from kunlun_common.errors import ConfigError
from kunlun_common.messages import msg, msg_list, of_error

log = structlog.get_logger("gateway")


def _key_type(key_pem: bytes) -> str:
    try:
        return type(serialization.load_pem_private_key(key_pem, password=None)).__name__
    except (ValueError, TypeError) as e:
        raise ConfigError(
            msg("gateway.https.bad_key", "not a readable unencrypted PEM private key ({error})", error=str(e))
        ) from None


class HttpsCertificate:
    """The listener's context and what it serves now."""

    def __init__(self, cert_path: str, key_path: str) -> None:
        self.cert_path = cert_path
        self.key_path = key_path
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.serial = 0
        """Serial number of the certificate served now."""
        self.key_type = ""
        self.reloads = 0
        """Reloads that replaced the certificate."""
        self._load(first=True)

    def _load(self, first: bool) -> None:
        where = f"tls_cert/tls_key {self.cert_path} / {self.key_path}"
        try:
            cert_pem = Path(self.cert_path).read_bytes()
            key_pem = Path(self.key_path).read_bytes()
        except OSError as e:
            raise ConfigError(
                msg(
                    "gateway.https.unreadable",
                    "{where}: cannot read ({reason})",
                    where=where,
                    reason=e.strerror,
                )
            ) from None
        try:
            cert = x509.load_pem_x509_certificate(cert_pem)
        except ValueError as e:
            raise ConfigError(
                msg(
                    "gateway.https.not_pem",
                    "{where}: not a PEM certificate ({error})",
                    where=where,
                    error=str(e),
                )
            ) from None
        try:
            key_type = _key_type(key_pem)
        except ConfigError as e:
            raise ConfigError(
                msg_list("gateway.https.key", "{where}: {parts}", [of_error(e)], bullet="", where=where)
            ) from None
        if cert.not_valid_after_utc < dt.datetime.now(dt.UTC):
            raise ConfigError(
                msg(
                    "gateway.https.expired",
                    "{where}: the certificate expired on {day}",
                    where=where,
                    day=f"{cert.not_valid_after_utc:%Y-%m-%d}",
                )
            )
        if not first and key_type != self.key_type:
            raise ConfigError(
                msg(
                    "gateway.https.key_type",
                    "{where}: the key type changed ({old} -> {new}); restart the gateway for that",
                    where=where,
                    old=self.key_type,
                    new=key_type,
                )
            )
        with tempfile.TemporaryDirectory(prefix="kunlun-gw-tls-") as tmp:  # mode 0700
            c, k = os.path.join(tmp, "cert.pem"), os.path.join(tmp, "key.pem")
            for path, data in ((c, cert_pem), (k, key_pem)):
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
            scratch = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            try:
                scratch.load_cert_chain(c, k)
            except ssl.SSLError as e:
                raise ConfigError(
                    msg(
                        "gateway.https.pair",
                        "{where}: cannot load the pair ({reason}); is the key this certificate's?",
                        where=where,
                        reason=str(e.reason or e),
                    )
                ) from None
            self.context.load_cert_chain(c, k)  # the same bytes: cannot fail now
        self.serial, self.key_type = cert.serial_number, key_type

    def reload(self) -> bool:
        """SIGHUP: re-read the pair; True if the new certificate is served from now on."""
        old = self.serial
        try:
            self._load(first=False)
        except ConfigError as e:
            log.error(
                "HTTPS certificate reload refused; keeping the current one", error=str(e), serial=f"{old:x}"
            )
            return False
        self.reloads += 1
        log.info("HTTPS certificate reloaded", old_serial=f"{old:x}", serial=f"{self.serial:x}")
        return True
