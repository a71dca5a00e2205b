"""`manifest.json`: what a package holds, in canonical JSON (sorted keys, no spaces, UTF-8).

The package digest is `sha256:` + the SHA-256 of these bytes: the manifest pins every file by hash, so
the digest names the content, whether or not it is signed, and is known without reading the weights.
The JSON Schema is docs/kunlunpkg-manifest.schema.json; `parse_manifest` checks the same rules by hand
(the runtime has no schema library), and a test keeps the two in step.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import PurePosixPath
from typing import Any

from kunlun_common.messages import msg
from kunlun_common.modelpkg.errors import MalformedPackageError
from kunlun_common.modelpkg.weights import QUANT_BITS

FORMAT = "kunlunpkg"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
SIGNATURE_NAME = "manifest.sig"
MODEL_DIR = "model"
CACHE_DIR = "cache"
MAX_MANIFEST_BYTES = 32 << 20
MAX_FILES = 100_000
NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?$")
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
WEIGHT_FORMATS = ("safetensors", "pytorch", "gguf")


@dataclass(frozen=True)
class FileEntry:
    path: str  # archive path: model/<rel> or cache/<rel>
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    """Every field of manifest.json (see docs/kunlunpkg.md for their meaning)."""

    name: str
    version: str
    created_at: str
    weight_format: str
    architecture: str | None
    parameter_count: int | None
    parameter_count_source: str | None
    quantization: str | None
    dtypes: list[str]
    target_device_types: list[str]
    weights_bytes: int
    min_device_memory_mb: int
    engine: str
    engine_version: str
    device_profiles: list[dict[str, Any]]
    compile_cache: str | None
    files: list[FileEntry] = field(default_factory=list)
    format: str = FORMAT
    format_version: int = FORMAT_VERSION

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def canonical(self) -> bytes:
        return canonical_json(self.to_dict())

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def digest_of(manifest_bytes: bytes) -> str:
    return "sha256:" + hashlib.sha256(manifest_bytes).hexdigest()


def safe_archive_path(p: str) -> bool:
    """A relative path under model/ or cache/, normalised, without '..', empty or odd parts."""
    if not isinstance(p, str) or not p or "\\" in p or "\x00" in p or p.startswith("/"):
        return False
    parts = PurePosixPath(p).parts
    return (
        len(parts) >= 2
        and parts[0] in (MODEL_DIR, CACHE_DIR)
        and "/".join(parts) == p
        and all(x not in ("", ".", "..") for x in parts)
    )


_STR_OR_NULL = ("architecture", "parameter_count_source", "quantization", "compile_cache")


def parse_manifest(data: bytes) -> Manifest:
    """Check and load manifest.json; every problem is a MalformedPackageError naming the field."""
    try:
        doc = json.loads(data)
    except ValueError as e:
        raise MalformedPackageError(
            msg("package.manifest.manifest_json_not_json", "manifest.json is not JSON: {e}", e=e)
        ) from None
    problems: list[str] = []

    def bad(f: str, why: str) -> None:
        problems.append(f"{f}: {why}")

    if not isinstance(doc, dict):
        raise MalformedPackageError(
            msg("package.manifest.manifest_json_expected_object", "manifest.json: expected an object")
        )
    if doc.get("format") != FORMAT or doc.get("format_version") != FORMAT_VERSION:
        raise MalformedPackageError(
            msg(
                "package.manifest.manifest_json_format_version",
                "manifest.json: format {get!r} version {get2!r}; this tool reads {format} version {format_version}",
                get=doc.get("format"),
                get2=doc.get("format_version"),
                format=FORMAT,
                format_version=FORMAT_VERSION,
            )
        )
    known = {f for f in Manifest.__dataclass_fields__}
    for k in doc:
        if k not in known:
            bad(k, "unknown field")
    for k in known - set(doc):
        bad(k, "missing")
    if problems:
        raise MalformedPackageError(
            msg("package.manifest.manifest_json", "manifest.json: {items}", items="; ".join(problems))
        )
    if not isinstance(doc["name"], str) or not NAME_RE.match(doc["name"]):
        bad("name", "expected lowercase letters, digits, '.', '_', '-' (at most 63)")
    for k in ("version", "created_at", "engine", "engine_version"):
        if not isinstance(doc[k], str) or len(doc[k]) > 200:
            bad(k, "expected a string of at most 200 characters")
    if doc["weight_format"] not in WEIGHT_FORMATS:
        bad("weight_format", f"expected one of {', '.join(WEIGHT_FORMATS)}")
    for k in _STR_OR_NULL:
        if doc[k] is not None and not isinstance(doc[k], str):
            bad(k, "expected a string or null")
    if doc["quantization"] is not None and doc["quantization"] not in QUANT_BITS:
        bad("quantization", f"expected one of {', '.join(QUANT_BITS)} or null")
    if doc["parameter_count"] is not None and not _nonneg_int(doc["parameter_count"]):
        bad("parameter_count", "expected a non-negative integer or null")
    for k in ("weights_bytes", "min_device_memory_mb"):
        if not _nonneg_int(doc[k]):
            bad(k, "expected a non-negative integer")
    for k in ("dtypes", "target_device_types"):
        if not isinstance(doc[k], list) or not all(isinstance(x, str) for x in doc[k]):
            bad(k, "expected a list of strings")
    if not isinstance(doc["device_profiles"], list) or not all(
        isinstance(x, dict) for x in doc["device_profiles"]
    ):
        bad("device_profiles", "expected a list of objects")
    files = doc["files"]
    entries: list[FileEntry] = []
    if not isinstance(files, list) or len(files) > MAX_FILES:
        bad("files", f"expected a list of at most {MAX_FILES} entries")
    else:
        seen: set[str] = set()
        for i, f in enumerate(files):
            if not isinstance(f, dict) or set(f) != {"path", "size", "sha256"}:
                bad(f"files[{i}]", "expected {path, size, sha256}")
                continue
            if not safe_archive_path(f["path"]) or f["path"] in seen:
                bad(f"files[{i}].path", f"{f['path']!r} is not a unique relative path under model/ or cache/")
            if not _nonneg_int(f["size"]):
                bad(f"files[{i}].size", "expected a non-negative integer")
            if not isinstance(f["sha256"], str) or not SHA256_RE.match(f["sha256"]):
                bad(f"files[{i}].sha256", "expected 64 lowercase hex digits")
            seen.add(str(f["path"]))
            entries.append(FileEntry(f["path"], f["size"], f["sha256"]))
    if problems:
        raise MalformedPackageError(
            msg("package.manifest.manifest_json_2", "manifest.json: {items}", items="; ".join(problems))
        )
    fields = {k: doc[k] for k in known if k != "files"}
    return Manifest(**fields, files=entries)


def _nonneg_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0
