"""A workload's rollout goal state (`rollouts/<workload id>`), API side: validation and the records.

Create writes the whole record (phase Progressing at the first step, with the gateways' counters
at that moment, the start of the first step's analysis); promote and abort only record the request
(a counter, a flag) with a compare-and-set. The leader's rollout loop (`controlplane/rollout.py`)
does the rest with fenced writes.
"""

from __future__ import annotations

from controlplane import keys
from controlplane.rollout import gateway_stats, steps_of
from controlplane.store import KV, Compare, EtcdStore, PutOp
from controlplane.workloads import records
from kunlun_common.api import rollout_pb2, workload_pb2
from kunlun_common.clock import now_ms
from kunlun_common.errors import ConcurrentChange, InvalidInput, NotFoundError, PermanentError
from kunlun_common.messages import Message, msg, msg_list, stored_reason
from kunlun_common.states import RolloutPhase

MAX_CAS_ATTEMPTS = 5


def spec_problems(spec: rollout_pb2.RolloutSpec) -> list[Message]:
    """Every problem of a rollout spec, one per field ('field: what is wrong')."""
    p = []
    if not spec.model:
        p.append(msg("rollout.model_required", "model: required"))
    if not 1 <= spec.canary_pct <= 100:
        p.append(
            msg(
                "rollout.canary_expected_percent_found",
                "canary: expected 1..100 percent, found {canary_pct}",
                canary_pct=spec.canary_pct,
            )
        )
    steps = list(spec.steps)
    if steps and (any(not 1 <= s <= 100 for s in steps) or steps != sorted(set(steps)) or steps[-1] != 100):
        p.append(
            msg(
                "rollout.steps_expected_ascending_percents",
                "steps: expected ascending percents in 1..100 ending with 100, found {steps}",
                steps=steps,
            )
        )
    if spec.interval_s < 0:
        p.append(
            msg(
                "rollout.interval_expected_seconds_found",
                "interval: expected >= 0 seconds, found {interval_s}",
                interval_s=spec.interval_s,
            )
        )
    if spec.HasField("max_error_rate") and not 0 <= spec.max_error_rate <= 1:
        p.append(
            msg(
                "rollout.max_error_rate_expected",
                "max_error_rate: expected a fraction in 0..1, found {max_error_rate:g}",
                max_error_rate=spec.max_error_rate,
            )
        )
    if spec.HasField("max_p95_increase") and spec.max_p95_increase < 0:
        p.append(
            msg(
                "rollout.max_p_increase_expected",
                "max_p95_increase: expected a fraction >= 0, found {max_p95_increase:g}",
                max_p95_increase=spec.max_p95_increase,
            )
        )
    if spec.HasField("min_p95_delta_ms") and spec.min_p95_delta_ms < 0:
        p.append(
            msg(
                "rollout.min_p_delta_ms",
                "min_p95_delta_ms: expected >= 0, found {min_p95_delta_ms:g}",
                min_p95_delta_ms=spec.min_p95_delta_ms,
            )
        )
    if spec.HasField("min_requests") and spec.min_requests < 0:
        p.append(
            msg(
                "rollout.min_requests_expected_found",
                "min_requests: expected >= 0, found {min_requests}",
                min_requests=spec.min_requests,
            )
        )
    return p


def decode_rollout(kv: KV) -> rollout_pb2.Rollout:
    r = rollout_pb2.Rollout()
    keys.decode_message(kv.value, r)
    return r


async def get(store: EtcdStore, name: str) -> tuple[workload_pb2.Workload, rollout_pb2.Rollout, KV]:
    """The workload named `name` (or with that id) and its rollout; NotFoundError if either is missing."""
    w, _ = await records.resolve(store, name)
    kv = await store.get(keys.rollout(w.id))
    if kv is None:
        raise NotFoundError(msg("rollout.none", "workload {name!r} has no rollout", name=name))
    return w, decode_rollout(kv), kv


async def list_all(store: EtcdStore) -> list[rollout_pb2.Rollout]:
    kvs, _ = await store.get_prefix(keys.ROLLOUTS)
    return sorted((decode_rollout(kv) for kv in kvs), key=lambda r: r.workload)


async def create(store: EtcdStore, spec: rollout_pb2.RolloutSpec, who: str) -> rollout_pb2.Rollout:
    """Start a rollout of `spec.workload` to `spec.model` (refused while one is in progress)."""
    problems = spec_problems(spec)
    if problems:
        raise InvalidInput(msg_list("rollout.invalid", "{parts}", problems, bullet="", sep="; "))
    w, _ = await records.resolve(store, spec.workload)
    old = await store.get(keys.rollout(w.id))
    stats_kvs, _ = await store.get_prefix(keys.GATEWAY_STATS)
    if old is not None and decode_rollout(old).phase == RolloutPhase.PROGRESSING:
        raise PermanentError(
            msg(
                "rollout.in_progress",
                "workload {name!r} already has a rollout in progress; promote or abort it",
                name=w.spec.name,
            )
        )
    if spec.model == w.spec.model:
        raise InvalidInput(
            msg("rollout.same_model", "model: the workload already serves {model}", model=spec.model)
        )
    at = now_ms()
    r = rollout_pb2.Rollout(
        workload_id=w.id,
        workload=w.spec.name,
        spec=spec,
        baseline_model=w.spec.model,
        phase=RolloutPhase.PROGRESSING,
        step=0,
        weight_pct=steps_of(spec)[0],
        step_started_at_unix_ms=at,
        created_by=who,
        created_at_unix_ms=at,
        history=[
            workload_pb2.PhaseEvent(
                phase=RolloutPhase.PROGRESSING,
                at_unix_ms=at,
                by=who,
                **stored_reason(msg("rollout.created", "created")),
            )
        ],
        step_start_stats=gateway_stats(stats_kvs),
    )
    r.spec.workload = w.spec.name
    cmp = Compare.unchanged(old.key, old.mod_revision) if old else Compare.absent(keys.rollout(w.id))
    res = await store.txn([cmp], [PutOp(keys.rollout(w.id), keys.encode_message(r))])
    if not res.succeeded:
        raise ConcurrentChange(msg("rollout.concurrent", "the rollout changed concurrently; retry"))
    return r


async def request(store: EtcdStore, name: str, *, promote: bool) -> rollout_pb2.Rollout:
    """Record a promote (one more step) or abort request on a rollout in progress."""
    for _ in range(MAX_CAS_ATTEMPTS):
        _, r, kv = await get(store, name)
        if r.phase != RolloutPhase.PROGRESSING:
            raise PermanentError(msg("rollout.phase", "the rollout is {phase}", phase=r.phase))
        if promote:
            r.promotions_requested += 1
        else:
            r.abort_requested = True
        res = await store.txn(
            [Compare.unchanged(kv.key, kv.mod_revision)], [PutOp(kv.key, keys.encode_message(r))]
        )
        if res.succeeded:
            return r
    raise ConcurrentChange(msg("rollout.concurrent", "the rollout changed concurrently; retry"))
