"""Retries with a deadline and full jitter. Only TemporaryError is retried."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from kunlun_common.errors import TemporaryError

T = TypeVar("T")


def backoff_delay(attempt: int, base: float = 0.1, cap: float = 2.0) -> float:
    """Full-jitter exponential backoff: uniform(0, min(cap, base * 2**attempt))."""
    return random.uniform(0.0, min(cap, base * (2**attempt)))


async def retry_until(
    fn: Callable[[], Awaitable[T]],
    deadline_s: float,
    *,
    base: float = 0.1,
    cap: float = 2.0,
) -> T:
    """Call fn until it returns, retrying TemporaryError with jittered backoff until the deadline.

    The last TemporaryError is re-raised once the deadline has passed; anything else propagates
    at once.
    """
    end = time.monotonic() + deadline_s
    attempt = 0
    while True:
        try:
            return await fn()
        except TemporaryError as e:
            delay = max(backoff_delay(attempt, base, cap), min(e.delay, cap) if attempt == 0 else 0.0)
            if time.monotonic() + delay >= end:
                raise
            attempt += 1
            await asyncio.sleep(delay)
