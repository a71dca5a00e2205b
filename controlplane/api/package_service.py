"""PackageService: the cluster's trusted package-signing keys (docs/kunlunpkg.md).

Keys written (under `/kunlun/v1/`), each change in ONE transaction with its audit record:

| key                                   | written by                    | value (JSON)                                  |
|---------------------------------------|-------------------------------|-----------------------------------------------|
| package-trust/<key id>                | API (AddTrustedKey)           | {"schema", "key_id", "pem", "name", "by", "at_ms"} |
| audit/package-trust/<ms>-<key id>-<op>| API (Add/RemoveTrustedKey)    | {"schema", "op" (add/remove), "key_id", "name", "by", "at_ms"} |

Only operators change the list; anyone with a cluster certificate that verifies packages (operators,
viewers, replicas, agents) reads it.
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc

from controlplane import keys
from controlplane.api.auth import Ctx, abort, authorize
from controlplane.api.guard import CallGuard
from controlplane.api.rpc import fail
from controlplane.package_store import (
    PACKAGES,
    BlobStore,
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
from kunlun_common.errors import ConfigError
from kunlun_common.modelpkg import PackageError
from kunlun_common.modelpkg.signing import key_id, parse_public_key, public_pem
from kunlun_common.tls import Identity

SVC = "/kunlun.v1.PackageService/"
TRUST = keys.PACKAGE_TRUST
AUDIT_TRUST = keys.AUDIT + "package-trust/"
MAX_PEM_BYTES = 1024
_LABEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9 ._@-]{0,62}$")
_KEY_ID_RE = re.compile(r"^ed25519:[0-9a-f]{16}$")
_REF_RE = re.compile(r"^([a-z0-9][a-z0-9._-]{0,62}@)?sha256:(?P<hex>[0-9a-f]{64})$")
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


class PackageService(package_pb2_grpc.PackageServiceServicer):
    def __init__(
        self, store: EtcdStore, replica: str = "", store_dir: str = "", quota_bytes: int = 0
    ) -> None:
        self.store = store
        self.replica = replica
        self.blobs = BlobStore(Path(store_dir.replace("{name}", replica))) if store_dir else None
        self.quota = quota_bytes
        self.guard: CallGuard | None = None
        """Revocation check and certificate inventory (set by the replica)."""

    # ------------------------------------------------------------------ package store
    async def PushPackage(
        self, request_iterator: AsyncIterator[package_pb2.PushPackageChunk], context: Ctx
    ) -> package_pb2.PackageInfo:
        who = await self._authorize(context, "PushPackage")
        if self.blobs is None:
            await abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"replica {self.replica} keeps no packages (package_store_dir unset); push to another replica",
            )
        blobs = self.blobs
        tmp = blobs.new_tmp()
        size = 0
        try:
            with tmp.open("wb") as f:
                async for chunk in request_iterator:
                    if len(chunk.data) > MAX_CHUNK:
                        await abort(
                            context,
                            grpc.StatusCode.INVALID_ARGUMENT,
                            f"data: chunks of at most {MAX_CHUNK} bytes",
                        )
                    size += len(chunk.data)
                    if size > self.quota:
                        await abort(
                            context,
                            grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"package larger than the store quota ({self.quota} bytes)",
                        )
                    await asyncio.to_thread(f.write, chunk.data)
            try:
                v = await verify_blob(tmp, await trusted_keys(self.store))
            except PackageError as e:
                await abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"package refused: {e}")
            rec = record_of(v, size, str(who))
            hexd = v.head.digest.removeprefix("sha256:")
            await asyncio.to_thread(os.replace, tmp, blobs.blob(hexd))
            try:
                rec = await add_holder(self.store, rec, self.replica, self.quota)
            except QuotaExceeded as e:
                await asyncio.to_thread(remove_file, blobs.blob(hexd))
                await abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except Exception as e:
            await self._fail(context, e)
            raise
        finally:
            await asyncio.to_thread(remove_file, tmp)
        return package_message(rec)

    async def ListPackages(
        self, request: package_pb2.ListPackagesRequest, context: Ctx
    ) -> package_pb2.ListPackagesResponse:
        await self._authorize(context, "ListPackages")
        try:
            kvs, _ = await self.store.get_prefix(PACKAGES)
        except Exception as e:
            await self._fail(context, e)
            raise
        out = [package_message(keys.decode(kv.value)) for kv in kvs]
        out.sort(key=lambda p: (p.name, p.pushed_at_unix_ms))
        return package_pb2.ListPackagesResponse(packages=out)

    async def DeletePackage(
        self, request: package_pb2.DeletePackageRequest, context: Ctx
    ) -> package_pb2.PackageInfo:
        await self._authorize(context, "DeletePackage")
        m = _REF_RE.match(request.ref)
        if not m:
            await abort(
                context, grpc.StatusCode.INVALID_ARGUMENT, f"ref: {request.ref!r} is not [NAME@]sha256:DIGEST"
            )
        hexd = m["hex"]
        try:
            if self.blobs is not None:
                await asyncio.to_thread(remove_file, self.blobs.blob(hexd))
            rec = await remove_holder(self.store, hexd, self.replica)
        except Exception as e:
            await self._fail(context, e)
            raise
        if rec is None:
            await abort(
                context, grpc.StatusCode.NOT_FOUND, f"no package {request.ref} in the store; see `model list`"
            )
        return package_message(rec)

    async def _authorize(self, context: Ctx, name: str) -> Identity:
        """The replica's revocation check (when serving in a replica), then the role table."""
        if self.guard is not None:
            await self.guard.admit(context, SVC + name)
        return await authorize(context, SVC + name)

    async def _fail(self, context: Ctx, e: Exception) -> None:
        await fail(context, e)  # the one error mapping (controlplane/api/rpc.py)

    async def AddTrustedKey(
        self, request: package_pb2.AddTrustedKeyRequest, context: Ctx
    ) -> package_pb2.TrustedKey:
        who = await self._authorize(context, "AddTrustedKey")
        pem = request.public_key_pem.encode()
        if not pem or len(pem) > MAX_PEM_BYTES:
            await abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"public_key_pem: expected an Ed25519 public key PEM of at most {MAX_PEM_BYTES} bytes",
            )
        if request.name and not _LABEL_RE.match(request.name):
            await abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                "name: use letters, digits, space, '.', '_', '@', '-', at most 63 characters",
            )
        try:
            pub = parse_public_key(pem, "public_key_pem")
        except ConfigError as e:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
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
        try:
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
                await abort(context, grpc.StatusCode.ABORTED, "the key changed meanwhile; try again")
        except Exception as e:
            await self._fail(context, e)
            raise
        return trusted_key_message(rec)

    async def RemoveTrustedKey(
        self, request: package_pb2.RemoveTrustedKeyRequest, context: Ctx
    ) -> package_pb2.TrustedKey:
        who = await self._authorize(context, "RemoveTrustedKey")
        if not _KEY_ID_RE.match(request.key_id):
            await abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"key_id: {request.key_id!r} is not a key id (ed25519: and 16 hex digits); see `model trust list`",
            )
        try:
            kv = await self.store.get(TRUST + request.key_id)
            if kv is None:
                await abort(
                    context,
                    grpc.StatusCode.NOT_FOUND,
                    f"key {request.key_id} is not trusted; see `model trust list`",
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
                await abort(context, grpc.StatusCode.ABORTED, "the key changed meanwhile; try again")
        except Exception as e:
            await self._fail(context, e)
            raise
        return trusted_key_message(rec)

    async def ListTrustedKeys(
        self, request: package_pb2.ListTrustedKeysRequest, context: Ctx
    ) -> package_pb2.ListTrustedKeysResponse:
        await self._authorize(context, "ListTrustedKeys")
        try:
            kvs, _ = await self.store.get_prefix(TRUST)
        except Exception as e:
            await self._fail(context, e)
            raise
        out = [trusted_key_message(keys.decode(kv.value)) for kv in kvs]
        out.sort(key=lambda k: (k.added_at_unix_ms, k.key_id))
        return package_pb2.ListTrustedKeysResponse(keys=out)
