"""The cluster backup file: a header line, one line per key, one SHA-256 over both.

    {"format": "kunlun-backup", "format_version": 1, "revision": R, ...,"sha256": "<hex>"}\\n
    {"key": "/kunlun/v1/workloads/w-1", "value": "<base64>", "create_revision": .., ...}\\n
    ...

The header (one JSON object on the first line) says what the file holds: the format version, the
kunlun release that wrote it, the etcd revision every key was read at, the etcd cluster id, when
(UTC), the key prefix, how many keys follow and which were left out. `sha256` covers the header
without its own field (canonical JSON: sorted keys, no spaces) plus every byte after the first line,
so any changed byte anywhere is found before anything is restored.

Written atomically (a temporary file beside the target, fsync, rename, fsync of the folder) and
with mode 0600: a backup holds the whole goal state, including workload environment values.

Pure: no etcd here (controlplane.store.backup reads and writes the cluster).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kunlun_common.errors import PermanentError

FORMAT = "kunlun-backup"
FORMAT_VERSION = 1
"""Version of this layout; a reader refuses a newer one (it cannot know what changed)."""
MAX_HEADER_BYTES = 64 * 1024


class BackupFileError(PermanentError):
    """The backup file cannot be used; the message names the file, the field and the fix."""


@dataclass(frozen=True)
class Record:
    """One key as it was in etcd."""

    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    version: int


@dataclass(frozen=True)
class BackupHeader:
    """What a backup file holds (the first line of the file)."""

    revision: int
    """The etcd revision every key was read at (one consistent point in time)."""
    cluster_id: str
    """The etcd cluster id (hex) the keys came from."""
    taken_at: str
    """When the read was made (ISO 8601, UTC)."""
    taken_at_ms: int
    """The same, in milliseconds since the epoch."""
    prefix: str
    """Every key starts with it (the replicas' etcd permission: `/kunlun/`)."""
    keys: int
    """How many key lines follow the header."""
    kunlun_version: str
    """The release that wrote the file."""
    skipped: dict[str, int] = field(default_factory=dict)
    """Keys left out and why (`leased`: bound to a lease, never restored; see store.backup)."""
    format: str = FORMAT
    format_version: int = FORMAT_VERSION


def _canonical(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _record_line(r: Record) -> bytes:
    return (
        _canonical(
            {
                "key": r.key,
                "value": base64.b64encode(r.value).decode(),
                "create_revision": r.create_revision,
                "mod_revision": r.mod_revision,
                "version": r.version,
            }
        )
        + b"\n"
    )


def write_backup(path: Path, header: BackupHeader, records: Iterable[Record]) -> str:
    """Write the file atomically (never a half-written FILE); return its SHA-256."""
    body = b"".join(_record_line(r) for r in records)
    head = asdict(header)
    digest = hashlib.sha256(_canonical(head) + b"\n" + body).hexdigest()
    line = _canonical({**head, "sha256": digest}) + b"\n"
    path = path.absolute()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(line)
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return digest


def _fail(path: Path, where: str, problem: str, fix: str) -> BackupFileError:
    return BackupFileError(f"{path}: {where}: {problem}; {fix}")


_DAMAGED = "the file is damaged or was edited: use another copy of the backup"
_HEADER_FIELDS: dict[str, type | tuple[type, ...]] = {
    "format": str,
    "format_version": int,
    "revision": int,
    "cluster_id": str,
    "taken_at": str,
    "taken_at_ms": int,
    "prefix": str,
    "keys": int,
    "kunlun_version": str,
    "skipped": dict,
    "sha256": str,
}


def _header(path: Path, first: bytes) -> tuple[BackupHeader, str, dict[str, Any]]:
    if not first.endswith(b"\n"):
        raise _fail(path, "header", "no complete first line (the file is empty or truncated)", _DAMAGED)
    try:
        raw = json.loads(first)
    except ValueError as e:
        raise _fail(path, "header", f"line 1 is not JSON ({e})", _DAMAGED) from None
    if not isinstance(raw, dict):
        raise _fail(path, "header", "line 1 is not a JSON object", _DAMAGED)
    if raw.get("format") != FORMAT:
        raise _fail(
            path,
            "header.format",
            f"expected {FORMAT!r}, found {raw.get('format')!r}",
            "this is not a file written by `kunlun-cli cluster backup`",
        )
    for name, kind in _HEADER_FIELDS.items():
        value = raw.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise _fail(
                path, f"header.{name}", f"missing or not a {getattr(kind, '__name__', kind)}", _DAMAGED
            )
    if raw["format_version"] > FORMAT_VERSION:
        raise _fail(
            path,
            "header.format_version",
            f"version {raw['format_version']} is newer than this release reads ({FORMAT_VERSION})",
            f"restore with the kunlun-cli of release {raw['kunlun_version']} or later",
        )
    if raw["revision"] <= 0 or raw["keys"] < 0 or not raw["prefix"].startswith("/"):
        raise _fail(path, "header", "revision, keys or prefix out of range", _DAMAGED)
    digest = raw.pop("sha256")
    head = {k: raw[k] for k in _HEADER_FIELDS if k != "sha256"}
    header = BackupHeader(**head)
    return header, digest, head


def _record(path: Path, lineno: int, line: bytes, prefix: str) -> Record:
    where = f"line {lineno}"
    try:
        raw = json.loads(line)
        if not isinstance(raw, dict):
            raise ValueError("not a JSON object")
        key, value = raw["key"], base64.b64decode(raw["value"], validate=True)
        revs = [raw["create_revision"], raw["mod_revision"], raw["version"]]
    except (ValueError, KeyError, TypeError, binascii.Error) as e:
        raise _fail(path, where, f"not a key record ({e})", _DAMAGED) from None
    if not isinstance(key, str) or not key.startswith(prefix):
        raise _fail(path, f"{where}.key", f"{key!r} is outside the prefix {prefix!r}", _DAMAGED)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in revs):
        raise _fail(path, f"{where}.create_revision", "revisions must be whole numbers >= 0", _DAMAGED)
    return Record(key, value, *revs)


def read_backup(path: Path) -> tuple[BackupHeader, list[Record]]:
    """Read and validate the whole file (header, checksum, every record) before anyone uses it."""
    try:
        f = path.open("rb")
    except OSError as e:
        raise _fail(path, "file", f"cannot be read ({e.strerror})", "name an existing backup file") from None
    with f:
        first = f.readline(MAX_HEADER_BYTES)
        header, digest, head = _header(path, first)
        h = hashlib.sha256(_canonical(head) + b"\n")
        lines: list[bytes] = []
        for line in f:
            h.update(line)
            lines.append(line)
    if h.hexdigest() != digest:
        raise _fail(
            path,
            "header.sha256",
            f"the contents do not match the checksum (recorded {digest[:16]}…, computed {h.hexdigest()[:16]}…)",
            _DAMAGED,
        )
    if len(lines) != header.keys:
        raise _fail(path, "header.keys", f"says {header.keys} keys, the file holds {len(lines)}", _DAMAGED)
    records: list[Record] = []
    seen: set[str] = set()
    for i, line in enumerate(lines, start=2):
        r = _record(path, i, line, header.prefix)
        if r.key in seen:
            raise _fail(path, f"line {i}.key", f"{r.key!r} appears twice", _DAMAGED)
        seen.add(r.key)
        records.append(r)
    return header, records
