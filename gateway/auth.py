"""Client API keys: `Authorization: Bearer <key>`, checked against the SHA-256 hashes the control
plane pushes (WatchGatewayConfig). The gateway never sees etcd, nor any key it was not shown.

Keys are long random secrets (`kunlun-cli gateway keys create`), so one SHA-256 is enough (no slow
KDF: there is nothing to brute-force); revoking a key removes its hash from the next config push.
"""

from __future__ import annotations

from kunlun_common.traffic import key_hash


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
        if not self.required:
            return None
        if authorization is None:
            return (
                "missing API key: send `Authorization: Bearer <key>` (keys: `kunlun-cli gateway keys create`)"
            )
        scheme, _, token = authorization.strip().partition(b" ")
        if scheme.lower() != b"bearer" or not token.strip():
            return "malformed Authorization header: expected `Bearer <key>`"
        if key_hash(token.strip()) not in self.hashes:
            return "invalid or revoked API key"
        return None
