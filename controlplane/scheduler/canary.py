"""How many canary instances a rollout's weight asks for (pure; the rollout loop in
`controlplane/rollout.py` moves the weight, the scheduler's reconcile creates and removes them)."""

from __future__ import annotations

import math

from kunlun_common.api import rollout_pb2, workload_pb2
from kunlun_common.states import RolloutPhase

CANARY = "canary"
"""The `variant` of a canary instance."""


def canary_count(w: workload_pb2.Workload, r: rollout_pb2.Rollout | None) -> int:
    """Canary instances for the weight: at least 1, at most the baseline's replicas; 0 when none."""
    if (
        r is None
        or r.phase != RolloutPhase.PROGRESSING
        or r.weight_pct <= 0
        or w.spec.replicas <= 0
        or w.deleting
    ):
        return 0
    return min(w.spec.replicas, max(1, math.ceil(w.spec.replicas * r.weight_pct / 100)))
