"""Ed25519 keys and the detached signature of a package manifest.

`manifest.sig` is JSON: `{"algorithm": "ed25519", "key_id": "...", "signature": "<base64>"}`. The
signature covers the exact bytes of `manifest.json` as stored in the archive (which the packer writes in
canonical form), so nothing is re-serialised before checking. A key id is `ed25519:` and the first 16 hex
digits of the SHA-256 of the raw 32-byte public key: short enough to read, and it names the key a
signature claims so the verifier looks up exactly one trusted key.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from kunlun_common.errors import ConfigError
from kunlun_common.messages import msg
from kunlun_common.modelpkg.errors import MalformedPackageError, SignatureError

ALGORITHM = "ed25519"
MAX_SIG_BYTES = 4096


def key_id(public: Ed25519PublicKey) -> str:
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return f"{ALGORITHM}:{hashlib.sha256(raw).hexdigest()[:16]}"


def generate_keypair(private_path: Path, public_path: Path) -> str:
    """Write a new private key (PKCS#8 PEM, mode 0600, never overwritten) and its public key; return the id."""
    if private_path.exists() or public_path.exists():
        raise ConfigError(
            msg(
                "package.signing.exists_choose_another_name",
                "{value} exists; choose another name",
                value=private_path if private_path.exists() else public_path,
            )
        )
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    public_path.write_bytes(public_pem(key.public_key()))
    return key_id(key.public_key())


def public_pem(public: Ed25519PublicKey) -> bytes:
    return public.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def load_private_key(path: Path) -> Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError(
            msg(
                "package.signing.not_readable_unencrypted_pem",
                "{path}: not a readable unencrypted PEM private key ({e}); make one with `model keygen`",
                path=path,
                e=e,
            )
        ) from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigError(
            msg(
                "package.signing.not_ed_key_make",
                "{path}: not an Ed25519 key; make one with `kunlun-cli model keygen`",
                path=path,
            )
        )
    return key


def parse_public_key(pem: bytes, source: str) -> Ed25519PublicKey:
    try:
        key = serialization.load_pem_public_key(pem)
    except (ValueError, TypeError) as e:
        raise ConfigError(
            msg(
                "package.signing.not_pem_public_key",
                "{source}: not a PEM public key ({e}); use the .pub file from `model keygen`",
                source=source,
                e=e,
            )
        ) from None
    if not isinstance(key, Ed25519PublicKey):
        raise ConfigError(
            msg(
                "package.signing.not_ed_public_key",
                "{source}: not an Ed25519 public key; use the .pub file from `model keygen`",
                source=source,
            )
        )
    return key


@dataclass(frozen=True)
class TrustedKeys:
    """Public keys whose signatures are accepted, by key id."""

    keys: dict[str, Ed25519PublicKey]

    @classmethod
    def load(cls, files: list[Path], dirs: list[Path]) -> TrustedKeys:
        """The given public key files, and every `*.pub` in the given folders (a missing folder has none)."""
        keys: dict[str, Ed25519PublicKey] = {}
        every = list(files)
        for d in dirs:
            every.extend(sorted(d.glob("*.pub")) if d.is_dir() else [])
        for f in every:
            try:
                pem = f.read_bytes()
            except OSError as e:
                raise ConfigError(
                    msg(
                        "package.signing.cannot_read_trusted_key",
                        "{f}: cannot read trusted key ({strerror})",
                        f=f,
                        strerror=e.strerror,
                    )
                ) from None
            k = parse_public_key(pem, str(f))
            keys[key_id(k)] = k
        return cls(keys)

    @classmethod
    def from_pems(cls, pems: list[bytes]) -> TrustedKeys:
        keys = [parse_public_key(p, "trusted key") for p in pems]
        return cls({key_id(k): k for k in keys})


def sign_manifest(manifest_bytes: bytes, key: Ed25519PrivateKey) -> bytes:
    """The bytes of `manifest.sig` for these exact manifest bytes."""
    sig = key.sign(manifest_bytes)
    doc = {
        "algorithm": ALGORITHM,
        "key_id": key_id(key.public_key()),
        "signature": base64.b64encode(sig).decode(),
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def read_signature(sig_bytes: bytes) -> tuple[str, bytes]:
    """(key id, raw signature) from `manifest.sig`; malformed content is a MalformedPackageError."""
    try:
        doc = json.loads(sig_bytes)
        if not isinstance(doc, dict) or doc.get("algorithm") != ALGORITHM:
            raise ValueError(f"algorithm must be {ALGORITHM!r}")
        kid, sig_b64 = doc["key_id"], doc["signature"]
        if not isinstance(kid, str) or not isinstance(sig_b64, str):
            raise ValueError("key_id and signature must be strings")
        return kid, base64.b64decode(sig_b64, validate=True)
    except (ValueError, KeyError, binascii.Error) as e:
        raise MalformedPackageError(
            msg(
                "package.signing.manifest_sig_not_valid",
                "manifest.sig is not a valid signature document: {e}",
                e=e,
            )
        ) from None


def check_signature(manifest_bytes: bytes, sig_bytes: bytes, trusted: TrustedKeys) -> str:
    """The signing key id when the signature is valid and by a trusted key; else SignatureError."""
    kid, sig = read_signature(sig_bytes)
    key = trusted.keys.get(kid)
    if key is None:
        raise SignatureError(
            msg(
                "package.signing.manifest_signed_by_untrusted",
                "manifest signed by untrusted key {kid}; trust its public key (`model verify --trusted-key FILE.pub`, or `model trust add` in the cluster) if you know its owner",
                kid=kid,
            )
        )
    try:
        key.verify(sig, manifest_bytes)
    except InvalidSignature:
        raise SignatureError(
            msg(
                "package.signing.manifest_sig_does_not",
                "manifest.sig does not match manifest.json (key {kid}): the manifest was changed after signing",
                kid=kid,
            )
        ) from None
    return kid
