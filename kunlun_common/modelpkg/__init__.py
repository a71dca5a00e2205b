"""Offline model packages (`.kunlunpkg`): format, signing, packing and streaming verification.

Used by `kunlun-cli model ...` and by node agents. The format is documented in docs/kunlunpkg.md.
"""

from kunlun_common.modelpkg.errors import (
    EXIT_CONTENT,
    EXIT_MALFORMED,
    EXIT_OK,
    EXIT_SIGNATURE,
    EXIT_USAGE,
    ContentError,
    MalformedPackageError,
    PackageError,
    PackInputError,
    SignatureError,
)
from kunlun_common.modelpkg.manifest import FileEntry, Manifest, digest_of, parse_manifest
from kunlun_common.modelpkg.pack import PackOptions, PackResult, pack
from kunlun_common.modelpkg.signing import TrustedKeys, generate_keypair, key_id, load_private_key
from kunlun_common.modelpkg.verify import Head, Verified, read_head, verify_file, verify_stream

__all__ = [
    "EXIT_CONTENT",
    "EXIT_MALFORMED",
    "EXIT_OK",
    "EXIT_SIGNATURE",
    "EXIT_USAGE",
    "ContentError",
    "FileEntry",
    "Head",
    "MalformedPackageError",
    "Manifest",
    "PackInputError",
    "PackOptions",
    "PackResult",
    "PackageError",
    "SignatureError",
    "TrustedKeys",
    "Verified",
    "digest_of",
    "generate_keypair",
    "key_id",
    "load_private_key",
    "pack",
    "parse_manifest",
    "read_head",
    "verify_file",
    "verify_stream",
]
