"""Paged, consistent listings of workloads: page tokens and the key ranges a page reads.

A page is `page_size` workloads in id (key) order. Every page of one listing is read at the etcd
revision of its first page, so the pages together are one consistent snapshot, whatever changes
meanwhile; a token older than etcd's compaction is refused and the caller lists again. The
instances and statuses of a page are read as one key range each: instance ids start with their
workload's id, so those of a page's workloads lie between the first and the last id."""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass

from controlplane import keys
from controlplane.store.contract import prefix_end
from kunlun_common.errors import InvalidInput
from kunlun_common.messages import msg

MAX_PAGE_SIZE = 1000
"""The most workloads one page may hold (a page with every instance must stay far below gRPC's
message limit)."""


@dataclass(frozen=True)
class PageToken:
    """Where the next page starts and the revision the listing is read at."""

    revision: int
    """etcd revision of the listing's first page."""
    after: str
    """Id of the last workload already returned."""

    def encode(self) -> str:
        raw = json.dumps({"r": self.revision, "a": self.after}, separators=(",", ":")).encode()
        return base64.urlsafe_b64encode(raw).decode().rstrip("=")

    @staticmethod
    def decode(token: str) -> PageToken:
        """Parse a token from `next_page_token`; anything else is refused as invalid input."""
        try:
            raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
            data = json.loads(raw)
            revision, after = data["r"], data["a"]
        except (binascii.Error, ValueError, KeyError, TypeError) as e:
            raise InvalidInput(
                msg(
                    "paging.page_token_not_token",
                    "page_token: not a token this server issued ({name}); pass next_page_token from the previous page, or none for the first page",
                    name=e.__class__.__name__,
                )
            ) from e
        if not isinstance(revision, int) or revision <= 0 or not isinstance(after, str) or not after:
            raise InvalidInput(
                msg(
                    "paging.page_token_malformed_pass",
                    "page_token: malformed; pass next_page_token from the previous page",
                )
            )
        return PageToken(revision, after)


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


def workloads_start(token: PageToken | None) -> str:
    """First key of the page: the workload prefix, or just after the last id returned."""
    return keys.WORKLOADS if token is None else keys.workload(token.after) + "\0"


def workloads_end() -> bytes:
    return prefix_end(keys.WORKLOADS)


def instance_range(prefix: str, first_id: str, last_id: str) -> tuple[str, bytes]:
    """[start, end) under `prefix` (instances/ or instance-status/) covering ids that start with
    any workload id from `first_id` to `last_id` (callers keep only their own workloads' ones)."""
    return prefix + first_id, prefix_end(prefix + last_id)
