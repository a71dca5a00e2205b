"""Test-only failpoints of a replica: faults that no real fault produces on demand.

`KUNLUN_FAILPOINT_WATCH_HOLD=/path/to/file` (a lagging replica): while that file exists, the
replica's graph cache takes no event from its etcd watch. The watch stream stays open and backs up
(etcd keeps the events, nothing is lost or reordered), so the replica keeps serving the assignment
sets, endpoints and statuses of the revision it had, while its own writes (registrations, leases)
still reach etcd. Once the file is gone the cache catches up in revision order.

Why a failpoint and not a network fault (tests/test_cp_faults.py, the lagging-replica test): our
etcd client sends `hasleader`, so a member cut off from its peers refuses every request and etcd
cancels its watches after three election timeouts; a replica behind such a member can register no
agent, so it cannot push its old set. It lags while its writes work only in the moment a cut heals
(its watch is still in its retry backoff, up to 2 s, while a registration already succeeds): real,
but too short and too random to test on demand.

Refused unless the replica runs with `--allow-test-failpoints`: a replica started with a failpoint
variable set but without that flag exits with an error naming both, so no production replica runs
one by accident. With the flag, the replica logs a warning naming each failpoint it honours.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from kunlun_common.errors import ConfigError

WATCH_HOLD_ENV = "KUNLUN_FAILPOINT_WATCH_HOLD"
ALLOW_FLAG = "--allow-test-failpoints"
POLL_S = 0.05
"""How often a held watch looks whether its file is gone."""


@dataclass(frozen=True)
class Failpoints:
    """The failpoints a replica honours (none by default)."""

    watch_hold_file: str = ""
    """While this file exists, the graph cache applies no watch event (empty: never held)."""

    def active(self) -> dict[str, str]:
        """Environment variable -> value of every failpoint set (for the start-up warning)."""
        return {WATCH_HOLD_ENV: self.watch_hold_file} if self.watch_hold_file else {}


def from_env(environ: Mapping[str, str], allowed: bool) -> Failpoints:
    """The failpoints named in the environment; ConfigError if one is set without the flag."""
    hold = environ.get(WATCH_HOLD_ENV, "")
    if hold and not allowed:
        raise ConfigError(
            f"{WATCH_HOLD_ENV} is set but {ALLOW_FLAG} is not: failpoints are for tests only; "
            f"unset {WATCH_HOLD_ENV} (or pass {ALLOW_FLAG} in a test cluster)"
        )
    if hold and not Path(hold).is_absolute():
        raise ConfigError(f"{WATCH_HOLD_ENV}: expected an absolute file path, found {hold!r}")
    return Failpoints(watch_hold_file=hold)


def watch_hold(path: Path) -> Callable[[], Awaitable[None]]:
    """A gate the graph cache awaits before each watch event: returns once `path` does not exist."""

    async def gate() -> None:
        held = await asyncio.to_thread(path.exists)  # a file another process makes: polled
        while held:
            await asyncio.sleep(POLL_S)
            held = await asyncio.to_thread(path.exists)

    return gate
