"""Certificates as the control plane sees them: the revocation list and the inventory of
certificates in use.

| key                          | written by                           | value (JSON)                                   |
|------------------------------|--------------------------------------|------------------------------------------------|
| revoked/<serial hex>         | API (SecurityService.RevokeCertificate) | {"schema","serial","name","reason","by","at_ms"} |
| certs-seen/<role>/<name>     | any replica, when a caller presents a certificate (at most every SEEN_EVERY_MS per certificate) and for its own | {"schema","serial","not_after_ms","seen_at_ms","source"} |

Both live under `/kunlun/v1/`, the only prefix the replicas' etcd user may touch. Every replica
keeps the revocation list in memory from a watch (`Revocations`), so a revocation is enforced by
all of them within a watch round trip; agents and gateways fetch it with `ListRevocations`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable

import structlog
from cryptography import x509

from controlplane import keys
from controlplane.store import EtcdStore
from controlplane.store.contract import Resync, WatchEvent
from kunlun_common.api import security_pb2
from kunlun_common.clock import now_ms
from kunlun_common.errors import InvalidInput, KunlunError
from kunlun_common.messages import msg
from kunlun_common.tls import identity_of

log = structlog.get_logger("certs")
REVOKED = keys.ROOT + "revoked/"
SEEN = keys.ROOT + "certs-seen/"
SEEN_EVERY_MS = 10 * 60 * 1000
"""A replica writes a caller's certificate record at most this often (per certificate)."""
SEEN_KEEP_MS = 7 * 86_400_000
"""Certificates not seen for this long are left out of the inventory (their holder is gone)."""
MAX_REVOCATIONS = 10_000


def serial_hex(serial: int) -> str:
    return f"{serial:x}"


def parse_serial(text: str) -> str:
    """A serial number as typed (hex, colons or spaces allowed, optional 0x) -> canonical hex."""
    t = text.strip().lower().removeprefix("0x").replace(":", "").replace(" ", "")
    if not t or len(t) > 40 or any(c not in "0123456789abcdef" for c in t):
        raise InvalidInput(
            msg(
                "certs.serial_not_certificate_serial",
                "serial: {text!r} is not a certificate serial number in hex (e.g. 1f:a3:... from `openssl x509 -noout -serial`, or a certificate name with `certs revoke DIR NAME`)",
                text=text,
            )
        )
    return t.lstrip("0") or "0"


def revocation_of(raw: bytes) -> security_pb2.Revocation:
    d = keys.decode(raw)
    return security_pb2.Revocation(
        serial=str(d.get("serial", "")),
        name=str(d.get("name", "")),
        reason=str(d.get("reason", "")),
        by=str(d.get("by", "")),
        at_unix_ms=int(d.get("at_ms", 0)),
    )


async def revoke(store: EtcdStore, serial: str, name: str, reason: str, by: str) -> security_pb2.Revocation:
    """Record a revocation (idempotent: revoking again keeps the first record)."""
    s = parse_serial(serial)
    if len(name) > 256 or len(reason) > 1024:
        raise InvalidInput(msg("certs.name_reason_at_most", "name/reason: at most 256/1024 characters"))
    kvs, _ = await store.get_prefix(REVOKED)
    if len(kvs) >= MAX_REVOCATIONS:
        raise InvalidInput(
            msg(
                "certs.revocation_list_holds_entries",
                "the revocation list holds {max_revocations} entries; expired certificates need none",
                max_revocations=MAX_REVOCATIONS,
            )
        )
    rec = {"serial": s, "name": name, "reason": reason, "by": by, "at_ms": now_ms()}
    result = await store.create(REVOKED + s, keys.encode(rec))
    if not result.succeeded and result.reads and result.reads[0]:
        return revocation_of(result.reads[0][0].value)
    return revocation_of(keys.encode(rec))


async def list_revocations(store: EtcdStore) -> list[security_pb2.Revocation]:
    kvs, _ = await store.get_prefix(REVOKED)
    return [revocation_of(kv.value) for kv in kvs]


class Revocations:
    """The revoked serials, kept current by a watch (one per replica)."""

    def __init__(self, store: EtcdStore) -> None:
        self.store = store
        self.serials: set[str] = set()
        self.changed = asyncio.Event()
        """Set (and replaced) whenever a serial is added: streams of revoked callers end."""
        self.ready = asyncio.Event()

    def revoked(self, serial: str) -> bool:
        return serial in self.serials

    def _set(self, serials: Iterable[str]) -> None:
        new = set(serials)
        added = bool(new - self.serials)
        self.serials = new
        if added:
            self.changed.set()
            self.changed = asyncio.Event()

    async def run(self) -> None:
        """Load and follow `revoked/` until cancelled."""
        kvs, rev = await self.store.get_prefix(REVOKED)
        self._set(keys.last_segment(kv.key) for kv in kvs)
        self.ready.set()
        async for ev in self.store.watch_prefix(REVOKED, rev + 1):
            if isinstance(ev, Resync):
                self._set(keys.last_segment(kv.key) for kv in ev.kvs)
            elif isinstance(ev, WatchEvent):
                s = keys.last_segment(ev.kv.key)
                self._set(self.serials | {s} if ev.kind == "put" else self.serials - {s})
                log.info("revocation list changed", serial=s, kind=ev.kind, size=len(self.serials))


class SeenCertificates:
    """Records which certificates are in use (for `cluster status`'s expiry warning)."""

    def __init__(self, store: EtcdStore) -> None:
        self.store = store
        self._last: dict[str, float] = {}

    async def saw(self, cert: x509.Certificate, source: str = "caller") -> None:
        """Note `cert`, at most every SEEN_EVERY_MS per serial; never raises (a best-effort record)."""
        serial = serial_hex(cert.serial_number)
        now = time.monotonic()
        if now - self._last.get(serial, -1e18) < SEEN_EVERY_MS / 1000:
            return
        self._last[serial] = now
        if len(self._last) > 100_000:  # bounded memory whatever callers do
            self._last.clear()
        ident = identity_of(cert)
        if not ident.role or "/" in ident.name or not ident.name:
            return
        rec = {
            "serial": serial,
            "not_after_ms": int(cert.not_valid_after_utc.timestamp() * 1000),
            "seen_at_ms": now_ms(),
            "source": source,
        }
        with contextlib.suppress(KunlunError, TimeoutError):
            await asyncio.wait_for(self.store.put(f"{SEEN}{ident.role}/{ident.name}", keys.encode(rec)), 5.0)


async def inventory(store: EtcdStore) -> list[security_pb2.CertificateInfo]:
    """Certificates seen in use within SEEN_KEEP_MS."""
    kvs, _ = await store.get_prefix(SEEN)
    out = []
    cutoff = now_ms() - SEEN_KEEP_MS
    for kv in kvs:
        role, _, name = kv.key[len(SEEN) :].partition("/")
        try:
            d = keys.decode(kv.value)
        except ValueError:
            continue
        if int(d.get("seen_at_ms", 0)) < cutoff:
            continue
        out.append(
            security_pb2.CertificateInfo(
                role=role,
                name=name,
                serial=str(d.get("serial", "")),
                not_after_unix_ms=int(d.get("not_after_ms", 0)),
                seen_at_unix_ms=int(d.get("seen_at_ms", 0)),
                source=str(d.get("source", "")),
            )
        )
    return out
