"""Layer 4, mixed chips: an int8 test workload that prefers [cambricon, ascend] lands on cambricon
(one instance per free cambricon card, so a broken preference would spill onto ascend), none of its
instances on ascend, and telemetry filtered by `device_type==cambricon` shows its load."""

from __future__ import annotations

from controlplane.cli.client import CliError
from controlplane.cli.verify.api import Api, running, test_workload
from controlplane.cli.verify.common import (
    Options,
    busy_threshold,
    foreign_holders,
    held_by,
    metrics_evidence,
    pct,
    workload_evidence,
)
from controlplane.cli.verify.deploy import deploy, running_since
from controlplane.cli.verify.load import MIN_BURST_S, run_burst
from controlplane.cli.verify.model import LayerResult, evidence
from controlplane.cli.verify.sampler import sampled_burst
from kunlun_common.i18n import _
from kunlun_common.messages import msg
from kunlun_common.names import parse_device_name

PREFERRED = ["cambricon", "ascend"]
FILTER = "device_type==cambricon"


def run(api: Api, opts: Options) -> LayerResult:
    r = LayerResult(4, "Mixed chips")
    rows = api.metrics()
    cambricon = sorted(m.device for m in rows if m.device_type == "cambricon" and m.status == "Ready")
    if not cambricon or not any(m.device_type == "ascend" for m in rows):
        raise CliError(_("layer 4 needs Ready cambricon cards and ascend cards in the cluster"))
    held = foreign_holders(api, cambricon)
    if held and not opts.allow_busy:
        r.add(
            "the cambricon cards are free",
            held_by(held),
            busy_threshold(),
            False,
            metrics_evidence(api.metrics(FILTER), FILTER),
            note="refused: verify does not load cards that serve other workloads",
        )
        return r
    free = [c for c in cambricon if c not in held]
    spec = test_workload(
        api.name("l4"), replicas=len(free), quantization="int8", preferred_device_types=PREFERRED
    )
    d = deploy(api, spec, opts.ready_timeout_s)
    placed = sorted(dev for i in d.summary.instances for dev in i.target_devices)
    types = [parse_device_name(dev).device_type for dev in placed]
    wev = workload_evidence(d.summary)
    r.add(
        "the int8 workload lands on cambricon",
        msg(
            "verify.l4.on_cambricon",
            "{count} of {replicas} instances on cambricon ({placed})",
            count=types.count("cambricon"),
            replicas=spec.replicas,
            placed=", ".join(placed),
        ),
        msg(
            "verify.l4.on_cambricon_threshold",
            "{replicas} of {replicas} (preferred_device_types {preferred})",
            replicas=spec.replicas,
            preferred=str(PREFERRED),
        ),
        types.count("cambricon") == spec.replicas,
        wev,
    )
    r.add(
        "none of its instances on ascend",
        msg("verify.l4.on_ascend", "{count} on ascend", count=types.count("ascend")),
        "0",
        types.count("ascend") == 0,
        wev,
    )
    n = max(1, opts.requests // 2)
    served = [dev for i in running(d.summary) for dev in i.target_devices]
    sb = sampled_burst(
        api,
        served,
        lambda: run_burst(
            d.gateway,
            spec.name,
            n,
            min(opts.concurrency, 8),
            opts.burst_timeout_s,
            api_key=d.api_key,
            min_duration_s=MIN_BURST_S,
        ),
        flt=FILTER,
        not_before_ms=running_since(d.summary),
    )
    b, sampler = sb.result, sb.sampler
    r.utilization, r.marks, r.latencies_ms = list(sampler.series.values()), sampler.marks, b.latencies_ms
    shown = [dev for dev in served if sb.peak(dev) > sb.before[dev]]
    peak_rows = {dev: max(sb.window(dev), default=0.0) for dev in served}
    mine = [m for m in sampler.busiest if m.workload == spec.name]
    r.add(
        "telemetry device_type==cambricon shows the load",
        msg(
            "verify.l4.load",
            "{count} of {total} cards busier during the burst ({cards}); {rows} rows of the filter name the workload",
            count=len(shown),
            total=len(served),
            cards=", ".join(f"{dev} {pct(sb.before[dev])} -> {pct(peak_rows[dev])}" for dev in served),
            rows=len(mine),
        ),
        msg(
            "verify.l4.load_threshold",
            "{total} of {total} busier, every card of the workload in the filtered view",
            total=len(served),
        ),
        len(shown) == len(served) and len(mine) == len(served) and b.ok == b.sent,
        metrics_evidence(sampler.busiest, FILTER),
        evidence(f"POST http://{d.gateway}/v1/chat/completions x{n}", b.summary()),  # the command as is
    )
    return r
