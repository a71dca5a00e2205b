"""Invariant checkers over etcd history (pure functions; the runs feed them what they read)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LeaderWrite:
    """One fenced leader-state write: at `revision`, by the leader of `epoch`."""

    revision: int
    epoch: int


def deposed_leader_commits(writes: Sequence[LeaderWrite]) -> list[LeaderWrite]:
    """Writes made by a leader after a newer epoch had already committed (must be empty).

    Epochs are the leader key's create revisions, so they only grow; a write whose epoch is older
    than one already seen at a lower revision was committed by a deposed leader.
    """
    bad: list[LeaderWrite] = []
    newest = 0
    for w in sorted(writes, key=lambda w: w.revision):
        if w.epoch < newest:
            bad.append(w)
        newest = max(newest, w.epoch)
    return bad


@dataclass(frozen=True)
class AllocEvent:
    """A change of one device's allocation key, as read from the etcd history."""

    revision: int
    device: str
    kind: str  # "put" or "delete"
    instance: str
    version: int


def double_allocations(events: Sequence[AllocEvent]) -> list[str]:
    """Moments where a device was given to an instance while another still held it (must be empty).

    Replays the whole history: a put on a device that is held (no delete since its last put)
    means two instances held it at once.
    """
    holder: dict[str, str] = {}
    bad: list[str] = []
    for e in sorted(events, key=lambda e: e.revision):
        if e.kind == "put":
            if e.device in holder and holder[e.device] != e.instance:
                bad.append(
                    f"rev {e.revision}: {e.device} given to {e.instance} while held by {holder[e.device]}"
                )
            holder[e.device] = e.instance
        else:
            holder.pop(e.device, None)
    return bad
