"""Canary rollouts, driven by the leader.

The API writes a rollout's goal state (`rollouts/<workload id>`: the canary model and steps, and
promote/abort requests); this loop, on the leader, moves it on with fenced writes, so a new leader
continues where the old one stopped:

    Progressing (step i, weight steps[i]) --interval elapsed or promote--> step i+1 ... --> Completed
    Progressing --abort--> Aborted (weight 0; the scheduler removes the canary instances)
    Progressing --failed analysis--> Degraded (as Aborted, with the numbers that failed)

The analysis: at the end of every step interval and before every promote, the leader sums the
gateways' counters (`gateway-stats/<gateway>`, written by the replicas from the gateways'
heartbeats) minus those recorded when the step started, per version, and compares the canary with
the baseline (`analyse`): its error rate must stay below max_error_rate and its p95 latency within
max_p95_increase of the baseline's (differences under min_p95_delta_ms ignored), once both saw
min_requests in the step. Until then an interval step waits ("waiting for N requests"); a promote
goes ahead (the operator decided) with the analysis it could make. At 100% the baseline gets no
requests: only the canary's error rate is checked.

Without explicit steps the steps are [canary_pct, 100] and only `rollout promote` moves them on.
On completion the workload's spec takes the canary's model (and engine args), a new generation: the
scheduler restarts the baseline instances on it and removes the canary instances, so nothing serves
the old model afterwards. The scheduler sizes the canary (`canary_count`), the replicas' feeds give
canary instances the canary spec, and gateways split requests by `weight_pct`.
"""

from __future__ import annotations

import structlog

from controlplane import keys
from controlplane.cache import GraphCache
from controlplane.election import Fence
from controlplane.leader_loop import run_leader_loop
from controlplane.scheduler.canary import CANARY as CANARY  # kept importable from here
from controlplane.scheduler.canary import canary_count as canary_count  # kept importable from here
from controlplane.store import KV, Compare, EtcdStore, PutOp
from controlplane.workloads.records import add_history
from kunlun_common.api import gateway_pb2, rollout_pb2, workload_pb2
from kunlun_common.clock import now_ms
from kunlun_common.errors import TemporaryError
from kunlun_common.messages import Message, from_stored, msg, msg_list, plain, stored_reason, to_stored
from kunlun_common.states import RolloutPhase, Verdict, WorkloadChange
from kunlun_common.traffic import quantile_ms

log = structlog.get_logger("rollout")
DEFAULT_MAX_ERROR_RATE = 0.001
DEFAULT_MAX_P95_INCREASE = 0.05
DEFAULT_MIN_P95_DELTA_MS = 20.0
DEFAULT_MIN_REQUESTS = 50
DEFAULT_INTERVAL_S = 120


def steps_of(spec: rollout_pb2.RolloutSpec) -> list[int]:
    return list(spec.steps) if spec.steps else [spec.canary_pct, 100]


def canary_spec(w: workload_pb2.Workload, r: rollout_pb2.Rollout) -> workload_pb2.WorkloadSpec:
    """The workload's spec with the rollout's model (and engine args, when given)."""
    spec = workload_pb2.WorkloadSpec()
    spec.CopyFrom(w.spec)
    spec.model = r.spec.model
    if r.spec.engine_args:
        del spec.engine_args[:]
        spec.engine_args.extend(r.spec.engine_args)
    return spec


def live_rollout(r: rollout_pb2.Rollout | None) -> bool:
    return r is not None and r.phase == RolloutPhase.PROGRESSING and r.weight_pct > 0


def _event(r: rollout_pb2.Rollout, phase: str, by: str, reason: Message) -> None:
    r.phase = phase
    r.reason, r.reason_message = str(reason), to_stored(reason)
    r.history.append(
        workload_pb2.PhaseEvent(
            phase=phase, at_unix_ms=now_ms(), by=by, reason=r.reason, reason_message=r.reason_message
        )
    )
    del r.history[:-50]


def _analysis_reason(a: rollout_pb2.RolloutAnalysis) -> Message:
    """An analysis' reason as the message it was made with (its English text as is otherwise)."""
    return from_stored(a.reason_message, a.reason) or plain(a.reason)


class Totals:
    """One version's requests, errors and latency buckets, summed."""

    __slots__ = ("buckets", "errors", "requests")

    def __init__(self) -> None:
        self.requests = 0
        self.errors = 0
        self.buckets: list[int] = []

    def add(self, requests: int, errors: int, buckets: list[int]) -> None:
        self.requests += requests
        self.errors += errors
        if len(self.buckets) < len(buckets):
            self.buckets.extend([0] * (len(buckets) - len(self.buckets)))
        for i, n in enumerate(buckets):
            self.buckets[i] += n


def step_totals(
    workload: str, start: list[gateway_pb2.GatewayStats], current: list[gateway_pb2.GatewayStats]
) -> dict[str, Totals]:
    """Per version ("" baseline, "canary"): the workload's counters over all gateways since the
    step started. A gateway that restarted since (other start time, or a counter went down)
    counts from zero; one that went away is missing (its requests since the step started too)."""
    before = {g.gateway: g for g in start}
    out = {"": Totals(), CANARY: Totals()}
    for g in current:
        old = before.get(g.gateway)
        olds = {}
        if old is not None and old.started_at_unix_ms == g.started_at_unix_ms:
            olds = {(v.workload, v.variant): v for v in old.stats}
        for v in g.stats:
            if v.workload != workload or v.variant not in out:
                continue
            buckets = list(v.latency_buckets)
            o = olds.get((v.workload, v.variant))
            if o is not None:
                delta = [
                    n - (o.latency_buckets[i] if i < len(o.latency_buckets) else 0)
                    for i, n in enumerate(buckets)
                ]
                if v.requests >= o.requests and v.errors >= o.errors and min(delta, default=0) >= 0:
                    out[v.variant].add(v.requests - o.requests, v.errors - o.errors, delta)
                    continue
            out[v.variant].add(v.requests, v.errors, buckets)
    return out


def _version(t: Totals) -> rollout_pb2.VersionStats:
    return rollout_pb2.VersionStats(
        requests=t.requests,
        errors=t.errors,
        error_rate=t.errors / t.requests if t.requests else 0.0,
        p50_ms=round(quantile_ms(t.buckets, 0.50), 2),
        p95_ms=round(quantile_ms(t.buckets, 0.95), 2),
    )


def analyse(
    spec: rollout_pb2.RolloutSpec, baseline: Totals, canary: Totals, with_baseline: bool = True
) -> rollout_pb2.RolloutAnalysis:
    """Canary vs baseline over one step (pure). `with_baseline` False (canary at 100%): only the
    canary's error rate and request count are checked."""
    max_err = spec.max_error_rate if spec.HasField("max_error_rate") else DEFAULT_MAX_ERROR_RATE
    max_inc = spec.max_p95_increase if spec.HasField("max_p95_increase") else DEFAULT_MAX_P95_INCREASE
    floor = spec.min_p95_delta_ms if spec.HasField("min_p95_delta_ms") else DEFAULT_MIN_P95_DELTA_MS
    min_req = spec.min_requests if spec.HasField("min_requests") else DEFAULT_MIN_REQUESTS
    a = rollout_pb2.RolloutAnalysis(baseline=_version(baseline), canary=_version(canary))
    b, c = a.baseline, a.canary
    if with_baseline and b.p95_ms > 0:
        a.p95_deviation = round((c.p95_ms - b.p95_ms) / b.p95_ms, 4)
    missing = max(0, min_req - c.requests) + (max(0, min_req - b.requests) if with_baseline else 0)
    if missing:
        a.verdict = Verdict.WAITING
        m = (
            msg(
                "rollout.waiting_both",
                "waiting for {missing} requests (canary {canary}, baseline {baseline}; {min_req} each needed)",
                missing=missing,
                canary=c.requests,
                baseline=b.requests,
                min_req=min_req,
            )
            if with_baseline
            else msg(
                "rollout.waiting",
                "waiting for {missing} requests (canary {canary}; {min_req} each needed)",
                missing=missing,
                canary=c.requests,
                min_req=min_req,
            )
        )
        a.reason, a.reason_message = str(m), to_stored(m)
        return a
    failed: list[Message] = []
    if c.error_rate >= max_err:
        failed.append(
            msg(
                "rollout.error_rate_failed_baseline",
                "canary error rate {rate:.2%} ({errors}/{requests}) >= max {max_err:.2%} (baseline {base_rate:.2%})",
                rate=c.error_rate,
                errors=c.errors,
                requests=c.requests,
                max_err=max_err,
                base_rate=b.error_rate,
            )
            if with_baseline
            else msg(
                "rollout.error_rate_failed",
                "canary error rate {rate:.2%} ({errors}/{requests}) >= max {max_err:.2%}",
                rate=c.error_rate,
                errors=c.errors,
                requests=c.requests,
                max_err=max_err,
            )
        )
    delta = c.p95_ms - b.p95_ms
    if with_baseline and delta > b.p95_ms * max_inc and delta >= floor:
        failed.append(
            msg(
                "rollout.p95_failed",
                "canary p95 {p95:g} ms is {deviation:+.1%} vs baseline {base_p95:g} ms "
                "(max +{max_inc:.1%}, differences under {floor:g} ms ignored)",
                p95=c.p95_ms,
                deviation=a.p95_deviation,
                base_p95=b.p95_ms,
                max_inc=max_inc,
                floor=floor,
            )
        )
    a.verdict = Verdict.FAILED if failed else Verdict.PASSED
    if failed:
        m = msg_list("rollout.failed", "{parts}", failed, bullet="", sep="; ")
    elif with_baseline:
        m = msg(
            "rollout.passed_baseline",
            "canary error rate {rate:.2%}, p95 {p95:g} ms (baseline {base_rate:.2%}, {base_p95:g} ms)",
            rate=c.error_rate,
            p95=c.p95_ms,
            base_rate=b.error_rate,
            base_p95=b.p95_ms,
        )
    else:
        m = msg(
            "rollout.passed", "canary error rate {rate:.2%}, p95 {p95:g} ms", rate=c.error_rate, p95=c.p95_ms
        )
    a.reason, a.reason_message = str(m), to_stored(m)
    return a


def step_analysis(
    r: rollout_pb2.Rollout, stats: list[gateway_pb2.GatewayStats], now: int
) -> rollout_pb2.RolloutAnalysis:
    t = step_totals(r.workload, list(r.step_start_stats), stats)
    a = analyse(r.spec, t[""], t[CANARY], with_baseline=r.weight_pct < 100)
    a.at_unix_ms = now
    a.step = r.step
    return a


def advance(
    r: rollout_pb2.Rollout, now: int, by: str, stats: list[gateway_pb2.GatewayStats] | None = None
) -> rollout_pb2.Rollout | None:
    """The rollout's next state (pure), or None when nothing changes now. `stats`: every
    gateway's current counters, for the analysis at the end of a step."""
    if r.phase != RolloutPhase.PROGRESSING:
        return None
    new = rollout_pb2.Rollout()
    new.CopyFrom(r)
    if r.abort_requested:
        new.weight_pct = 0
        _event(
            new,
            RolloutPhase.ABORTED,
            by,
            msg("rollout.aborted", "aborted on request; canary removed, baseline untouched"),
        )
        return new
    steps = steps_of(r.spec)
    interval_ms = (r.spec.interval_s or DEFAULT_INTERVAL_S) * 1000
    reason: Message | None = None
    promoting = r.promotions_requested > r.promotions_applied
    if promoting:
        reason = msg("rollout.promoted", "promoted")
    elif r.spec.steps and now - r.step_started_at_unix_ms >= interval_ms:
        reason = msg("rollout.interval", "interval of {seconds}s elapsed", seconds=interval_ms // 1000)
    if reason is None:
        return None
    a = step_analysis(r, stats or [], now)
    new.last_analysis.CopyFrom(a)
    if a.verdict == Verdict.FAILED:
        new.weight_pct = 0
        _event(
            new,
            RolloutPhase.DEGRADED,
            by,
            msg(
                "rollout.degraded",
                "analysis failed at step {step}: {analysis}; canary removed, baseline untouched",
                step=r.step + 1,
                analysis=_analysis_reason(a),
            ),
        )
        return new
    if a.verdict == Verdict.WAITING:
        if not promoting:
            if r.reason == a.reason:
                return None
            new.reason, new.reason_message = a.reason, a.reason_message
            return new
        reason = msg(
            "rollout.incomplete",
            "{why} (analysis incomplete: {analysis})",
            why=reason,
            analysis=_analysis_reason(a),
        )
    else:
        reason = msg(
            "rollout.analysis_passed",
            "{why}, analysis passed ({analysis})",
            why=reason,
            analysis=_analysis_reason(a),
        )
    if promoting:
        new.promotions_applied = r.promotions_applied + 1
    del new.step_start_stats[:]
    new.step_start_stats.extend(stats or [])
    if r.step + 1 >= len(steps) or r.weight_pct >= 100:
        new.weight_pct = 0
        _event(
            new,
            RolloutPhase.COMPLETED,
            by,
            msg(
                "rollout.completed",
                "{why}; {model} is the workload's model now",
                why=reason,
                model=r.spec.model,
            ),
        )
        return new
    new.step = r.step + 1
    new.weight_pct = steps[new.step]
    new.step_started_at_unix_ms = now
    _event(
        new,
        RolloutPhase.PROGRESSING,
        by,
        msg(
            "rollout.next_step",
            "{why}: step {step}/{steps}, canary weight {weight_pct}%",
            why=reason,
            step=new.step + 1,
            steps=len(steps),
            weight_pct=new.weight_pct,
        ),
    )
    return new


def completed_workload(w: workload_pb2.Workload, r: rollout_pb2.Rollout, by: str) -> workload_pb2.Workload:
    """The workload after a completed rollout: the canary spec as a new generation, with why."""
    new = workload_pb2.Workload()
    new.CopyFrom(w)
    new.spec.CopyFrom(canary_spec(w, r))
    new.generation = w.generation + 1
    new.updated_by = by
    add_history(
        new,
        workload_pb2.PhaseEvent(
            phase=WorkloadChange.UPDATED,
            at_unix_ms=now_ms(),
            by=by,
            **stored_reason(
                msg(
                    "rollout.workload_updated",
                    "rollout completed: model {baseline} -> {model}; generation {generation}",
                    baseline=r.baseline_model,
                    model=r.spec.model,
                    generation=new.generation,
                )
            ),
        ),
    )
    return new


def gateway_stats(kvs: list[KV]) -> list[gateway_pb2.GatewayStats]:
    out = []
    for kv in kvs:
        g = gateway_pb2.GatewayStats()
        keys.decode_message(kv.value, g)
        out.append(g)
    return sorted(out, key=lambda g: g.gateway)


def decode_rollouts(kvs: list[KV]) -> dict[str, tuple[rollout_pb2.Rollout, KV]]:
    out: dict[str, tuple[rollout_pb2.Rollout, KV]] = {}
    for kv in kvs:
        r = rollout_pb2.Rollout()
        keys.decode_message(kv.value, r)
        out[r.workload_id] = (r, kv)
    return out


class RolloutLoop:
    def __init__(self, store: EtcdStore, replica: str) -> None:
        self.store = store
        self.by = f"rollout@{replica}"
        self.current: list[rollout_pb2.Rollout] = []  # as of the last tick (for the metrics)

    async def run(self, fence: Fence) -> None:
        # rollout-relevant changes only (and every second, for step intervals)
        await run_leader_loop(
            "rollout loop", self.store, fence, (keys.ROLLOUTS, keys.GATEWAY_STATS, keys.WORKLOADS), self.tick
        )

    async def tick(self, fence: Fence, cache: GraphCache) -> None:
        now = now_ms()
        rollouts = decode_rollouts(cache.prefix(keys.ROLLOUTS)).values()
        self.current = [r for r, _ in rollouts]
        stats = gateway_stats(cache.prefix(keys.GATEWAY_STATS)) if rollouts else []
        for r, kv in rollouts:
            new = advance(r, now, self.by, stats)
            if new is None:
                continue
            compares = [Compare.unchanged(kv.key, kv.mod_revision)]
            ops = [PutOp(kv.key, keys.encode_message(new))]
            if new.phase == RolloutPhase.COMPLETED:
                wkv = cache.get(keys.workload(r.workload_id))
                if wkv is None:
                    continue
                w = workload_pb2.Workload()
                keys.decode_message(wkv.value, w)
                compares.append(Compare.unchanged(wkv.key, wkv.mod_revision))
                ops.append(PutOp(wkv.key, keys.encode_message(completed_workload(w, r, self.by))))
            try:
                res = await fence.txn(compares, ops)
            except TemporaryError as e:
                log.warning("rollout commit failed; will retry", workload=r.workload, error=str(e))
                continue
            if res.succeeded:
                log.info(
                    "rollout", workload=r.workload, phase=new.phase, weight=new.weight_pct, why=new.reason
                )
