"""Gateway API keys (`gateway-keys/<id>`): created with a random secret of which only the SHA-256
is stored (the secret is shown once), listed, and revoked (kept, with who revoked it and when)."""

from __future__ import annotations

import re
import secrets

from controlplane import keys
from controlplane.store import EtcdStore
from kunlun_common.api import gateway_pb2
from kunlun_common.clock import now_ms
from kunlun_common.errors import ConcurrentChange, InvalidInput, NotFoundError
from kunlun_common.messages import msg
from kunlun_common.traffic import key_hash

KEY_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
ID_ATTEMPTS = 5


def api_key_message(rec: dict[str, object]) -> gateway_pb2.ApiKey:
    return gateway_pb2.ApiKey(
        id=str(rec.get("id", "")),
        name=str(rec.get("name", "")),
        prefix=str(rec.get("prefix", "")),
        created_at_unix_ms=int(str(rec.get("created_at_ms", 0))),
        created_by=str(rec.get("created_by", "")),
        revoked_at_unix_ms=int(str(rec.get("revoked_at_ms", 0))),
        revoked_by=str(rec.get("revoked_by", "")),
    )


def valid_hash(rec: dict[str, object]) -> str:
    """The record's secret hash while the key is valid, else ""."""
    return "" if rec.get("revoked_at_ms") or not rec.get("hash") else str(rec["hash"])


async def create(store: EtcdStore, name: str, who: str) -> tuple[gateway_pb2.ApiKey, str]:
    """A new key named `name`: (its record, the secret, which is never stored)."""
    if not KEY_NAME_RE.match(name):
        raise InvalidInput(
            msg(
                "apikey.name_invalid",
                "name: {name!r} is not valid; use letters, digits, '.', '_' and '-', at most 63",
                name=name,
            )
        )
    for _ in range(ID_ATTEMPTS):
        kid = secrets.token_hex(4)
        secret = f"kl-{kid}-{secrets.token_urlsafe(32)}"
        rec: dict[str, object] = {
            "id": kid,
            "name": name,
            "hash": key_hash(secret),
            "prefix": secret[:12],
            "created_by": who,
            "created_at_ms": now_ms(),
            "revoked_by": "",
            "revoked_at_ms": 0,
        }
        res = await store.create(keys.gateway_key(kid), keys.encode(rec))
        if res.succeeded:
            return api_key_message(rec), secret
    raise ConcurrentChange(msg("apikey.id_busy", "could not pick a free key id; try again"))


async def records(store: EtcdStore) -> list[tuple[str, dict[str, object]]]:
    kvs, _ = await store.get_prefix(keys.GATEWAY_KEYS)
    return [(kv.key, keys.decode(kv.value)) for kv in kvs]


def listed(rec: dict[str, object], include_revoked: bool) -> gateway_pb2.ApiKey | None:
    """The key as listed, or None when the listing leaves it out (revoked, unless asked for)."""
    return api_key_message(rec) if include_revoked or not rec.get("revoked_at_ms") else None


async def list_keys(store: EtcdStore, include_revoked: bool) -> list[gateway_pb2.ApiKey]:
    out = [k for _, r in await records(store) if (k := listed(r, include_revoked)) is not None]
    out.sort(key=lambda k: (k.created_at_unix_ms, k.id))
    return out


async def revoke(store: EtcdStore, id_or_name: str, who: str) -> gateway_pb2.ApiKey:
    """Revoke a key by id, or by name when exactly one valid key has it (idempotent)."""
    recs = await records(store)
    found = [(k, r) for k, r in recs if r.get("id") == id_or_name]
    if not found:
        found = [(k, r) for k, r in recs if r.get("name") == id_or_name and not r.get("revoked_at_ms")]
    if not found:
        raise NotFoundError(
            msg("apikey.not_found", "no API key {key!r}; see `kunlun-cli gateway keys list`", key=id_or_name)
        )
    if len(found) > 1:
        ids = ", ".join(str(r.get("id")) for _, r in found)
        raise InvalidInput(
            msg(
                "apikey.ambiguous",
                "{count} valid keys are named {name!r} ({ids}); revoke by id",
                count=len(found),
                name=id_or_name,
                ids=ids,
            )
        )
    key, rec = found[0]
    if not rec.get("revoked_at_ms"):
        rec = {**rec, "revoked_by": who, "revoked_at_ms": now_ms()}
        rec.pop("schema", None)
        await store.put(key, keys.encode(rec))
    return api_key_message(rec)
