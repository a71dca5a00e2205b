"""`model verify`: the signature, then every file's size and SHA-256, in one streaming pass.

Order of checks: the archive starts with manifest.json (else: not a package); manifest.sig, when
present, must verify over the exact manifest bytes with a trusted key (before the manifest is even
parsed); then each member is streamed through SHA-256 in fixed chunks and compared with its manifest
entry. The first problem stops the pass and names the file. Optionally every file is written under a
folder while it is checked (the agent unpacks and verifies in the same pass).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from kunlun_common.messages import msg
from kunlun_common.modelpkg.errors import ContentError, MalformedPackageError, SignatureError
from kunlun_common.modelpkg.manifest import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    SIGNATURE_NAME,
    FileEntry,
    Manifest,
    digest_of,
    parse_manifest,
)
from kunlun_common.modelpkg.signing import MAX_SIG_BYTES, TrustedKeys, check_signature, read_signature
from kunlun_common.modelpkg.tarstream import Member, Sink, TarReader

VerifyProgress = Callable[[int, int], None]  # (bytes checked, bytes in the package's files)


@dataclass(frozen=True)
class Head:
    """The first members of a package: enough to inspect it without reading the weights."""

    manifest: Manifest
    manifest_bytes: bytes
    signature: bytes | None
    digest: str
    signer: str | None  # key id the signature claims (not checked here)


@dataclass(frozen=True)
class Verified:
    head: Head
    key_id: str | None  # the trusted key that signed it; None when unsigned (and allowed)
    bytes_checked: int


def _read_head(reader: TarReader) -> tuple[bytes, bytes | None, Member | None]:
    first = reader.next()
    if first is None or first.name != MANIFEST_NAME:
        found = "nothing" if first is None else repr(first.name)
        raise MalformedPackageError(
            msg(
                "package.verify.not_package_first_member",
                "not a package: the first member is {found}, expected {manifest_name}",
                found=found,
                manifest_name=MANIFEST_NAME,
            )
        )
    mbytes = reader.read_small(MAX_MANIFEST_BYTES)
    nxt = reader.next()
    sig = None
    if nxt is not None and nxt.name == SIGNATURE_NAME:
        sig = reader.read_small(MAX_SIG_BYTES)
        nxt = reader.next()
    return mbytes, sig, nxt


def read_head(path: Path) -> Head:
    """Manifest and signature of a package file (the signature is not checked: see verify)."""
    with _open(path) as f:
        mbytes, sig, _ = _read_head(TarReader(f))
    return Head(
        parse_manifest(mbytes), mbytes, sig, digest_of(mbytes), read_signature(sig)[0] if sig else None
    )


def _open(path: Path) -> BinaryIO:
    try:
        return path.open("rb", buffering=0)
    except OSError as e:
        raise MalformedPackageError(
            msg(
                "package.verify.cannot_open",
                "{path}: cannot open ({strerror})",
                path=path,
                strerror=e.strerror,
            )
        ) from None


def verify_stream(
    src: BinaryIO,
    trusted: TrustedKeys,
    *,
    require_signature: bool = True,
    extract_to: Path | None = None,
    progress: VerifyProgress | None = None,
    ignore_signature: bool = False,
) -> Verified:
    """Check (and optionally unpack) a package; `ignore_signature` checks integrity only."""
    reader = TarReader(src)
    mbytes, sig, member = _read_head(reader)
    kid: str | None = None
    if ignore_signature:
        pass
    elif sig is not None:
        kid = check_signature(mbytes, sig, trusted)
    elif require_signature:
        raise SignatureError(
            msg(
                "package.verify.package_unsigned_no_manifest",
                "package is unsigned (no manifest.sig); pack it with --sign-key, or allow unsigned packages",
            )
        )
    manifest = parse_manifest(mbytes)
    head = Head(manifest, mbytes, sig, digest_of(mbytes), kid)
    expected: dict[str, FileEntry] = {e.path: e for e in manifest.files}
    seen: set[str] = set()
    total, done = manifest.total_bytes, 0
    while member is not None:
        entry = expected.get(member.name)
        if entry is None or member.name in seen:
            why = "appears twice" if member.name in seen else "is not in the manifest (added after packing)"
            raise ContentError(f"{member.name}: {why}", member.name)
        seen.add(member.name)
        if member.size != entry.size:
            raise ContentError(
                msg(
                    "package.verify.bytes_archive_manifest_says",
                    "{name}: {size} bytes in the archive, the manifest says {size2}",
                    name=member.name,
                    size=member.size,
                    size2=entry.size,
                ),
                member.name,
            )
        h = hashlib.sha256()
        if extract_to is None:
            reader.read_into(h.update)
        else:
            dest = extract_to / member.name
            dest.parent.mkdir(parents=True, exist_ok=True)
            with dest.open("xb") as out:

                def sink(chunk: memoryview, out: BinaryIO = out, update: Sink = h.update) -> None:
                    update(chunk)
                    out.write(chunk)

                reader.read_into(sink)
        if h.hexdigest() != entry.sha256:
            raise ContentError(
                msg(
                    "package.verify.sha_differs_from_manifest",
                    "{name}: SHA-256 {value}… differs from the manifest's {value2}… (the file was changed after packing)",
                    name=member.name,
                    value=h.hexdigest()[:16],
                    value2=entry.sha256[:16],
                ),
                member.name,
            )
        done += member.size
        if progress:
            progress(done, total)
        member = reader.next()
    for e in manifest.files:
        if e.path not in seen:
            raise ContentError(
                msg(
                    "package.verify.listed_manifest_but_missing",
                    "{path}: listed in the manifest but missing from the package (removed)",
                    path=e.path,
                ),
                e.path,
            )
    return Verified(head, kid, done)


def verify_file(
    path: Path,
    trusted: TrustedKeys,
    *,
    require_signature: bool = True,
    extract_to: Path | None = None,
    progress: VerifyProgress | None = None,
    ignore_signature: bool = False,
) -> Verified:
    with _open(path) as f:
        try:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        except (AttributeError, OSError):
            pass
        return verify_stream(
            f,
            trusted,
            require_signature=require_signature,
            extract_to=extract_to,
            progress=progress,
            ignore_signature=ignore_signature,
        )
