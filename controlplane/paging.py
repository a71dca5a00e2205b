"""Paged, consistent listings: page tokens, page sizes, and reading one page of a key prefix.

Every List RPC whose answer grows with the cluster (workloads, nodes, devices, API keys, gateways,
routing policies, request endpoints, packages, rollouts) takes `page_size` and `page_token`:

- A page holds at most `page_size` items in key order, and fewer when its encoded size would pass
  `MAX_PAGE_BYTES`, so no page comes near gRPC's 4 MiB default message limit whatever the records
  hold (a single record is bounded by etcd's request limit, 1.5 MiB).
- Every page of one listing is read at the etcd revision of its first page, so the pages together
  are one consistent snapshot whatever changes meanwhile. A token whose revision etcd compacted
  away is refused (invalid input, naming `page_token`); the caller lists again.
- `page_size` 0 keeps the old answer (everything at once), so old clients still work; new clients
  always page, and a replica from before paging answers everything with no `next_page_token`,
  which ends their loop too.

Records that hold several items (a node's devices) page inside a record: the token then also
carries how many of the last record's items were already returned (`offset`).
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from controlplane.store import KV, EtcdStore
from controlplane.store.contract import prefix_end
from kunlun_common.errors import InvalidInput, PermanentError
from kunlun_common.messages import msg

MAX_PAGE_SIZE = 1000
"""The most items one page may hold."""

MAX_PAGE_BYTES = 1 << 20
"""A page stops before its items' encoded size passes this (it always holds at least one item)."""

T = TypeVar("T")


class Sized(Protocol):
    def ByteSize(self) -> int: ...


class PageRequest(Protocol):
    """What every paged List request carries."""

    @property
    def page_size(self) -> int: ...
    @property
    def page_token(self) -> str: ...


@dataclass(frozen=True)
class PageToken:
    """Where the next page starts and the revision the listing is read at."""

    revision: int
    """etcd revision of the listing's first page."""
    after: str
    """Key suffix (id or name) of the last record already returned, in full or in part."""
    offset: int = 0
    """Items of record `after` already returned; 0: all of them (the next page starts after it)."""

    def encode(self) -> str:
        data: dict[str, object] = {"r": self.revision, "a": self.after}
        if self.offset:
            data["o"] = self.offset
        raw = json.dumps(data, separators=(",", ":")).encode()
        return base64.urlsafe_b64encode(raw).decode().rstrip("=")

    @staticmethod
    def decode(token: str) -> PageToken:
        """Parse a token from `next_page_token`; anything else is refused as invalid input."""
        try:
            raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
            data = json.loads(raw)
            revision, after, offset = data["r"], data["a"], data.get("o", 0)
        except (binascii.Error, ValueError, KeyError, TypeError, AttributeError) as e:
            raise InvalidInput(
                msg(
                    "paging.page_token_not_token",
                    "page_token: not a token this server issued ({name}); pass next_page_token from the previous page, or none for the first page",
                    name=e.__class__.__name__,
                )
            ) from e
        if (
            not isinstance(revision, int)
            or revision <= 0
            or not isinstance(after, str)
            or not after
            or not isinstance(offset, int)
            or offset < 0
        ):
            raise InvalidInput(
                msg(
                    "paging.page_token_malformed_pass",
                    "page_token: malformed; pass next_page_token from the previous page",
                )
            )
        return PageToken(revision, after, offset)


def check_page_size(size: int) -> None:
    if not 0 <= size <= MAX_PAGE_SIZE:
        raise InvalidInput(
            msg(
                "paging.page_size_expected_everything",
                "page_size: expected 0 (everything) or 1..{max_page_size}, found {size}",
                max_page_size=MAX_PAGE_SIZE,
                size=size,
            )
        )


def token_of(request: PageRequest) -> PageToken | None:
    """The request's page size checked and its token parsed (None: the first page)."""
    check_page_size(request.page_size)
    return PageToken.decode(request.page_token) if request.page_token else None


def _compacted(e: PermanentError) -> InvalidInput | None:
    text = str(e)
    if "compacted" in text or "future revision" in text:
        return InvalidInput(
            msg(
                "paging.page_token_its_revision",
                "page_token: its revision was compacted away meanwhile; list again from the first page",
            )
        )
    return None


async def read_range(
    store: EtcdStore, start: str, end: bytes, limit: int, revision: int
) -> tuple[list[KV], int, bool]:
    """`store.get_range` for a listing: a compacted revision is refused as a bad `page_token`.
    Returns (kvs, the revision read (the current one when `revision` is 0), more)."""
    try:
        kvs, header, more = await store.get_range(start, end, limit, revision)
    except PermanentError as e:
        if (refused := _compacted(e)) is not None:
            raise refused from e
        raise
    return kvs, revision or header, more


def page_start(prefix: str, token: PageToken | None) -> str:
    """First key a page reads: the prefix, the record the last page stopped inside (offset > 0),
    or just after the last record returned."""
    if token is None:
        return prefix
    return prefix + token.after + ("" if token.offset else "\0")


async def read_records(
    store: EtcdStore, prefix: str, limit: int, token: PageToken | None
) -> tuple[list[KV], int, bool]:
    """Up to `limit` records under `prefix` from where `token` stopped, at the listing's revision.
    Returns (kvs, revision, more)."""
    return await read_range(
        store, page_start(prefix, token), prefix_end(prefix), limit, token.revision if token else 0
    )


def companion_range(prefix: str, first: str, last: str) -> tuple[str, bytes]:
    """[start, end) under `prefix` covering the keys of ids from `first` to `last` and every key
    that starts with `last` (callers keep only their own page's ones): how a page reads the records
    kept beside its own (a node's liveness, a workload's instances)."""
    return prefix + first, prefix_end(prefix + last)


def fill(items: Iterable[T], size: int, size_of: Callable[[T], int]) -> tuple[list[T], bool]:
    """The first items of `items` that fit in a page of `size` items and `MAX_PAGE_BYTES`
    (at least one); returns (page, cut), cut when items were left out."""
    out: list[T] = []
    used = 0
    for item in items:
        n = size_of(item)
        if out and (len(out) >= size or used + n > MAX_PAGE_BYTES):
            return out, True
        out.append(item)
        used += n
    return out, False


async def list_page(
    store: EtcdStore,
    prefix: str,
    request: PageRequest,
    decode: Callable[[KV], T | None],
    size_of: Callable[[T], int],
) -> tuple[list[T], str, int]:
    """One page of a listing whose records are its items, one each (`decode` returns None for a
    record the listing leaves out, e.g. a revoked key). Returns (items, next_page_token, revision).
    The request's page_size must be > 0 (0 is the caller's unpaged answer)."""
    token = token_of(request)
    kvs, revision, more = await read_records(store, prefix, request.page_size, token)
    decoded = [(kv, item) for kv in kvs if (item := decode(kv)) is not None]
    taken, cut = fill(decoded, request.page_size, lambda pair: size_of(pair[1]))
    # the last record looked at: the one after the page when cut, else the last read (even if
    # left out by `decode`, so the next page does not read it again)
    last = taken[-1][0] if cut else (kvs[-1] if kvs else None)
    nxt = ""
    if (cut or more) and last is not None:
        nxt = PageToken(revision, last.key[len(prefix) :]).encode()
    return [item for _, item in taken], nxt, revision


def message_size(m: Sized) -> int:
    """Encoded size of a protobuf message as a page item (with its field tag and length)."""
    return m.ByteSize() + 6
