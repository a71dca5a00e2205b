"""Self-fencing of engines: the agent's lease file, renewed on every acknowledged heartbeat.

`<agent state dir>/fence.json` holds `deadline_mono` (CLOCK_MONOTONIC seconds, shared by every
process of one boot) = the agent's last acknowledged contact with a replica + the disconnect
deadline. Each engine's supervisor reads it every FENCE_CHECK_S and stops its engine by itself once
the deadline has passed, so an agent that is frozen, killed or cut off can never leave an engine
running past the deadline, and a supervisor never starts an engine under an expired lease. The
deadline outlasts an agent restart (the file stays; the next agent renews it once registered).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

FENCE_FILE = "fence.json"
FENCE_CHECK_S = 0.5
FENCE_SLACK_S = 1.0
"""A supervisor acts this long after the lease's deadline: an agent that is alive stops its engines
itself at the deadline (orderly, with a note); the supervisor is the backstop. The agent reports
deadline + slack at registration, so the fencing rule accounts for it."""
MIN_DEADLINE_S = 2.0
"""Shortest disconnect deadline accepted: it must outlast an agent restart."""


def boot_id() -> str:
    """This boot's id (monotonic times are comparable only within one boot)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


@dataclass(frozen=True)
class Fence:
    """One reading of the lease file."""

    deadline_mono: float
    """CLOCK_MONOTONIC second after which engines must not run."""
    renewed_mono: float
    """When the agent last had an acknowledged heartbeat."""
    boot_id: str
    """The boot the monotonic times belong to."""

    def expired(self, now_mono: float | None = None) -> bool:
        """Whether engines must stop now (the deadline plus FENCE_SLACK_S has passed)."""
        if self.boot_id and self.boot_id != boot_id():
            return True  # written before a reboot: its times mean nothing now
        now = time.monotonic() if now_mono is None else now_mono
        return now >= self.deadline_mono + FENCE_SLACK_S


def renew(path: Path, last_ack_mono: float, deadline_s: float) -> None:
    """Write the lease: engines may run until `last_ack_mono + deadline_s`. Blocking (small write)."""
    data = {
        "deadline_mono": last_ack_mono + deadline_s,
        "renewed_mono": last_ack_mono,
        "deadline_s": deadline_s,
        "boot_id": boot_id(),
        "written_wall_ms": int(time.time() * 1000),
    }
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def read(path: Path) -> Fence | None:
    """The lease, or None when there is none (or it is unreadable)."""
    try:
        data = json.loads(path.read_text())
        return Fence(float(data["deadline_mono"]), float(data["renewed_mono"]), str(data.get("boot_id", "")))
    except (OSError, ValueError, KeyError, TypeError):
        return None
