"""Request rates: one token bucket per API key (`RateLimits`) and per client address
(`ClientRates`), refilled continuously.

A key may send `burst` requests at once, then `per_s` a second on average. A request finding the
bucket empty is answered 429 with Retry-After (whole seconds until a token is back). Buckets are
kept by key id (the `kl-<id>-` part of the secret, as `kunlun-cli gateway keys list` shows it), so
the settings can name a key without holding its secret; a valid key of another shape is counted by
its hash. Only keys that passed the hash check reach a bucket, so their number is bounded by the
keys the control plane pushed.
"""

from __future__ import annotations

import math

from gateway.settings import GatewaySettings


class Bucket:
    __slots__ = ("burst", "per_s", "stamp", "tokens")

    def __init__(self, per_s: float, burst: int, now: float) -> None:
        self.per_s = per_s
        self.burst = float(burst or max(1, math.ceil(per_s)))
        self.tokens = self.burst
        self.stamp = now

    def take(self, now: float) -> float:
        """0 when a token was taken, else the seconds until one is available."""
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.per_s)
        self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.per_s


class RateLimits:
    """Buckets of the keys that have a limit (the default, or their own entry)."""

    MAX_BUCKETS = 100_000

    def __init__(self, settings: GatewaySettings) -> None:
        self.default = (settings.rate_limit_per_s, settings.rate_limit_burst)
        self.own = {k.key: (k.per_s, k.burst) for k in settings.key_rate_limits}
        self.buckets: dict[str, Bucket] = {}
        self.active = settings.rate_limit_per_s > 0 or any(k.per_s > 0 for k in settings.key_rate_limits)
        self.throttled = 0

    def check(self, identity: str, now: float) -> int:
        """0 when `identity` may send now, else the Retry-After seconds (at least 1)."""
        bucket = self.buckets.get(identity)
        if bucket is None:
            per_s, burst = self.own.get(identity, self.default)
            if per_s <= 0:
                return 0
            if len(self.buckets) >= self.MAX_BUCKETS:
                self.buckets.clear()  # every key starts again with a full bucket: errs on letting in
            bucket = self.buckets[identity] = Bucket(per_s, burst, now)
        wait = bucket.take(now)
        if wait <= 0.0:
            return 0
        self.throttled += 1
        return max(1, math.ceil(wait))


class ClientRates:
    """Buckets of client addresses (`client_rate_limit_per_s`): every request but /health, before
    its API key is looked at, so a flood of unauthenticated requests from one address is cut too.

    The number of addresses is not bounded by anything the control plane pushed, so the map is
    bounded here: when it is full, buckets that refilled completely are dropped (they hold no
    state), and if that frees nothing every address starts again with a full bucket."""

    MAX_BUCKETS = 100_000

    def __init__(self, per_s: float, burst: int) -> None:
        self.per_s = per_s
        self.burst = burst
        self.active = per_s > 0
        self.buckets: dict[str, Bucket] = {}
        self.throttled = 0

    def check(self, address: str, now: float) -> int:
        """0 when `address` may send now, else the Retry-After seconds (at least 1)."""
        bucket = self.buckets.get(address)
        if bucket is None:
            if len(self.buckets) >= self.MAX_BUCKETS:
                self._prune(now)
            bucket = self.buckets[address] = Bucket(self.per_s, self.burst, now)
        wait = bucket.take(now)
        if wait <= 0.0:
            return 0
        self.throttled += 1
        return max(1, math.ceil(wait))

    def _prune(self, now: float) -> None:
        full = [a for a, b in self.buckets.items() if b.tokens + (now - b.stamp) * b.per_s >= b.burst]
        for a in full:
            del self.buckets[a]
        if len(self.buckets) >= self.MAX_BUCKETS:
            self.buckets.clear()
