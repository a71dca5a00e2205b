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
