"""Serving package pulls (PackageService.PullPackage): agents fetch the packages their node needs.

Who may pull: operators and replicas any stored package; an agent only a package that one of its
node's current assignments names (`spec.package`), read from the replica's feeds (the same view
that pushes the node its assignments). Identity and role come from the client certificate.

What is sent: the blob from `offset` (0, or where the caller's last verified chunk ended) in
PULL_CHUNK pieces, each with its push-time SHA-256 from the `<hex>.chunks` record
(controlplane/package_store.py). A blob stored before chunk records existed gets one now, but only
after the whole blob verified again. Reads run in worker threads; gRPC flow control paces the
stream to the reader.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from pathlib import Path

from controlplane import keys
from controlplane.feeds import Feeds
from controlplane.package_store import (
    PACKAGES,
    PULL_CHUNK,
    BlobStore,
    chunk_digests_of,
    trusted_keys,
    verify_blob,
)
from controlplane.store import EtcdStore
from kunlun_common.api import package_pb2
from kunlun_common.errors import InvalidInput, NotFoundError, PermissionRefused, TemporaryError
from kunlun_common.messages import msg
from kunlun_common.modelpkg import PackageError
from kunlun_common.tls import Identity

REF_RE = re.compile(r"^([a-z0-9][a-z0-9._-]{0,62}@)?sha256:(?P<hex>[0-9a-f]{64})$")


def digest_hex(ref: str, field: str = "ref") -> str:
    """The hex digest of `[NAME@]sha256:HEX`; InvalidInput naming `field` otherwise."""
    m = REF_RE.match(ref)
    if not m:
        raise InvalidInput(
            msg(
                "package.pull.not_name_sha_digest",
                "{field}: {value!r} is not [NAME@]sha256:DIGEST (see `kunlun-cli model list`)",
                field=field,
                value=ref[:80],
            )
        )
    return m["hex"]


def check_may_pull(feeds: Feeds, who: Identity, hexd: str) -> None:
    """Agents: only packages their node's assignments name (PermissionRefused otherwise)."""
    if who.role != "agent":
        return
    for a in feeds.assignments_for(who.name).items:
        if a.spec.package.endswith("sha256:" + hexd):
            return
    raise PermissionRefused(
        msg(
            "package.pull.may_pull_only_packages",
            "{who} may pull only packages its node's assignments name; no instance on node {name} uses sha256:{value}…",
            who=who,
            name=who.name,
            value=hexd[:12],
        )
    )


async def _chunk_record(blobs: BlobStore, store: EtcdStore, hexd: str) -> bytes:
    """The blob's chunk digests; made now (after a full verification) for an older blob without."""
    path = blobs.chunks(hexd)
    try:
        return await asyncio.to_thread(path.read_bytes)
    except FileNotFoundError:
        pass
    try:
        await verify_blob(blobs.blob(hexd), await trusted_keys(store))
    except PackageError as e:
        raise TemporaryError(
            msg(
                "package.pull.this_replica_copy_sha",
                "this replica's copy of sha256:{value}… is damaged ({e}); ask another",
                value=hexd[:12],
                e=e,
            )
        ) from None
    record = await asyncio.to_thread(chunk_digests_of, blobs.blob(hexd))
    tmp = path.with_suffix(".chunks.tmp")
    await asyncio.to_thread(tmp.write_bytes, record)
    await asyncio.to_thread(tmp.replace, path)
    return record


def _read(path: Path, offset: int, size: int) -> bytes:
    with path.open("rb") as f:
        f.seek(offset)
        return f.read(size)


async def stream_package(
    store: EtcdStore, blobs: BlobStore | None, replica: str, hexd: str, offset: int
) -> AsyncIterator[package_pb2.PackageChunk]:
    """The blob's chunks from `offset` (see the module docstring)."""
    kv = await store.get(PACKAGES + hexd)
    if kv is None:
        raise NotFoundError(
            msg(
                "package.pull.package_sha_not_cluster",
                "package sha256:{value}… is not in the cluster store; push it (`kunlun-cli model push`)",
                value=hexd[:12],
            )
        )
    holders = [str(h) for h in keys.decode(kv.value).get("holders", [])]
    blob = blobs.blob(hexd) if blobs is not None else None
    if blobs is None or blob is None or not blob.is_file():
        raise TemporaryError(
            msg(
                "package.pull.replica_holds_no_copy",
                "replica {replica} holds no copy of sha256:{value}…; holders: {items}",
                replica=replica,
                value=hexd[:12],
                items=", ".join(holders),
            )
        )
    size = (await asyncio.to_thread(blob.stat)).st_size
    if offset < 0 or offset > size or offset % PULL_CHUNK:
        raise InvalidInput(
            msg(
                "package.pull.offset_not_chunk_boundary",
                "offset: {offset} is not a chunk boundary (multiple of {pull_chunk}) within {size} bytes",
                offset=offset,
                pull_chunk=PULL_CHUNK,
                size=size,
            )
        )
    record = await _chunk_record(blobs, store, hexd)
    if len(record) != 32 * -(-size // PULL_CHUNK):
        raise TemporaryError(
            msg(
                "package.pull.replica_chunk_record_sha",
                "replica {replica}: chunk record of sha256:{value}… does not match its blob; ask another",
                replica=replica,
                value=hexd[:12],
            )
        )
    pos = offset
    while pos < size:
        data = await asyncio.to_thread(_read, blob, pos, PULL_CHUNK)
        if not data:
            raise TemporaryError(
                msg(
                    "package.pull.replica_blob_sha_shrank",
                    "replica {replica}: blob sha256:{value}… shrank while being read",
                    replica=replica,
                    value=hexd[:12],
                )
            )
        i = pos // PULL_CHUNK
        yield package_pb2.PackageChunk(
            offset=pos,
            data=data,
            sha256=record[32 * i : 32 * i + 32].hex(),
            total_bytes=size,
            chunk_size=PULL_CHUNK,
            replica=replica,
        )
        pos += len(data)
