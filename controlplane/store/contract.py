"""Types of the store contract (see controlplane.store.etcd.EtcdStore for the calls).

Compare/Op mirror etcd's transaction model: a transaction is `if all(compares) then success
else failure`, applied atomically at one revision. etcd refuses transactions with more than 128
operations (its default --max-txn-ops); `MAX_TXN_OPS` is what every batching design must respect.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

MAX_TXN_OPS = 128


@dataclass(frozen=True)
class StoreSettings:
    """How a replica reaches etcd."""

    endpoints: tuple[str, ...]
    """etcd client URLs or host:port pairs, e.g. ("https://127.0.0.1:2379", ...)."""
    ca_path: str
    """The etcd CA (`etcd-ca.crt`): only certificates it issued are trusted as etcd members."""
    cert_path: str
    """Client certificate presented to etcd (`etcd-client/kunlun.crt`; its CN is the etcd user)."""
    key_path: str
    """Private key of cert_path."""
    server_name: str = ""
    """Name checked against the etcd members' certificates (must be in every member's SANs).
    Default: the endpoints' host when they share one, else `etcd-peer.kunlun`, a name that every
    etcd member certificate carries and that only the etcd CA issues."""
    request_timeout_s: float = 2.0
    """Deadline of one unary call; a paused member costs at most this before another is tried."""
    retry_deadline_s: float = 10.0
    """How long idempotent calls are retried (with jittered backoff) before TemporaryError."""
    watch_idle_timeout_s: float = 15.0
    """A watch stream silent for this long (no event, no progress notify) is re-opened."""


@dataclass(frozen=True)
class KV:
    """One key's value and revisions, as read from etcd."""

    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int


@dataclass(frozen=True)
class Compare:
    """One condition of a transaction: `target(key) op value`.

    target: "create" (create revision; 0 = absent), "mod" (mod revision), "version", "value", "lease".
    """

    key: str
    target: Literal["create", "mod", "version", "value", "lease"]
    op: Literal["==", "!=", "<", ">"]
    value: int | bytes

    @staticmethod
    def absent(key: str) -> Compare:
        return Compare(key, "create", "==", 0)

    @staticmethod
    def unchanged(key: str, mod_revision: int) -> Compare:
        """The key still has the mod revision we read (0: it still does not exist)."""
        return Compare(key, "mod", "==", mod_revision)


@dataclass(frozen=True)
class PutOp:
    key: str
    value: bytes
    lease: int = 0


@dataclass(frozen=True)
class DeleteOp:
    key: str
    prefix: bool = False


@dataclass(frozen=True)
class GetOp:
    key: str
    prefix: bool = False


Op = PutOp | DeleteOp | GetOp


@dataclass(frozen=True)
class TxnResult:
    """Outcome of a transaction: which branch ran, at which revision, and the reads it made."""

    succeeded: bool
    revision: int
    reads: list[list[KV]] = field(default_factory=list)


@dataclass(frozen=True)
class WatchEvent:
    """A change seen by a watch. kind "put" or "delete"; for deletes `kv.value` is empty."""

    kind: Literal["put", "delete"]
    kv: KV

    @property
    def revision(self) -> int:
        return self.kv.mod_revision


@dataclass(frozen=True)
class Resync:
    """The watch lost history (compaction, or a gap): here is the whole prefix at `revision`.

    Consumers replace their cache with `kvs`; events after it continue from revision + 1.
    """

    kvs: list[KV]
    revision: int


def prefix_end(prefix: str) -> bytes:
    """The range end that makes [prefix, end) cover every key starting with prefix."""
    b = bytearray(prefix.encode())
    for i in range(len(b) - 1, -1, -1):
        if b[i] < 0xFF:
            b[i] += 1
            return bytes(b[: i + 1])
    return b"\0"
