"""The wall clock in the units the platform stores (milliseconds since the epoch)."""

from __future__ import annotations

import time


def now_ms() -> int:
    """Milliseconds since the Unix epoch (wall clock: timestamps in records, never for timeouts)."""
    return int(time.time() * 1000)
