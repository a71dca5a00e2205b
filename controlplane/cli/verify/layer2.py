"""Layer 2, one model on one card: a test workload pinned to one free card; its preparation time and
first-token latency; the card's utilization peak during a burst; the platform's utilization against
the vendor tool's own reading taken at the same moment."""

from __future__ import annotations

import time
from dataclasses import dataclass

from controlplane.cli.client import CliError
from controlplane.cli.verify.api import Api, test_workload
from controlplane.cli.verify.common import (
    Options,
    burst_command,
    busy_threshold,
    foreign_holders,
    free_ready,
    metrics_evidence,
    pct,
    text_table,
    tool_command,
    workload_evidence,
)
from controlplane.cli.verify.deploy import deploy, running_since
from controlplane.cli.verify.load import MIN_BURST_S, quantile, run_burst
from controlplane.cli.verify.model import Evidence, LayerResult, evidence
from controlplane.cli.verify.sampler import Sampler, sampled_burst
from kunlun_common.i18n import _, error_text
from kunlun_common.messages import msg
from kunlun_common.names import parse_device_name

PREPARE_LIMIT_S = 60.0
FIRST_TOKEN_LIMIT_MS = 500.0
TOOL_AGREEMENT_PCT = 10.0
"""Platform and vendor tool utilization may differ by this many points (samples are up to a health
interval apart)."""
MATCH_S = 2.0
"""A tool reading and a platform sample at most this far apart are of the same moment."""
MAX_PAIRS = 6
"""Tool readings taken at most (half during the burst, the rest after it until one agrees)."""
SETTLE_S = 3.0
"""Seconds sampled before and after a burst (telemetry arrives a heartbeat later)."""


def choose_device(api: Api, opts: Options, r: LayerResult) -> str | None:
    """The card for the layer, or None after adding the failed checkpoint that says why."""
    if opts.device:
        try:
            parse_device_name(opts.device)
        except ValueError as e:
            raise CliError(_("--device: {e}").format(e=error_text(e))) from None
        held = foreign_holders(api, [opts.device])
        if held and not opts.allow_busy:
            r.add(
                "the card is free",
                msg(
                    "verify.l2.held",
                    "{device} held by workload {workload}",
                    device=opts.device,
                    workload=held[opts.device],
                ),
                busy_threshold(),
                False,
                metrics_evidence(api.metrics(f"device=={opts.device}"), f"device=={opts.device}"),
                note="refused: verify does not load cards that serve other workloads",
            )
            return None
        return opts.device
    free = free_ready(api)
    if not free:
        r.add(
            "a free Ready card",
            msg("verify.none", "none"),
            msg("verify.l2.free_threshold", ">= 1 Ready card held by no workload"),
            False,
            metrics_evidence(api.metrics(), ""),
            note="refused: every Ready card serves a workload this run did not create",
        )
        return None
    return free[0].device


@dataclass
class Pair:
    """The vendor tool's reading of a card and the platform's sample of about the same moment."""

    tool: float
    platform: float
    gap_s: float
    """Seconds between the two samples (the platform's agent samples on its own cadence)."""
    evidence: list[Evidence]

    @property
    def matched(self) -> bool:
        return self.tool >= 0 and self.platform >= 0 and abs(self.gap_s) <= MATCH_S


def compare_with_tool(api: Api, device: str) -> Pair:
    """Run the tool on the card's node now, then take the platform's first sample of that moment."""
    name = parse_device_name(device)
    reading = api.tool_reading(name.node)
    tool, tool_at, evs = -1.0, 0, []
    for rd in reading.readings:
        if rd.device_type != name.device_type:
            continue
        tool = next((td.utilization_pct for td in rd.devices if td.name == device), -1.0)
        tool_at = rd.sampled_at_unix_ms
        evs.append(
            evidence(tool_command(list(rd.command), name.node), rd.raw_output if not rd.error else rd.error)
        )
    flt = f"device=={device}"
    deadline = time.monotonic() + 2 * MATCH_S
    while True:  # the platform's sample taken after the tool's, or the newest one within the wait
        rows = api.metrics(flt)
        at = rows[0].sampled_at_unix_ms if rows else 0
        if not tool_at or at >= tool_at or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    platform = rows[0].utilization * 100 if rows and at else -1.0
    gap = (at - tool_at) / 1000 if at and tool_at else float("inf")
    return Pair(tool, platform, gap, [metrics_evidence(rows, flt), *evs])


def _pairs_table(pairs: list[Pair]) -> Evidence:
    return evidence(
        msg(
            "verify.ev.pairs",
            "kunlun-cli verify (vendor tool reading, then the platform's sample of that moment)",
        ),
        text_table(
            ["TOOL", "PLATFORM", "GAP", "MATCHED"],
            [(pct(p.tool), pct(p.platform), f"{p.gap_s:.1f} s", "yes" if p.matched else "no") for p in pairs],
        ),
    )


def _agree(p: Pair) -> bool:
    return abs(p.platform - p.tool) <= TOOL_AGREEMENT_PCT


def run(api: Api, opts: Options) -> LayerResult:
    r = LayerResult(2, "One model on one card")
    device = choose_device(api, opts, r)
    if device is None:
        return r
    dev = parse_device_name(device)
    spec = test_workload(api.name("l2"), pin=device, preferred_device_types=[dev.device_type])
    d = deploy(api, spec, opts.ready_timeout_s)
    inst = d.summary.instances[0]
    wev = workload_evidence(d.summary)
    r.add(
        "the test workload runs on the card",
        ", ".join(inst.target_devices),
        f"== {device}",
        list(inst.target_devices) == [device],
        wev,
    )
    r.add(
        "preparation time",
        f"{inst.prepare_seconds:.2f} s",
        f"< {PREPARE_LIMIT_S:.0f} s",  # a figure and its unit: nothing to translate
        0 < inst.prepare_seconds < PREPARE_LIMIT_S,
        wev,
    )
    stream = run_burst(d.gateway, spec.name, 5, 1, 30.0, api_key=d.api_key, stream=True)
    client_ttft = quantile(stream.first_piece_ms, 0.5)
    ttft = inst.first_token_ms
    r.add(
        "first-token latency",
        msg(
            "verify.l2.first_token",
            "{ttft:.1f} ms (the agent's probe); {client_ttft:.1f} ms p50 of 5 streamed requests through the gateway",
            ttft=ttft,
            client_ttft=client_ttft,
        ),
        f"< {FIRST_TOKEN_LIMIT_MS:.0f} ms",
        0 < ttft < FIRST_TOKEN_LIMIT_MS and stream.ok == 5 and client_ttft < FIRST_TOKEN_LIMIT_MS,
        wev,
        evidence(
            msg(
                "verify.ev.stream", "POST http://{gateway}/v1/chat/completions (stream) x5", gateway=d.gateway
            ),
            stream.summary(),
        ),
    )
    n = max(1, opts.requests // 5)
    pairs: list[Pair] = []

    def under_load(sampler: Sampler) -> None:
        time.sleep(1.0)
        while len(pairs) < MAX_PAIRS // 2 and sampler.now() < sampler.marks[-1][0] + 30:
            pairs.append(compare_with_tool(api, device))

    sb = sampled_burst(
        api,
        [device],
        lambda: run_burst(
            d.gateway,
            spec.name,
            n,
            min(opts.concurrency, 8),
            opts.burst_timeout_s,
            api_key=d.api_key,
            min_duration_s=MIN_BURST_S,
        ),
        during=under_load,
        not_before_ms=running_since(d.summary),
    )
    while len(pairs) < MAX_PAIRS and not any(p.matched and _agree(p) for p in pairs):
        pairs.append(compare_with_tool(api, device))
    b, sampler = sb.result, sb.sampler
    r.utilization, r.marks, r.latencies_ms = list(sampler.series.values()), sampler.marks, b.latencies_ms
    before, peak = sb.before[device], sb.peak(device)
    r.add(
        "utilization peak during the burst",
        msg(
            "verify.l2.peak",
            "{peak} (before the burst {before}); burst: {burst}",
            peak=pct(peak),
            before=pct(before),
            burst=b.summary(),
        ),
        msg("verify.l2.peak_threshold", "> the level before the burst, every request answered 200"),
        peak > before and b.ok == b.sent and b.not_sent == 0,
        evidence(burst_command(d.gateway, n, min(opts.concurrency, 8)), b.report(always_newline=True)),
        metrics_evidence(sampler.busiest, sampler.flt),
    )
    matched = [p for p in pairs if p.matched]
    best = min(matched, key=lambda p: abs(p.platform - p.tool), default=None)
    r.add(
        "platform utilization vs the vendor tool",
        (
            msg(
                "verify.l2.agreement",
                "platform {platform}, tool {tool} ({gap_s:.1f} s apart; {matched} of {tried} readings matched in time)",
                platform=pct(best.platform),
                tool=pct(best.tool),
                gap_s=best.gap_s,
                matched=len(matched),
                tried=len(pairs),
            )
            if best
            else msg(
                "verify.l2.no_match",
                "no platform sample within {match_s:.0f} s of a tool reading ({tried} tried)",
                match_s=MATCH_S,
                tried=len(pairs),
            )
        ),
        msg("verify.l2.agreement_threshold", "within {points:.0f} points", points=TOOL_AGREEMENT_PCT),
        best is not None and _agree(best),
        _pairs_table(pairs),
        *(best or (pairs[-1] if pairs else Pair(-1, -1, 0, []))).evidence,
    )
    return r
