"""Routing policies: which of a workload's available instances takes the next request.

Each policy gets the instances that may take a request now (not removed, not ejected, below the
in-flight limit, not already tried for this request) and picks one:

- round_robin: in turn.
- least_outstanding: power of two choices — two instances at random, the one with fewer requests
  in flight (close to least-loaded at O(1) cost, without herding onto one instance).
- prefix_affinity: consistent hashing (uhashring, a ketama ring over the instance ids) of the
  request's `x-session-id`, else of the first `prefix_chars` characters of the prompt, so one
  prefix keeps hitting one instance's KV cache. Bounded load (consistent hashing with bounded
  loads, Mirrokni et al.): an instance with `ceil(balance_factor * (in-flight total + 1) / n)` or
  more requests in flight is skipped for the next one clockwise on the ring.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any, Protocol

from uhashring import HashRing  # type: ignore[import-untyped]


class Routable(Protocol):
    instance_id: str
    inflight: int


class Policy(Protocol):
    name: str

    def update(self, backends: Sequence[Routable]) -> None:
        """The workload's instance set changed (called with every instance, available or not)."""

    def pick(self, candidates: Sequence[Routable], key: str | None) -> Routable:
        """Choose among `candidates` (never empty)."""


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def update(self, backends: Sequence[Routable]) -> None:
        pass

    def pick(self, candidates: Sequence[Routable], key: str | None) -> Routable:
        i = self._next
        self._next = i + 1
        return candidates[i % len(candidates)]


class LeastOutstanding:
    name = "least_outstanding"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._random = (rng or random.Random()).random

    def update(self, backends: Sequence[Routable]) -> None:
        pass

    def pick(self, candidates: Sequence[Routable], key: str | None) -> Routable:
        n = len(candidates)
        if n == 1:
            return candidates[0]
        i = int(self._random() * n)
        j = int(self._random() * (n - 1))
        if j >= i:
            j += 1
        a, b = candidates[i], candidates[j]
        return a if a.inflight <= b.inflight else b


class PrefixAffinity:
    name = "prefix_affinity"

    def __init__(self, balance_factor: float = 1.25, prefix_chars: int = 256) -> None:
        self.balance_factor = balance_factor
        self.prefix_chars = prefix_chars
        self._ring: Any = None
        self._ids: tuple[str, ...] = ()
        self._fallback = LeastOutstanding()

    def update(self, backends: Sequence[Routable]) -> None:
        ids = tuple(sorted(b.instance_id for b in backends))
        if ids != self._ids:
            self._ids = ids
            self._ring = HashRing(nodes=list(ids)) if ids else None

    def capacity(self, candidates: Sequence[Routable]) -> int:
        total = sum(c.inflight for c in candidates)
        return max(1, math.ceil(self.balance_factor * (total + 1) / len(candidates)))

    def pick(self, candidates: Sequence[Routable], key: str | None) -> Routable:
        if key is None or self._ring is None:
            return self._fallback.pick(candidates, None)
        cap = self.capacity(candidates)
        by_id = {c.instance_id: c for c in candidates}
        first = by_id.get(self._ring.get_node(key))
        if first is not None and first.inflight < cap:
            return first
        for node in self._ring.range(key):
            c = by_id.get(node["nodename"])
            if c is not None and c.inflight < cap:
                return c
        return min(candidates, key=lambda c: c.inflight)


def make_policy(name: str, balance_factor: float, prefix_chars: int) -> Policy:
    if name == "least_outstanding":
        return LeastOutstanding()
    if name == "prefix_affinity":
        return PrefixAffinity(balance_factor, prefix_chars)
    return RoundRobin()


def prompt_prefix(body: dict[str, Any], limit: int) -> str | None:
    """The first `limit` characters of the prompt of a chat, completion or /generate request."""
    messages = body.get("messages")
    if isinstance(messages, list):
        parts: list[str] = []
        size = 0
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):
                content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
            if isinstance(content, str):
                parts.append(content)
                size += len(content)
                if size >= limit:
                    break
        return "\n".join(parts)[:limit] if parts else None
    for field in ("prompt", "text"):
        value = body.get(field)
        if isinstance(value, str):
            return value[:limit]
        if isinstance(value, list) and value:
            if isinstance(value[0], str):
                return value[0][:limit]
            return ",".join(str(v) for v in value[:limit])
    ids = body.get("input_ids")
    if isinstance(ids, list) and ids:
        return ",".join(str(i) for i in ids[:limit])
    return None
