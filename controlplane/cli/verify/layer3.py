"""Layer 3, several cards and load balance: one test instance per free card of one type on a node, a
bounded burst through a gateway (like `wrk -c 32 -n 1000`), the spread of the cards' utilization
during it, and no OOM, timeout, failed request or engine restart."""

from __future__ import annotations

import statistics
from collections import Counter

from controlplane.cli.client import CliError
from controlplane.cli.verify.api import Api, running, test_workload
from controlplane.cli.verify.common import (
    Options,
    burst_command,
    busy_threshold,
    foreign_holders,
    held_by,
    metrics_evidence,
    pct,
    text_table,
    workload_evidence,
)
from controlplane.cli.verify.deploy import deploy, running_since
from controlplane.cli.verify.load import MIN_BURST_S, run_burst
from controlplane.cli.verify.model import LayerResult, evidence
from controlplane.cli.verify.sampler import sampled_burst
from controlplane.cli.views import reason_of
from kunlun_common.i18n import _
from kunlun_common.messages import msg, msg_list

STDDEV_LIMIT_PCT = 15.0


def choose_cards(api: Api, opts: Options) -> tuple[str, str, list[str]]:
    """(node, device type, its Ready cards): `--node`, else the node with most Ready cards of a type."""
    rows = [m for m in api.metrics() if m.status == "Ready"]
    groups: Counter[tuple[str, str]] = Counter((m.node, m.device_type) for m in rows)
    if opts.node:
        groups = Counter({k: v for k, v in groups.items() if k[0] == opts.node})
        if not groups:
            raise CliError(
                _("--node {node}: no Ready card on that node (`kunlun-cli device list`)").format(
                    node=opts.node
                )
            )
    if not groups:
        raise CliError(_("no Ready card in the cluster (`kunlun-cli device list`)"))
    (node, dtype), _count = max(groups.items(), key=lambda kv: (kv[1], kv[0][0] == opts.node, kv[0]))
    cards = sorted(m.device for m in rows if m.node == node and m.device_type == dtype)
    return node, dtype, cards


def run(api: Api, opts: Options) -> LayerResult:
    r = LayerResult(3, "Several cards and load balance")
    node, dtype, cards = choose_cards(api, opts)
    held = foreign_holders(api, cards)
    if held and not opts.allow_busy:
        r.add(
            "the node's cards are free",
            held_by(held),
            busy_threshold(),
            False,
            metrics_evidence(
                api.metrics(f"node=={node},device_type=={dtype}"), f"node=={node},device_type=={dtype}"
            ),
            note="refused: verify does not load cards that serve other workloads",
        )
        return r
    cards = [c for c in cards if c not in held]
    if len(cards) < 2:
        raise CliError(
            _("{node} has {count} free Ready {dtype} card(s); layer 3 needs at least 2").format(
                node=node, count=len(cards), dtype=dtype
            )
        )
    spec = test_workload(api.name("l3"), replicas=len(cards), preferred_device_types=[dtype])
    d = deploy(api, spec, opts.ready_timeout_s)
    placed = sorted(dev for i in running(d.summary) for dev in i.target_devices)
    wev = workload_evidence(d.summary)
    on_node = [dev for dev in placed if dev in cards]
    r.add(
        "instances on the node's cards",
        msg(
            "verify.l3.placed",
            "{count} of {total} instances on {node}'s {dtype} cards ({placed})",
            count=len(on_node),
            total=len(cards),
            node=node,
            dtype=dtype,
            placed=", ".join(placed),
        ),
        msg("verify.l3.placed_threshold", "{total} of {total}, one per card", total=len(cards)),
        on_node == cards,
        wev,
    )
    restarts_before = {i.id: i.restarts for i in d.summary.instances}
    sb = sampled_burst(
        api,
        placed,
        lambda: run_burst(
            d.gateway,
            spec.name,
            opts.requests,
            opts.concurrency,
            opts.burst_timeout_s,
            api_key=d.api_key,
            min_duration_s=MIN_BURST_S,
        ),
        not_before_ms=running_since(d.summary),
    )
    b, sampler = sb.result, sb.sampler
    r.utilization, r.marks, r.latencies_ms = list(sampler.series.values()), sampler.marks, b.latencies_ms
    means = {dev: statistics.fmean(sb.window(dev)) if sb.window(dev) else 0.0 for dev in placed}
    sd = statistics.pstdev(means.values()) if len(means) > 1 else 0.0
    table = text_table(
        ["CARD", "BEFORE", "MEAN (BURST START TO END + 5 s)", "PEAK", "SAMPLES"],
        [
            (dev, pct(sb.before[dev]), pct(means[dev]), pct(sb.peak(dev)), len(sb.window(dev)))
            for dev in placed
        ],
    )
    r.add(
        "utilization standard deviation across the cards",
        msg(
            "verify.l3.stddev",
            "{sd:.1f} points (means {means} %)",
            sd=sd,
            means=", ".join(f"{m:.0f}" for m in means.values()),
        ),
        msg(
            "verify.l3.stddev_threshold",
            "< {limit:.0f} points, every card busier than before the burst",
            limit=STDDEV_LIMIT_PCT,
        ),
        sd < STDDEV_LIMIT_PCT and bool(means) and all(sb.peak(dev) > sb.before[dev] for dev in placed),
        evidence(
            msg(
                "verify.ev.watch",
                "kunlun-cli telemetry metrics --watch (sampled every 0.5 s during the burst)",
            ),
            table,
        ),
        metrics_evidence(sampler.busiest, sampler.flt),
    )
    after = api.workload(spec.name)
    restarted = [
        msg(
            "verify.l3.restarts",
            "{id}: {count} restarts",
            id=i.id,
            count=i.restarts - restarts_before.get(i.id, 0),
        )
        for i in after.instances
        if i.restarts != restarts_before.get(i.id, 0)
    ]
    oom = [
        msg("verify.l3.oom", "{id}: {reason}", id=i.id, reason=reason_of(i))
        for i in after.instances
        if "oom" in i.reason.lower() or "memory" in i.reason.lower()
    ]
    not_running = [
        msg("verify.l3.not_running", "{id} {phase}", id=i.id, phase=i.phase)
        for i in after.instances
        if i.phase != "Running"
    ]
    problems = restarted + oom + not_running
    r.add(
        "burst answered without OOM or timeout",
        msg(
            "verify.l3.burst",
            "{ok}/{sent} answered 200, {timeouts} timeouts, {not_sent} not sent; {problems}",
            ok=b.ok,
            sent=b.sent,
            timeouts=b.timeouts,
            not_sent=b.not_sent,
            problems=(
                msg_list("verify.l3.problems", "{parts}", problems, bullet="", sep="; ")
                if problems
                else msg("verify.l3.no_problems", "no instance restarted or OOM-killed")
            ),
        ),
        msg(
            "verify.l3.burst_threshold",
            "{requests}/{requests} answered 200, 0 timeouts, no restart or OOM",
            requests=opts.requests,
        ),
        b.ok == opts.requests and not problems,
        evidence(burst_command(d.gateway, opts.requests, opts.concurrency), b.report()),
        workload_evidence(after),
    )
    return r
