"""Per (workload, version) traffic counters of a gateway, reported with every heartbeat.

The hot path adds one request at a time: a count, an error flag (5xx from the engine, or a request
the gateway failed itself) and its latency in one of fixed, log-spaced buckets (a bisect over a
tuple). Counters are cumulative since the gateway started; the leader's rollout analysis
(`controlplane/rollout.py`) works on their deltas, summed over all gateways.
"""

from __future__ import annotations

from bisect import bisect_left

from kunlun_common.api import gateway_pb2
from kunlun_common.traffic import BOUNDS_MS, quantile_ms


class Counters:
    __slots__ = ("buckets", "errors", "requests")

    def __init__(self) -> None:
        self.requests = 0
        self.errors = 0
        self.buckets = [0] * (len(BOUNDS_MS) + 1)


class TrafficStats:
    def __init__(self) -> None:
        self.counters: dict[tuple[str, str], Counters] = {}

    def record(self, workload: str, variant: str, seconds: float, error: bool) -> None:
        c = self.counters.get((workload, variant))
        if c is None:
            c = self.counters[(workload, variant)] = Counters()
        c.requests += 1
        if error:
            c.errors += 1
        c.buckets[bisect_left(BOUNDS_MS, seconds * 1000.0)] += 1

    def snapshot(self) -> list[gateway_pb2.VariantStats]:
        out = []
        for (workload, variant), c in sorted(self.counters.items()):
            buckets = list(c.buckets)
            while buckets and not buckets[-1]:
                buckets.pop()
            out.append(
                gateway_pb2.VariantStats(
                    workload=workload,
                    variant=variant,
                    requests=c.requests,
                    errors=c.errors,
                    latency_buckets=buckets,
                )
            )
        return out


__all__ = ["BOUNDS_MS", "Counters", "TrafficStats", "quantile_ms"]
