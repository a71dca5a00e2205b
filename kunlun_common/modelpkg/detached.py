"""Detached Ed25519 signatures of small files (device declarations): `FILE.sig` next to `FILE`.

`FILE.sig` is the same JSON document as a package's manifest.sig, signing the file's exact bytes.
`read_verified` reads the file once and returns the bytes it checked, so the caller parses exactly
what was verified (no window in which the file could be swapped between check and use).
"""

from __future__ import annotations

import os
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kunlun_common.messages import msg
from kunlun_common.modelpkg.errors import MalformedPackageError, SignatureError
from kunlun_common.modelpkg.signing import MAX_SIG_BYTES, TrustedKeys, check_signature, sign_manifest

MAX_SIGNED_FILE_BYTES = 4 << 20


def sig_path(path: Path) -> Path:
    return path.with_name(path.name + ".sig")


def _read(path: Path, limit: int, what: str) -> bytes:
    try:
        with path.open("rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise SignatureError(
            msg(
                "package.detached.cannot_read",
                "{path}: cannot read {what} ({strerror})",
                path=path,
                what=what,
                strerror=e.strerror,
            )
        ) from None
    if len(data) > limit:
        raise SignatureError(
            msg(
                "package.detached.larger_than_bytes",
                "{path}: {what} larger than {limit} bytes",
                path=path,
                what=what,
                limit=limit,
            )
        )
    return data


def sign_file(path: Path, key: Ed25519PrivateKey) -> Path:
    """Write `FILE.sig` for the current bytes of `path`; return its path."""
    data = _read(path, MAX_SIGNED_FILE_BYTES, "the file to sign")
    out = sig_path(path)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_bytes(sign_manifest(data, key))
    os.replace(tmp, out)
    return out


def read_verified(path: Path, trusted: TrustedKeys) -> tuple[bytes, str]:
    """(the file's bytes, signing key id) when `FILE.sig` is a valid signature by a trusted key."""
    data = _read(path, MAX_SIGNED_FILE_BYTES, "the signed file")
    sp = sig_path(path)
    if not sp.exists():
        raise SignatureError(
            msg(
                "package.detached.unsigned_no_next_sign",
                "{path} is unsigned (no {name} next to it); sign it with `kunlun-cli declaration sign FILE --sign-key KEY` or turn the signature requirement off",
                path=path,
                name=sp.name,
            )
        )
    sig = _read(sp, MAX_SIG_BYTES, "the signature")
    try:
        kid = check_signature(data, sig, trusted)
    except MalformedPackageError as e:
        raise SignatureError(f"{sp}: {e}") from None
    except SignatureError as e:
        if "does not match" in str(e):
            raise SignatureError(
                msg(
                    "package.detached.changed_since_was_signed",
                    "{path} changed since it was signed ({name} does not match its bytes); review the change and sign it again",
                    path=path,
                    name=sp.name,
                )
            ) from None
        raise SignatureError(f"{path}: {e}") from None
    return data, kid
