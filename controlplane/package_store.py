"""The replica side of the cluster's package store: blobs on this replica's disk, the index in etcd.

Keys (under `/kunlun/v1/`): `packages/<hex digest>` = {"name", "version", "digest", "size_bytes",
"weight_format", "quantization", "min_device_memory_mb", "engine", "target_device_types",
"signed_by", "pushed_by", "pushed_at_ms", "holders": [replica names]}. Blobs:
`<package_store_dir>/blobs/<hex>.kunlunpkg`, written to `tmp/` while received, verified (hashes, and
the signature with the cluster's trusted keys when signed) in a worker thread, then renamed. Holders
are added and removed with compare-and-set on the index key's revision.

Next to each blob, `<hex>.chunks` holds the SHA-256 of every PULL_CHUNK bytes of it (32 raw bytes
each), computed while the push was received and kept only once the whole package verified: a pull
sends each chunk with that push-time digest, so a blob changed on this disk afterwards is caught
chunk by chunk by the agent (controlplane/package_pull.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controlplane import keys
from controlplane.store import Compare, EtcdStore
from controlplane.store.contract import DeleteOp, PutOp
from kunlun_common.clock import now_ms
from kunlun_common.errors import PermanentError, TemporaryError
from kunlun_common.messages import msg
from kunlun_common.modelpkg import TrustedKeys, Verified, verify_file

PACKAGES = keys.PACKAGES
TRUST = keys.PACKAGE_TRUST
CAS_TRIES = 8
PULL_CHUNK = 1 << 20
"""Bytes per pulled chunk (the unit of verification and of resuming)."""


class QuotaExceeded(PermanentError):
    """The package would take the store past its quota."""


@dataclass(frozen=True)
class BlobStore:
    """This replica's package folder."""

    root: Path

    def blob(self, hexd: str) -> Path:
        return self.root / "blobs" / f"{hexd}.kunlunpkg"

    def chunks(self, hexd: str) -> Path:
        return self.root / "blobs" / f"{hexd}.chunks"

    def new_tmp(self) -> Path:
        (self.root / "tmp").mkdir(parents=True, exist_ok=True)
        (self.root / "blobs").mkdir(parents=True, exist_ok=True)
        return self.root / "tmp" / f"{uuid.uuid4().hex}.partial"


class ChunkHasher:
    """SHA-256 of every PULL_CHUNK bytes of a stream fed in pieces of any size."""

    def __init__(self, chunk: int = PULL_CHUNK) -> None:
        self.chunk = chunk
        self.digests: list[bytes] = []
        self._h = hashlib.sha256()
        self._n = 0

    def feed(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            take = min(len(view), self.chunk - self._n)
            self._h.update(view[:take])
            self._n += take
            view = view[take:]
            if self._n == self.chunk:
                self.digests.append(self._h.digest())
                self._h, self._n = hashlib.sha256(), 0

    def finish(self) -> bytes:
        """All digests, 32 bytes each (the last chunk may be short)."""
        if self._n:
            self.digests.append(self._h.digest())
            self._h, self._n = hashlib.sha256(), 0
        return b"".join(self.digests)


def chunk_digests_of(path: Path, chunk: int = PULL_CHUNK) -> bytes:
    """The chunk digests of a file (blocking: run in a thread)."""
    h = ChunkHasher(chunk)
    with path.open("rb") as f:
        while data := f.read(chunk):
            h.feed(data)
    return h.finish()


async def trusted_keys(store: EtcdStore) -> TrustedKeys:
    kvs, _ = await store.get_prefix(TRUST)
    return TrustedKeys.from_pems([str(keys.decode(kv.value)["pem"]).encode() for kv in kvs])


async def used_bytes(store: EtcdStore, except_digest: str = "") -> int:
    kvs, _ = await store.get_prefix(PACKAGES)
    return sum(
        int(keys.decode(kv.value).get("size_bytes", 0)) for kv in kvs if not kv.key.endswith(except_digest)
    )


def record_of(v: Verified, size: int, by: str) -> dict[str, Any]:
    m = v.head.manifest
    return {
        "name": m.name,
        "version": m.version,
        "digest": v.head.digest,
        "size_bytes": size,
        "weight_format": m.weight_format,
        "quantization": m.quantization or "",
        "min_device_memory_mb": m.min_device_memory_mb,
        "engine": m.engine,
        "target_device_types": m.target_device_types,
        "signed_by": v.key_id or "",
        "pushed_by": by,
        "pushed_at_ms": now_ms(),
        "holders": [],
    }


async def verify_blob(tmp: Path, trusted: TrustedKeys) -> Verified:
    """Hashes always; the signature when present (an untrusted signer is refused)."""
    return await asyncio.to_thread(verify_file, tmp, trusted, require_signature=False)


async def add_holder(store: EtcdStore, rec: dict[str, Any], replica: str, quota: int) -> dict[str, Any]:
    """Index the package with this replica as a holder (CAS); QuotaExceeded when it does not fit."""
    hexd = str(rec["digest"]).removeprefix("sha256:")
    key = PACKAGES + hexd
    for _ in range(CAS_TRIES):
        kv = await store.get(key)
        if kv is None:
            if await used_bytes(store, hexd) + int(rec["size_bytes"]) > quota:
                raise QuotaExceeded(
                    msg(
                        "package.store.package_store_quota_bytes",
                        "package store quota of {quota} bytes would be exceeded by {size_bytes} bytes; delete packages (`kunlun-cli model delete`) or raise package_store_quota_bytes",
                        quota=quota,
                        size_bytes=rec["size_bytes"],
                    )
                )
            new = {**rec, "holders": [replica]}
            res = await store.txn([Compare.absent(key)], [PutOp(key, keys.encode(new))])
        else:
            cur = keys.decode(kv.value)
            if replica in cur.get("holders", []):
                return cur
            new = {**cur, "holders": sorted({*cur.get("holders", []), replica})}
            new.pop("schema", None)
            res = await store.txn([Compare.unchanged(key, kv.mod_revision)], [PutOp(key, keys.encode(new))])
        if res.succeeded:
            return new
    raise TemporaryError(
        msg("package.store.index_kept_changing_push", "index {key} kept changing; push again", key=key)
    )


async def remove_holder(store: EtcdStore, hexd: str, replica: str) -> dict[str, Any] | None:
    """Drop this replica from the holders (the entry goes with the last); None when not indexed."""
    key = PACKAGES + hexd
    for _ in range(CAS_TRIES):
        kv = await store.get(key)
        if kv is None:
            return None
        cur = keys.decode(kv.value)
        cur.pop("schema", None)
        holders = [h for h in cur.get("holders", []) if h != replica]
        op: PutOp | DeleteOp = (
            PutOp(key, keys.encode({**cur, "holders": holders})) if holders else DeleteOp(key)
        )
        res = await store.txn([Compare.unchanged(key, kv.mod_revision)], [op])
        if res.succeeded:
            return {**cur, "holders": holders}
    raise TemporaryError(
        msg("package.store.index_kept_changing_delete", "index {key} kept changing; delete again", key=key)
    )


def remove_file(p: Path) -> None:
    try:
        os.unlink(p)
    except FileNotFoundError:
        pass
