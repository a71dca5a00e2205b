"""The cluster's package policy (`/kunlun/v1/package-policy`), read by agents before every
verification of a package and changed by operators; every change is written in ONE transaction
with its audit record (`audit/package-policy/<ms>-set`).

Value: {"schema", "require_signed_packages", "by", "at_ms"}. No key: nothing required (the
agents' own `--require-signed-packages` flag still applies on their node).
"""

from __future__ import annotations

from typing import Any

from controlplane import keys
from controlplane.store import Compare, EtcdStore
from controlplane.store.contract import PutOp
from kunlun_common.api import package_pb2
from kunlun_common.clock import now_ms
from kunlun_common.errors import ConcurrentChange
from kunlun_common.messages import msg

POLICY = keys.PACKAGE_POLICY
AUDIT_POLICY = keys.AUDIT + "package-policy/"


def policy_message(rec: dict[str, Any]) -> package_pb2.PackagePolicy:
    return package_pb2.PackagePolicy(
        require_signed_packages=bool(rec.get("require_signed_packages", False)),
        updated_by=str(rec.get("by", "")),
        updated_at_unix_ms=int(rec.get("at_ms", 0)),
    )


async def get_policy(store: EtcdStore) -> package_pb2.PackagePolicy:
    kv = await store.get(POLICY)
    return policy_message(keys.decode(kv.value) if kv is not None else {})


async def set_policy(store: EtcdStore, require_signed: bool, by: str) -> package_pb2.PackagePolicy:
    """Write the policy and its audit record together (compare-and-set on the policy key)."""
    kv = await store.get(POLICY)
    at = now_ms()
    rec = {"require_signed_packages": require_signed, "by": by, "at_ms": at}
    before = bool(keys.decode(kv.value).get("require_signed_packages")) if kv is not None else False
    audit = {"op": "set", "require_signed_packages": require_signed, "before": before, "by": by, "at_ms": at}
    guard = Compare.absent(POLICY) if kv is None else Compare.unchanged(POLICY, kv.mod_revision)
    res = await store.txn(
        [guard],
        [PutOp(POLICY, keys.encode(rec)), PutOp(f"{AUDIT_POLICY}{at:013d}-set", keys.encode(audit))],
    )
    if not res.succeeded:
        raise ConcurrentChange(
            msg(
                "package.policy.package_policy_changed_meanwhile",
                "the package policy changed meanwhile; try again",
            )
        )
    return policy_message(rec)
