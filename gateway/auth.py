"""Client API keys: `Authorization: Bearer <key>`, checked against the SHA-256 hashes the control
plane pushes (WatchGatewayConfig). The gateway never sees etcd, nor any key it was not shown.

Keys are long random secrets (`kunlun-cli gateway keys create`), so one SHA-256 is enough (no slow
KDF: there is nothing to brute-force); revoking a key removes its hash from the next config push.
The check runs on the request head alone, before any body byte is read (proxy.py).
"""

from __future__ import annotations

import re

from kunlun_common.traffic import key_hash

_KEY_ID = re.compile(rb"kl-([0-9A-Za-z]{1,64})-")


class ApiKeys:
    """The valid key hashes; `check()` answers None (allowed) or why not."""

    def __init__(self, required: bool) -> None:
        self.required = required
        self.hashes: frozenset[str] = frozenset()
        self.loaded = False

    def set(self, hashes: list[str]) -> None:
        self.hashes = frozenset(hashes)
        self.loaded = True

    def check(self, authorization: bytes | None) -> str | None:
        why, _ = self.identify(authorization)
        return why

    def identify(self, authorization: bytes | None) -> tuple[str | None, str]:
        """(None or why the request is refused, the key's id for rate limits: "" without keys)."""
        if not self.required:
            return None, ""
        if authorization is None:
            return (
                "missing API key: send `Authorization: Bearer <key>` (keys: `kunlun-cli gateway keys create`)",
                "",
            )
        scheme, _, token = authorization.strip().partition(b" ")
        token = token.strip()
        if scheme.lower() != b"bearer" or not token:
            return "malformed Authorization header: expected `Bearer <key>`", ""
        digest = key_hash(token)
        if digest not in self.hashes:
            return "invalid or revoked API key", ""
        m = _KEY_ID.match(token)
        return None, m.group(1).decode() if m else f"sha256:{digest[:16]}"
