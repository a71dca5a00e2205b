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

import re

import grpc

from controlplane import keys
from controlplane.api.auth import Ctx, abort, authorize
from controlplane.store import Compare, EtcdStore
from controlplane.store.contract import DeleteOp, PutOp
from kunlun_common.api import package_pb2, package_pb2_grpc
from kunlun_common.clock import now_ms
from kunlun_common.errors import ConfigError, PermanentError, TemporaryError
from kunlun_common.modelpkg.signing import key_id, parse_public_key, public_pem

SVC = "/kunlun.v1.PackageService/"
TRUST = keys.ROOT + "package-trust/"
AUDIT_TRUST = keys.AUDIT + "package-trust/"
MAX_PEM_BYTES = 1024
_LABEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9 ._@-]{0,62}$")
_KEY_ID_RE = re.compile(r"^ed25519:[0-9a-f]{16}$")


def trusted_key_message(rec: dict[str, object]) -> package_pb2.TrustedKey:
    return package_pb2.TrustedKey(
        key_id=str(rec.get("key_id", "")),
        public_key_pem=str(rec.get("pem", "")),
        name=str(rec.get("name", "")),
        added_by=str(rec.get("by", "")),
        added_at_unix_ms=int(str(rec.get("at_ms", 0))),
    )


class PackageService(package_pb2_grpc.PackageServiceServicer):
    def __init__(self, store: EtcdStore) -> None:
        self.store = store

    async def _fail(self, context: Ctx, e: Exception) -> None:
        if isinstance(e, TemporaryError):
            await abort(context, grpc.StatusCode.UNAVAILABLE, str(e))
        if isinstance(e, PermanentError):
            await abort(context, grpc.StatusCode.FAILED_PRECONDITION, str(e))
        raise e

    async def AddTrustedKey(
        self, request: package_pb2.AddTrustedKeyRequest, context: Ctx
    ) -> package_pb2.TrustedKey:
        who = await authorize(context, SVC + "AddTrustedKey")
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
        who = await authorize(context, SVC + "RemoveTrustedKey")
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
        await authorize(context, SVC + "ListTrustedKeys")
        try:
            kvs, _ = await self.store.get_prefix(TRUST)
        except Exception as e:
            await self._fail(context, e)
            raise
        out = [trusted_key_message(keys.decode(kv.value)) for kv in kvs]
        out.sort(key=lambda k: (k.added_at_unix_ms, k.key_id))
        return package_pb2.ListTrustedKeysResponse(keys=out)
