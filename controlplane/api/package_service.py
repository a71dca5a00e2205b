"""PackageService: the cluster's package store, its trusted package-signing keys and its package
policy (docs/kunlunpkg.md). Every handler goes through the one wrapper (`controlplane/api/rpc.py`).

Keys written (under `/kunlun/v1/`), each change in ONE transaction with its audit record:

| key                                   | written by                    | value (JSON)                                  |
|---------------------------------------|-------------------------------|-----------------------------------------------|
| package-trust/<key id>                | API (AddTrustedKey)           | {"schema", "key_id", "pem", "name", "by", "at_ms"} |
| audit/package-trust/<ms>-<key id>-<op>| API (Add/RemoveTrustedKey)    | {"schema", "op" (add/remove), "key_id", "name", "by", "at_ms"} |
| package-policy, audit/package-policy/ | API (SetPackagePolicy)        | controlplane/package_policy.py                |
| packages/<hex digest>                 | API (Push/DeletePackage)      | controlplane/package_store.py                 |

Only operators change them; anyone with a cluster certificate that verifies packages (operators,
viewers, replicas, agents) reads the keys and the policy. Agents pull (PullPackage) only the
packages their node's assignments name (controlplane/package_pull.py).
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc

from controlplane import keys, paging
from controlplane.api.auth import Ctx, abort
from controlplane.api.rpc import Servicer, rpc, rpc_stream
from controlplane.feeds import Feeds
from controlplane.package_policy import get_policy, set_policy
from controlplane.package_pull import check_may_pull, digest_hex, stream_package
from controlplane.package_store import (
    PACKAGES,
    BlobStore,
    ChunkHasher,
    QuotaExceeded,
    add_holder,
    record_of,
    remove_file,
    remove_holder,
    trusted_keys,
    verify_blob,
)
from controlplane.store import Compare, EtcdStore
from controlplane.store.contract import DeleteOp, PutOp
from kunlun_common.api import package_pb2, package_pb2_grpc
from kunlun_common.clock import now_ms
from kunlun_common.errors import (
    ConcurrentChange,
    InvalidInput,
    NotFoundError,
    PermanentError,
)
from kunlun_common.messages import msg
from kunlun_common.modelpkg import PackageError
from kunlun_common.modelpkg.signing import key_id, parse_public_key, public_pem
from kunlun_common.tls import Identity

TRUST = keys.PACKAGE_TRUST
AUDIT_TRUST = keys.AUDIT + "package-trust/"
MAX_PEM_BYTES = 1024
_LABEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9 ._@-]{0,62}$")
_KEY_ID_RE = re.compile(r"^ed25519:[0-9a-f]{16}$")
MAX_CHUNK = 1 << 20


def trusted_key_message(rec: dict[str, object]) -> package_pb2.TrustedKey:
    return package_pb2.TrustedKey(
        key_id=str(rec.get("key_id", "")),
        public_key_pem=str(rec.get("pem", "")),
        name=str(rec.get("name", "")),
        added_by=str(rec.get("by", "")),
        added_at_unix_ms=int(str(rec.get("at_ms", 0))),
    )


def package_message(rec: dict[str, Any]) -> package_pb2.PackageInfo:
    return package_pb2.PackageInfo(
        name=str(rec.get("name", "")),
        version=str(rec.get("version", "")),
        digest=str(rec.get("digest", "")),
        size_bytes=int(rec.get("size_bytes", 0)),
        weight_format=str(rec.get("weight_format", "")),
        quantization=str(rec.get("quantization", "")),
        min_device_memory_mb=int(rec.get("min_device_memory_mb", 0)),
        engine=str(rec.get("engine", "")),
        target_device_types=[str(t) for t in rec.get("target_device_types", [])],
        signed_by=str(rec.get("signed_by", "")),
        pushed_by=str(rec.get("pushed_by", "")),
        pushed_at_unix_ms=int(rec.get("pushed_at_ms", 0)),
        holders=[str(h) for h in rec.get("holders", [])],
    )


class PackageService(Servicer, package_pb2_grpc.PackageServiceServicer):
    SERVICE = "kunlun.v1.PackageService"

    def __init__(
        self,
        store: EtcdStore,
        feeds: Feeds,
        replica: str = "",
        store_dir: str = "",
        quota_bytes: int = 0,
    ) -> None:
        self.store = store
        self.feeds = feeds
        self.replica = replica
        self.blobs = BlobStore(Path(store_dir.replace("{name}", replica))) if store_dir else None
        self.quota = quota_bytes

    # ------------------------------------------------------------------ package store
    @rpc
    async def PushPackage(
        self, request: AsyncIterator[package_pb2.PushPackageChunk], context: Ctx, who: Identity
    ) -> package_pb2.PackageInfo:
        if self.blobs is None:
            raise PermanentError(
                msg(
                    "package.replica_keeps_no_packages",
                    "replica {replica} keeps no packages (package_store_dir unset); push to another replica",
                    replica=self.replica,
                )
            )
        blobs = self.blobs
        tmp = blobs.new_tmp()
        size = 0
        chunks = ChunkHasher()
        try:
            with tmp.open("wb") as f:
                async for chunk in request:
                    if len(chunk.data) > MAX_CHUNK:
                        raise InvalidInput(
                            msg(
                                "package.data_chunks_at_most",
                                "data: chunks of at most {max_chunk} bytes",
                                max_chunk=MAX_CHUNK,
                            )
                        )
                    size += len(chunk.data)
                    if size > self.quota:
                        await abort(
                            context,
                            grpc.StatusCode.RESOURCE_EXHAUSTED,
                            msg(
                                "package.store.over_quota",
                                "package larger than the store quota ({quota} bytes)",
                                quota=self.quota,
                            ),
                        )
                    await asyncio.to_thread(f.write, chunk.data)
                    chunks.feed(chunk.data)
            try:
                v = await verify_blob(tmp, await trusted_keys(self.store))
            except PackageError as e:
                raise InvalidInput(msg("package.package_refused", "package refused: {e}", e=e)) from None
            rec = record_of(v, size, str(who))
            hexd = v.head.digest.removeprefix("sha256:")
            record = tmp.with_suffix(".chunks")
            await asyncio.to_thread(record.write_bytes, chunks.finish())
            await asyncio.to_thread(os.replace, record, blobs.chunks(hexd))
            await asyncio.to_thread(os.replace, tmp, blobs.blob(hexd))
            try:
                rec = await add_holder(self.store, rec, self.replica, self.quota)
            except QuotaExceeded as e:
                await asyncio.to_thread(remove_file, blobs.blob(hexd))
                await asyncio.to_thread(remove_file, blobs.chunks(hexd))
                await abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        finally:
            await asyncio.to_thread(remove_file, tmp)
            await asyncio.to_thread(remove_file, tmp.with_suffix(".chunks"))
        return package_message(rec)

    @rpc
    async def ListPackages(
        self, request: package_pb2.ListPackagesRequest, context: Ctx, who: Identity
    ) -> package_pb2.ListPackagesResponse:
        paging.check_page_size(request.page_size)
        if request.page_size:
            found, nxt, revision = await paging.list_page(
                self.store,
                PACKAGES,
                request,
                lambda kv: package_message(keys.decode(kv.value)),
                paging.message_size,
            )
            return package_pb2.ListPackagesResponse(packages=found, next_page_token=nxt, revision=revision)
        kvs, _ = await self.store.get_prefix(PACKAGES)
        out = [package_message(keys.decode(kv.value)) for kv in kvs]
        out.sort(key=lambda p: (p.name, p.pushed_at_unix_ms))
        return package_pb2.ListPackagesResponse(packages=out)

    @rpc
    async def DeletePackage(
        self, request: package_pb2.DeletePackageRequest, context: Ctx, who: Identity
    ) -> package_pb2.PackageInfo:
        hexd = digest_hex(request.ref)
        if self.blobs is not None:
            await asyncio.to_thread(remove_file, self.blobs.blob(hexd))
            await asyncio.to_thread(remove_file, self.blobs.chunks(hexd))
        rec = await remove_holder(self.store, hexd, self.replica)
        if rec is None:
            raise NotFoundError(
                msg(
                    "package.no_package_store_see",
                    "no package {ref} in the store; see `model list`",
                    ref=request.ref,
                )
            )
        return package_message(rec)

    @rpc_stream
    async def PullPackage(
        self, request: package_pb2.PullPackageRequest, context: Ctx, who: Identity
    ) -> AsyncIterator[package_pb2.PackageChunk]:
        hexd = digest_hex(request.ref)
        check_may_pull(self.feeds, who, hexd)
        async for chunk in stream_package(self.store, self.blobs, self.replica, hexd, request.offset):
            yield chunk

    # ------------------------------------------------------------------ policy
    @rpc
    async def GetPackagePolicy(
        self, request: package_pb2.GetPackagePolicyRequest, context: Ctx, who: Identity
    ) -> package_pb2.PackagePolicy:
        return await get_policy(self.store)

    @rpc
    async def SetPackagePolicy(
        self, request: package_pb2.SetPackagePolicyRequest, context: Ctx, who: Identity
    ) -> package_pb2.PackagePolicy:
        return await set_policy(self.store, request.require_signed_packages, str(who))

    # ------------------------------------------------------------------ trusted keys
    @rpc
    async def AddTrustedKey(
        self, request: package_pb2.AddTrustedKeyRequest, context: Ctx, who: Identity
    ) -> package_pb2.TrustedKey:
        pem = request.public_key_pem.encode()
        if not pem or len(pem) > MAX_PEM_BYTES:
            raise InvalidInput(
                msg(
                    "package.public_key_pem_expected",
                    "public_key_pem: expected an Ed25519 public key PEM of at most {max_pem_bytes} bytes",
                    max_pem_bytes=MAX_PEM_BYTES,
                )
            )
        if request.name and not _LABEL_RE.match(request.name):
            raise InvalidInput(
                msg(
                    "package.name_use_letters_digits",
                    "name: use letters, digits, space, '.', '_', '@', '-', at most 63 characters",
                )
            )
        pub = parse_public_key(pem, "public_key_pem")  # ConfigError -> INVALID_ARGUMENT
        kid = key_id(pub)
        at = now_ms()
        rec: dict[str, object] = {
            "key_id": kid,
            "pem": public_pem(pub).decode(),
            "name": request.name,
            "by": str(who),
            "at_ms": at,
        }
        audit = {"op": "add", "key_id": kid, "name": request.name, "by": str(who), "at_ms": at}
        res = await self.store.txn(
            [Compare.absent(TRUST + kid)],
            [
                PutOp(TRUST + kid, keys.encode(rec)),
                PutOp(f"{AUDIT_TRUST}{at:013d}-{kid}-add", keys.encode(audit)),
            ],
        )
        if not res.succeeded:
            kv = await self.store.get(TRUST + kid)
            if kv is not None:
                return trusted_key_message(keys.decode(kv.value))
            raise ConcurrentChange(
                msg("package.key_changed_meanwhile_try", "the key changed meanwhile; try again")
            )
        return trusted_key_message(rec)

    @rpc
    async def RemoveTrustedKey(
        self, request: package_pb2.RemoveTrustedKeyRequest, context: Ctx, who: Identity
    ) -> package_pb2.TrustedKey:
        if not _KEY_ID_RE.match(request.key_id):
            raise InvalidInput(
                msg(
                    "package.key_id_not_key",
                    "key_id: {key_id!r} is not a key id (ed25519: and 16 hex digits); see `model trust list`",
                    key_id=request.key_id,
                )
            )
        kv = await self.store.get(TRUST + request.key_id)
        if kv is None:
            raise NotFoundError(
                msg(
                    "package.key_not_trusted_see",
                    "key {key_id} is not trusted; see `model trust list`",
                    key_id=request.key_id,
                )
            )
        rec = keys.decode(kv.value)
        at = now_ms()
        audit = {
            "op": "remove",
            "key_id": request.key_id,
            "name": rec.get("name", ""),
            "by": str(who),
            "at_ms": at,
        }
        res = await self.store.txn(
            [Compare.unchanged(TRUST + request.key_id, kv.mod_revision)],
            [
                DeleteOp(TRUST + request.key_id),
                PutOp(f"{AUDIT_TRUST}{at:013d}-{request.key_id}-remove", keys.encode(audit)),
            ],
        )
        if not res.succeeded:
            raise ConcurrentChange(
                msg("package.key_changed_meanwhile_try_2", "the key changed meanwhile; try again")
            )
        return trusted_key_message(rec)

    @rpc
    async def ListTrustedKeys(
        self, request: package_pb2.ListTrustedKeysRequest, context: Ctx, who: Identity
    ) -> package_pb2.ListTrustedKeysResponse:
        kvs, _ = await self.store.get_prefix(TRUST)
        out = [trusted_key_message(keys.decode(kv.value)) for kv in kvs]
        out.sort(key=lambda k: (k.added_at_unix_ms, k.key_id))
        return package_pb2.ListTrustedKeysResponse(keys=out)
