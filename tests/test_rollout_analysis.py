"""The canary analysis without a cluster: thresholds, the p95 floor, minimum requests, the deltas
over several gateways, and what the leader's state machine does with a verdict."""

from __future__ import annotations

from controlplane.rollout import (
    CANARY,
    Totals,
    advance,
    analyse,
    step_totals,
)
from gateway.stats import BOUNDS_MS, TrafficStats, quantile_ms
from kunlun_common.api import gateway_pb2, rollout_pb2
from kunlun_common.states import RolloutPhase, Verdict


def totals(requests: int, errors: int, latency_ms: float, slow: int = 0, slow_ms: float = 0.0) -> Totals:
    """`requests` at `latency_ms`, of which `slow` at `slow_ms` instead."""
    s = TrafficStats()
    for i in range(requests):
        s.record("chat", "", (slow_ms if i < slow else latency_ms) / 1000, i < errors)
    t = Totals()
    v = s.snapshot()[0]
    t.add(v.requests, v.errors, list(v.latency_buckets))
    return t


def spec(**kw: float) -> rollout_pb2.RolloutSpec:
    return rollout_pb2.RolloutSpec(workload="chat", model="m-new", canary_pct=10, **kw)  # type: ignore[arg-type]


def test_quantiles_of_the_buckets_are_close() -> None:
    s = TrafficStats()
    for ms in range(1, 1001):
        s.record("w", "", ms / 1000, False)
    b = list(s.counters[("w", "")].buckets)
    assert abs(quantile_ms(b, 0.5) - 500) / 500 < 0.08
    assert abs(quantile_ms(b, 0.95) - 950) / 950 < 0.08
    assert quantile_ms([], 0.95) == 0.0
    assert len(b) == len(BOUNDS_MS) + 1


def test_error_rate_fails_the_canary() -> None:
    a = analyse(spec(), totals(200, 0, 10), totals(100, 5, 10))
    assert a.verdict == Verdict.FAILED and a.canary.error_rate == 0.05 and a.canary.errors == 5
    assert "canary error rate 5.00% (5/100) >= max 0.10%" in a.reason
    assert analyse(spec(max_error_rate=0.1), totals(200, 0, 10), totals(100, 5, 10)).verdict == Verdict.PASSED
    assert analyse(spec(), totals(200, 0, 10), totals(100, 0, 10)).verdict == Verdict.PASSED


def test_p95_increase_fails_the_canary() -> None:
    a = analyse(spec(), totals(200, 0, 100), totals(100, 0, 100, slow=10, slow_ms=300))
    assert a.verdict == Verdict.FAILED and a.canary.p95_ms > 200 and 0.9 < a.baseline.p95_ms / 100 < 1.1
    assert a.p95_deviation > 1.0 and "canary p95" in a.reason and "vs baseline" in a.reason
    # within 5%: passes
    assert analyse(spec(), totals(200, 0, 100), totals(100, 0, 102)).verdict == Verdict.PASSED
    # a larger allowance passes it
    ok = analyse(spec(max_p95_increase=5.0), totals(200, 0, 100), totals(100, 0, 100, slow=10, slow_ms=300))
    assert ok.verdict == Verdict.PASSED


def test_p95_differences_under_the_floor_are_ignored() -> None:
    # +50% but only ~5 ms: under the 20 ms floor
    a = analyse(spec(), totals(200, 0, 10), totals(100, 0, 15))
    assert a.verdict == Verdict.PASSED and a.p95_deviation > 0.3
    # the same with a 1 ms floor fails
    assert analyse(spec(min_p95_delta_ms=1), totals(200, 0, 10), totals(100, 0, 15)).verdict == Verdict.FAILED


def test_too_few_requests_wait() -> None:
    a = analyse(spec(), totals(30, 0, 10), totals(10, 10, 10))
    assert a.verdict == Verdict.WAITING and a.reason.startswith("waiting for 60 requests")
    assert analyse(spec(min_requests=10), totals(30, 0, 10), totals(10, 10, 10)).verdict == Verdict.FAILED
    # at 100% the baseline gets nothing: only the canary is counted and checked
    only = analyse(spec(), Totals(), totals(60, 0, 10), with_baseline=False)
    assert only.verdict == Verdict.PASSED


def gw(
    name: str, started: int, canary: tuple[int, int], baseline: tuple[int, int]
) -> gateway_pb2.GatewayStats:
    return gateway_pb2.GatewayStats(
        gateway=name,
        started_at_unix_ms=started,
        stats=[
            gateway_pb2.VariantStats(
                workload="chat",
                variant="",
                requests=baseline[0],
                errors=baseline[1],
                latency_buckets=[baseline[0]],
            ),
            gateway_pb2.VariantStats(
                workload="chat",
                variant=CANARY,
                requests=canary[0],
                errors=canary[1],
                latency_buckets=[canary[0]],
            ),
            gateway_pb2.VariantStats(
                workload="other", variant="", requests=999, errors=999, latency_buckets=[999]
            ),
        ],
    )


def test_deltas_sum_over_gateways_and_survive_restarts() -> None:
    start = [gw("g1", 1, (10, 1), (100, 0)), gw("g2", 1, (5, 0), (50, 0))]
    now = [
        gw("g1", 1, (30, 2), (160, 0)),  # +20 canary (+1 error), +60 baseline
        gw("g2", 2, (7, 0), (8, 0)),  # restarted: counts from zero
        gw("g3", 1, (3, 0), (4, 0)),  # new: counts from zero
    ]
    t = step_totals("chat", start, now)
    assert (t[CANARY].requests, t[CANARY].errors, t[""].requests) == (30, 1, 72)
    assert sum(t[CANARY].buckets) == 30


def test_a_failed_analysis_at_the_end_of_a_step_degrades_the_rollout() -> None:
    r = rollout_pb2.Rollout(
        workload_id="w-1",
        workload="chat",
        spec=rollout_pb2.RolloutSpec(workload="chat", model="m-new", steps=[50, 100], interval_s=10),
        baseline_model="m-old",
        phase=RolloutPhase.PROGRESSING,
        weight_pct=50,
        step_start_stats=[gw("g1", 1, (0, 0), (0, 0))],
    )
    few = [gw("g1", 1, (20, 2), (20, 0))]
    assert advance(r, 5_000, "t", few) is None  # the step is not over
    waiting = advance(r, 10_000, "t", few)
    assert waiting is not None and waiting.phase == RolloutPhase.PROGRESSING and waiting.weight_pct == 50
    assert (
        waiting.reason.startswith("waiting for 60 requests")
        and waiting.last_analysis.verdict == Verdict.WAITING
    )
    assert advance(waiting, 11_000, "t", few) is None  # nothing new: no write
    bad = advance(waiting, 12_000, "t", [gw("g1", 1, (100, 5), (100, 0))])
    assert bad is not None and bad.phase == RolloutPhase.DEGRADED and bad.weight_pct == 0
    assert "5.00% (5/100)" in bad.reason and bad.last_analysis.canary.errors == 5
    assert bad.history[-1].phase == RolloutPhase.DEGRADED and advance(bad, 99_000, "t", []) is None
    good = advance(waiting, 12_000, "t", [gw("g1", 1, (100, 0), (100, 0))])
    assert good is not None and (good.phase, good.step, good.weight_pct) == (RolloutPhase.PROGRESSING, 1, 100)
    assert good.last_analysis.verdict == Verdict.PASSED and good.step_start_stats[0].stats[1].requests == 100
    # a promote with too little traffic goes ahead (the operator decided), noting it
    r.promotions_requested = 1
    promoted = advance(r, 1_000, "t", few)
    assert promoted is not None and promoted.weight_pct == 100 and "analysis incomplete" in promoted.reason
