"""`kunlun-cli rollout create|promote|abort|status|list` — canary rollouts of a workload."""

from __future__ import annotations

import argparse
import re
import time
from typing import Any

from controlplane.cli.client import CliError
from controlplane.cli.output import print_json, print_table
from controlplane.cli.views import shown_reason
from kunlun_common.api import rollout_pb2, rollout_pb2_grpc
from kunlun_common.i18n import _
from kunlun_common.states import RolloutPhase


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    r = sub.add_parser(
        "rollout", help="canary rollouts of a workload to a new model version", parents=[common]
    )
    rs = r.add_subparsers(dest="cmd", required=True)
    c = rs.add_parser(
        "create",
        help="start canary instances of a new model and send them a share of traffic",
        parents=[common],
    )
    c.add_argument("workload")
    c.add_argument("--model", required=True, help="the new model (path or name)")
    c.add_argument(
        "--engine-args", default="", help="extra engine arguments for the new version (one string)"
    )
    c.add_argument("--canary", default="10%", help="first traffic share, e.g. 10%% (default)")
    c.add_argument(
        "--steps", default="", help="automatic steps, e.g. 10,25,50,100 (without: promote by hand)"
    )
    c.add_argument("--interval", default="2m", help="time per step with --steps, e.g. 30s, 2m (default 2m)")
    c.add_argument(
        "--max-error-rate",
        type=float,
        default=None,
        help="the canary fails when its error rate (fraction) reaches this (default 0.001)",
    )
    c.add_argument(
        "--max-p95-increase",
        type=float,
        default=None,
        help="the canary fails when its p95 latency exceeds the baseline's by more than this "
        "fraction (default 0.05)",
    )
    c.add_argument(
        "--min-p95-delta-ms",
        type=float,
        default=None,
        help="p95 differences below this many ms never fail the canary (default 20)",
    )
    c.add_argument(
        "--min-requests",
        type=int,
        default=None,
        help="requests each version needs in a step before it is analysed (default 50)",
    )
    c.set_defaults(handler=create)
    for name, helptext, fn in (
        ("promote", "move to the next step (or to 100%%)", promote),
        ("abort", "stop the canary: weight 0, canary instances removed, baseline untouched", abort),
        ("status", "step, weights, phase, reason and the last canary analysis", status),
    ):
        p = rs.add_parser(name, help=helptext, parents=[common])
        p.add_argument("workload")
        if name == "status":
            p.add_argument(
                "--live",
                action="store_true",
                help="also analyse the current step now, with the gateways' counters so far",
            )
        p.set_defaults(handler=fn)
    ls = rs.add_parser("list", help="every rollout", parents=[common])
    ls.set_defaults(handler=list_rollouts)


def _pct(text: str, what: str) -> int:
    m = re.fullmatch(r"\s*(\d{1,3})\s*%?\s*", text)
    if not m or not 0 < int(m[1]) <= 100:
        raise CliError(
            _("{what}: expected a share like 10% (1..100), found {text!r}").format(what=what, text=text)
        )
    return int(m[1])


def _seconds(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*(s|m|h)?\s*", text)
    if not m:
        raise CliError(
            _("--interval: expected a duration like 30s, 2m or 1h, found {text!r}").format(text=text)
        )
    return int(m[1]) * {"s": 1, "m": 60, "h": 3600, None: 1}[m[2]]


def _call(args: argparse.Namespace, method: str, req: Any) -> Any:
    from controlplane.cli.main import make_client

    client = make_client(args)
    return client.call_stub(rollout_pb2_grpc.RolloutServiceStub, lambda s: getattr(s, method), req)


def rollout_json(r: rollout_pb2.Rollout) -> dict[str, Any]:
    return {
        "workload": r.workload,
        "workload_id": r.workload_id,
        "phase": r.phase,
        "step": r.step,
        "steps": list(r.spec.steps),
        "canary_weight_pct": r.weight_pct,
        "baseline_weight_pct": 100 - r.weight_pct,
        "baseline_model": r.baseline_model,
        "canary_model": r.spec.model,
        "interval_s": r.spec.interval_s,
        "thresholds": {
            "max_error_rate": r.spec.max_error_rate if r.spec.HasField("max_error_rate") else None,
            "max_p95_increase": r.spec.max_p95_increase if r.spec.HasField("max_p95_increase") else None,
            "min_p95_delta_ms": r.spec.min_p95_delta_ms if r.spec.HasField("min_p95_delta_ms") else None,
            "min_requests": r.spec.min_requests if r.spec.HasField("min_requests") else None,
        },
        "analysis": analysis_json(r.last_analysis) if r.HasField("last_analysis") else None,
        "live_analysis": analysis_json(r.live_analysis) if r.HasField("live_analysis") else None,
        "reason": r.reason,
        "created_by": r.created_by,
        "created_at_unix_ms": r.created_at_unix_ms,
        "history": [
            {"phase": h.phase, "at_unix_ms": h.at_unix_ms, "by": h.by, "reason": h.reason} for h in r.history
        ],
    }


def analysis_json(a: rollout_pb2.RolloutAnalysis) -> dict[str, Any]:
    def version(v: rollout_pb2.VersionStats) -> dict[str, Any]:
        return {
            "requests": v.requests,
            "errors": v.errors,
            "error_rate": v.error_rate,
            "p50_ms": v.p50_ms,
            "p95_ms": v.p95_ms,
        }

    return {
        "at_unix_ms": a.at_unix_ms,
        "step": a.step,
        "baseline": version(a.baseline),
        "canary": version(a.canary),
        "p95_deviation": a.p95_deviation,
        "verdict": a.verdict,
        "reason": a.reason,
    }


def _show(args: argparse.Namespace, r: rollout_pb2.Rollout, verb: str) -> int:
    if args.output == "json":
        print_json(rollout_json(r))
    else:
        print(
            _("rollout of {workload} {verb}: {phase}, canary {model} at {weight_pct}%").format(
                workload=r.workload, verb=verb, phase=r.phase, model=r.spec.model, weight_pct=r.weight_pct
            )
        )
    return 0


def create(args: argparse.Namespace) -> int:
    first = _pct(args.canary, "--canary")
    steps = [_pct(s, "--steps") for s in args.steps.split(",") if s.strip()] if args.steps else []
    spec = rollout_pb2.RolloutSpec(
        workload=args.workload,
        model=args.model,
        engine_args=args.engine_args.split() if args.engine_args else [],
        steps=steps,
        interval_s=_seconds(args.interval),
        canary_pct=first,
    )
    for field in ("max_error_rate", "max_p95_increase", "min_p95_delta_ms", "min_requests"):
        value = getattr(args, field)
        if value is not None:
            setattr(spec, field, value)
    return _show(
        args, _call(args, "CreateRollout", rollout_pb2.CreateRolloutRequest(spec=spec)), _("created")
    )


def promote(args: argparse.Namespace) -> int:
    return _show(
        args,
        _call(args, "PromoteRollout", rollout_pb2.RolloutRequest(workload=args.workload)),
        _("promotion requested"),
    )


def abort(args: argparse.Namespace) -> int:
    return _show(
        args,
        _call(args, "AbortRollout", rollout_pb2.RolloutRequest(workload=args.workload)),
        _("abort requested"),
    )


def status(args: argparse.Namespace) -> int:
    r = _call(
        args,
        "GetRollout",
        rollout_pb2.RolloutRequest(workload=args.workload, live_analysis=getattr(args, "live", False)),
    )
    d = rollout_json(r)
    if args.output == "json":
        print_json(d)
        return 0
    print(
        _("Workload:  {workload}\nPhase:     {phase}  {reason}").format(
            workload=d["workload"], phase=d["phase"], reason=shown_reason(r)
        )
    )
    if d["phase"] == RolloutPhase.COMPLETED:
        print(
            _("Weights:   {canary_model} 100% (the workload's model now; {baseline_model} is gone)").format(
                canary_model=d["canary_model"], baseline_model=d["baseline_model"]
            )
        )
    else:
        print(
            _(
                "Weights:   baseline {baseline_model} {baseline_weight_pct}%  /  canary {canary_model} {canary_weight_pct}%"
            ).format(
                baseline_model=d["baseline_model"],
                baseline_weight_pct=d["baseline_weight_pct"],
                canary_model=d["canary_model"],
                canary_weight_pct=d["canary_weight_pct"],
            )
        )
    print(_("Step:      {step} of {value}").format(step=d["step"], value=d["steps"] or _("manual (promote)")))
    if d["analysis"] is not None:
        a = d["analysis"]
        print(
            _("Analysis:  {verdict} (step {value})  {reason}").format(
                verdict=a["verdict"], value=a["step"] + 1, reason=shown_reason(r.last_analysis)
            )
        )
        _print_analysis(a)
    if d["live_analysis"] is not None:
        a = d["live_analysis"]
        print(
            _("Live:      {verdict} (step {value})  {reason}").format(
                verdict=a["verdict"], value=a["step"] + 1, reason=shown_reason(r.live_analysis)
            )
        )
        _print_analysis(a)
    for h, event in zip(d["history"], r.history, strict=True):
        at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h["at_unix_ms"] / 1000))
        print(
            "  "
            + _("{at}  {phase:<12} by {by}  {reason}").format(
                at=at, phase=h["phase"], by=h["by"], reason=shown_reason(event)
            )
        )
    return 0


def _print_analysis(a: dict[str, Any]) -> None:
    """The per-version table of one analysis."""
    rows = []
    for name in ("baseline", "canary"):
        v = a[name]
        dev = f"{a['p95_deviation']:+.1%}" if name == "canary" and a["baseline"]["p95_ms"] else "-"
        rows.append(
            [
                name,
                v["requests"],
                f"{v['error_rate']:.2%} ({v['errors']})",
                f"{v['p50_ms']:g} ms",
                f"{v['p95_ms']:g} ms",
                dev,
            ]
        )
    print_table(["VERSION", "REQUESTS", "ERROR RATE", "P50", "P95", "P95 VS BASELINE"], rows)


def list_rollouts(args: argparse.Namespace) -> int:
    from controlplane.cli.main import make_client

    found = make_client(args).pages(
        rollout_pb2_grpc.RolloutServiceStub,
        lambda s: s.ListRollouts,
        rollout_pb2.ListRolloutsRequest(),
        "rollouts",
    )
    found.sort(key=lambda r: r.workload)
    items = [rollout_json(r) for r in found]
    if args.output == "json":
        print_json({"items": items})
    else:
        print_table(
            ["WORKLOAD", "PHASE", "CANARY", "WEIGHT", "STEP"],
            [
                [i["workload"], i["phase"], i["canary_model"], f"{i['canary_weight_pct']}%", i["step"]]
                for i in items
            ],
        )
    return 0
