"""Layer 5's canary: a rollout of the layer's test workload to a second model at 10 % (no explicit
steps: [10, 100], moved on only by promote), a bounded burst through a gateway, then the canary against
the baseline exactly as the leader's rollout analysis judges them (controlplane/rollout.py
`analyse`: the gateways' counters since the step began), read with `GetRollout(live_analysis)`,
and `rollout status` before and after one promote against the plan."""

from __future__ import annotations

import json
from dataclasses import dataclass

from controlplane.cli.client import CliError
from controlplane.cli.rollout_cmd import rollout_json
from controlplane.cli.verify.api import Api, poll, running
from controlplane.cli.verify.common import Options, burst_command, pct, workload_evidence
from controlplane.cli.verify.deploy import Deployed
from controlplane.cli.verify.load import MIN_BURST_S, run_burst
from controlplane.cli.verify.model import Evidence, LayerResult, evidence
from controlplane.cli.views import reason_of
from controlplane.rollout import DEFAULT_MAX_ERROR_RATE, DEFAULT_MAX_P95_INCREASE, DEFAULT_MIN_P95_DELTA_MS
from kunlun_common.api import rollout_pb2
from kunlun_common.messages import msg
from kunlun_common.states import RolloutPhase, Verdict

CANARY_PCT = 10
STEPS = [CANARY_PCT, 100]
SHARE_TOLERANCE_POINTS = 5.0
"""The gateways split at random: the canary's share of a burst may differ from 10 % by this much."""
STATS_WAIT_S = 30.0
"""Gateways report their counters with their heartbeats (every 2 s): wait at most this long for the
burst to show in the analysis."""
PROMOTE_WAIT_S = 30.0


@dataclass
class Plan:
    created: rollout_pb2.Rollout
    min_requests: int
    started: rollout_pb2.Rollout
    """The rollout once its canary instance served."""
    canary_instances: list[str]


def rollout_evidence(r: rollout_pb2.Rollout) -> Evidence:
    d = rollout_json(r)
    d.pop("history", None)
    live = " --live" if r.HasField("live_analysis") else ""
    return evidence(f"kunlun-cli rollout status {r.workload}{live} -o json", json.dumps(d, indent=1))


def start(api: Api, name: str, opts: Options) -> Plan:
    """Create the rollout and wait (bounded) until its canary instance serves."""
    min_requests = max(5, opts.requests * CANARY_PCT // 100 // 2)  # half the canary's expected share
    spec = rollout_pb2.RolloutSpec(
        workload=name,
        model=f"{name}-canary",
        canary_pct=CANARY_PCT,  # no explicit steps: [10, 100], and only promote moves it on
        min_requests=min_requests,
    )
    created = api.create_rollout(spec)

    def canary_serves() -> bool:
        return any(i.variant == "canary" for i in running(api.workload(name)))

    poll(
        msg("verify.poll.canary", "the canary instance of {name} to serve", name=name),
        canary_serves,
        opts.ready_timeout_s,
    )
    summary = api.workload(name)
    return Plan(
        created,
        min_requests,
        api.rollout(name),
        [i.id for i in summary.instances if i.variant == "canary"],
    )


def _counted(r: rollout_pb2.Rollout) -> int:
    a = r.live_analysis
    return int(a.baseline.requests + a.canary.requests)


def _promoted(r: rollout_pb2.Rollout) -> bool:
    return r.promotions_applied >= 1 or r.phase != RolloutPhase.PROGRESSING


def measure(api: Api, r: LayerResult, d: Deployed, name: str, plan: Plan, opts: Options) -> None:
    started = plan.started
    at_start_ok = (
        started.phase == RolloutPhase.PROGRESSING
        and started.step == 0
        and started.weight_pct == CANARY_PCT
        and len(plan.canary_instances) == 1
    )
    before_ev = rollout_evidence(started)
    n = opts.requests
    b = run_burst(
        d.gateway,
        name,
        n,
        opts.concurrency,
        opts.burst_timeout_s,
        api_key=d.api_key,
        min_duration_s=MIN_BURST_S,
    )
    r.latencies_ms = b.latencies_ms
    burst_ev = evidence(burst_command(d.gateway, n, opts.concurrency), b.report())
    try:
        poll(
            msg("verify.poll.counters", "the gateways' counters to hold the burst"),
            lambda: _counted(api.rollout(name, live=True)) >= b.ok,
            STATS_WAIT_S,
        )
    except CliError:
        pass  # judged with what arrived; the measured value says how much that was
    live = api.rollout(name, live=True)
    a = live.live_analysis
    c, base = a.canary, a.baseline
    total = c.requests + base.requests
    share = 100.0 * c.requests / total if total else 0.0
    live_ev = rollout_evidence(live)
    r.add(
        "canary share of the burst",
        msg(
            "verify.canary.share",
            "{canary} of {total} requests to the canary ({share}); burst: {ok}/{sent} answered 200",
            canary=c.requests,
            total=total,
            share=pct(share),
            ok=b.ok,
            sent=b.sent,
        ),
        msg(
            "verify.canary.share_threshold",
            "{pct} % +- {tolerance:.0f} points, every request counted and answered",
            pct=CANARY_PCT,
            tolerance=SHARE_TOLERANCE_POINTS,
        ),
        abs(share - CANARY_PCT) <= SHARE_TOLERANCE_POINTS and total >= b.ok and b.ok == n,
        burst_ev,
        live_ev,
    )
    r.add(
        "canary error rate",
        msg(
            "verify.canary.errors",
            "{rate:.2f} % ({errors}/{requests}); baseline {base_rate:.2f} %",
            rate=c.error_rate * 100,
            errors=c.errors,
            requests=c.requests,
            base_rate=base.error_rate * 100,
        ),
        msg(
            "verify.canary.errors_threshold",
            "< {rate:.1f} % over at least {min_requests} canary requests",
            rate=DEFAULT_MAX_ERROR_RATE * 100,
            min_requests=plan.min_requests,
        ),
        c.requests >= plan.min_requests and c.error_rate < DEFAULT_MAX_ERROR_RATE,
        live_ev,
    )
    delta = c.p95_ms - base.p95_ms
    within = delta <= base.p95_ms * DEFAULT_MAX_P95_INCREASE or delta < DEFAULT_MIN_P95_DELTA_MS
    r.add(
        "canary p95 latency against the baseline",
        msg(
            "verify.canary.p95",
            "canary p95 {canary:g} ms, baseline {baseline:g} ms ({delta:+.1f} ms{deviation}); analysis {verdict}",
            canary=c.p95_ms,
            baseline=base.p95_ms,
            delta=delta,
            deviation=f", {a.p95_deviation:+.1%}" if base.p95_ms else "",
            verdict=a.verdict,
        ),
        msg(
            "verify.canary.p95_threshold",
            "within +{increase:.0%} of the baseline or +{delta:g} ms (as the rollout analysis)",
            increase=DEFAULT_MAX_P95_INCREASE,
            delta=DEFAULT_MIN_P95_DELTA_MS,
        ),
        within and a.verdict == Verdict.PASSED,
        live_ev,
    )
    api.promote(name)
    try:
        poll(
            msg("verify.poll.promote", "the leader to apply the promote of {name}", name=name),
            lambda: _promoted(api.rollout(name)),
            PROMOTE_WAIT_S,
        )
    except CliError:
        pass
    after = api.rollout(name)
    la = after.last_analysis
    after_ok = (
        after.phase == RolloutPhase.PROGRESSING
        and after.step == 1
        and after.weight_pct == STEPS[1]
        and la.verdict == Verdict.PASSED
    )
    r.add(
        "rollout status consistent with the plan",
        msg(
            "verify.canary.status",
            "created: step 1 of {steps} at {weight} % ({phase}) with {canaries} canary instance serving; "
            "after promote: step {step} at {weight_after} % ({phase_after}), the leader's analysis "
            "{verdict}: {reason}",
            steps=str(STEPS),
            weight=started.weight_pct,
            phase=started.phase,
            canaries=len(plan.canary_instances),
            step=after.step + 1,
            weight_after=after.weight_pct,
            phase_after=after.phase,
            verdict=la.verdict or msg("verify.none", "none"),
            reason=reason_of(la),
        ),
        msg(
            "verify.canary.status_threshold",
            "steps {steps}: 10 % with 1 canary instance, then after promote 100 % with the analysis {verdict}",
            steps=str(STEPS),
            verdict=Verdict.PASSED,
        ),
        at_start_ok and after_ok,
        before_ev,
        rollout_evidence(after),
        workload_evidence(api.workload(name)),
    )
