"""What the gateway and the control plane share about traffic: routing policy names, how an API key
is stored, and the latency histogram (fixed buckets, quantiles).

The gateway (`gateway/`) and the control plane (`controlplane/`) are separate processes that never
import each other; both import these definitions from here so the two sides cannot drift.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

# Routing policies a gateway implements; `kunlun-cli gateway policy set` accepts exactly these.
ROUTING_POLICIES: tuple[str, ...] = ("round_robin", "least_outstanding", "prefix_affinity")

# Upper bounds (ms) of the latency buckets: 1 ms * 1.15^i, up to ~71 s; one more bucket above.
BOUNDS_MS: tuple[float, ...] = tuple(round(1.15**i, 3) for i in range(80))


def key_hash(secret: str | bytes) -> str:
    """The stored form of an API key: hex SHA-256 of its UTF-8 bytes."""
    raw = secret.encode() if isinstance(secret, str) else secret
    return hashlib.sha256(raw).hexdigest()


def quantile_ms(buckets: Sequence[int], q: float) -> float:
    """The q-quantile (0..1) of a bucket histogram, interpolated linearly inside its bucket."""
    total = sum(buckets)
    if total <= 0:
        return 0.0
    rank = q * total
    seen = 0
    for i, n in enumerate(buckets):
        if n > 0 and seen + n >= rank:
            lo = BOUNDS_MS[i - 1] if i > 0 else 0.0
            hi = BOUNDS_MS[i] if i < len(BOUNDS_MS) else lo
            return lo + (hi - lo) * (rank - seen) / n
        seen += n
    return BOUNDS_MS[-1]
