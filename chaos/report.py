"""The report of a chaos run: report.json (everything), report.md (the tables) and timeline.png
(faults, leader changes, error rate and instance counts over time)."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from chaos.checkers import Verdict, faults_active, longest_gap, serving_errors
from chaos.history import FAILED, OK, UNKNOWN, RunHistory


def api_errors(h: RunHistory) -> dict[str, dict[str, int]]:
    """Per fault kind active at the call's start ("none" outside faults): calls, ok, failed, unknown."""
    out: dict[str, dict[str, int]] = defaultdict(lambda: {"calls": 0, OK: 0, FAILED: 0, UNKNOWN: 0})
    for o in h.api:
        for k in faults_active(h.faults, o.start) or ["none"]:
            out[k]["calls"] += 1
            out[k][o.result] += 1
    return dict(out)


def summary(h: RunHistory, verdicts: list[Verdict], meta: dict[str, Any]) -> dict[str, Any]:
    api_gap = longest_gap([(o.start, o.result == OK) for o in h.api])
    serve_gap = longest_gap([(s.start, s.ok) for s in h.serve if not s.stream])
    return {
        **meta,
        "ok": all(v.ok for v in verdicts),
        "faults_by_kind": dict(Counter(f.kind for f in h.faults)),
        "faults": [f.__dict__ for f in h.faults],
        "checkers": [v.json() for v in verdicts],
        "api_by_fault_kind": api_errors(h),
        "serving_by_fault_kind": serving_errors(h.serve, h.faults),
        "longest_api_unavailability_s": round(api_gap[0], 2),
        "longest_api_unavailability_at_s": round(api_gap[1], 2),
        "longest_serving_unavailability_s": round(serve_gap[0], 2),
        "longest_serving_unavailability_at_s": round(serve_gap[1], 2),
        "api_calls": len(h.api),
        "requests": len(h.serve),
    }


def markdown(s: dict[str, Any]) -> str:
    lines = [
        f"# Chaos run: profile {s.get('profile')}, seed {s.get('seed')} — {'PASS' if s['ok'] else 'FAIL'}",
        "",
        f"Duration {s.get('duration_s', 0):.0f} s; {sum(s['faults_by_kind'].values())} faults of "
        f"{len(s['faults_by_kind'])} kinds; {s['api_calls']} API calls; {s['requests']} requests.",
        "",
        "## Faults by kind",
        "",
        "| kind | count |",
        "|---|---|",
        *(f"| {k} | {n} |" for k, n in sorted(s["faults_by_kind"].items())),
        "",
        "## Checkers",
        "",
        "| checker | result | summary |",
        "|---|---|---|",
        *(f"| {c['name']} | {'ok' if c['ok'] else 'FAIL'} | {c['summary']} |" for c in s["checkers"]),
        "",
    ]
    first = next((c for c in s["checkers"] if not c["ok"]), None)
    if first:
        lines += [
            f"First violation ({first['name']}):",
            "",
            "```",
            *(first["violations"][:10] or [first["summary"]]),
            "```",
            "",
        ]
        if s.get("first_violation_context"):
            lines += ["Around it:", "", "```", *s["first_violation_context"], "```", ""]
    lines += [
        "## Client errors by fault kind",
        "",
        "| fault kind | API calls | ok | failed | unknown | requests | errors (non-stream) | stream errors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    kinds = sorted(set(s["api_by_fault_kind"]) | set(s["serving_by_fault_kind"]))
    for k in kinds:
        a = s["api_by_fault_kind"].get(k, {})
        r = s["serving_by_fault_kind"].get(k, {})
        lines.append(
            f"| {k} | {a.get('calls', 0)} | {a.get(OK, 0)} | {a.get(FAILED, 0)} | {a.get(UNKNOWN, 0)} "
            f"| {r.get('requests', 0)} | {r.get('errors', 0)} | {r.get('stream_errors', 0)} |"
        )
    lines += [
        "",
        f"Longest API unavailability: {s['longest_api_unavailability_s']} s "
        f"(from {s['longest_api_unavailability_at_s']} s); longest serving unavailability "
        f"(non-streaming): {s['longest_serving_unavailability_s']} s "
        f"(from {s['longest_serving_unavailability_at_s']} s).",
        "",
        "![timeline](timeline.png)",
        "",
    ]
    return "\n".join(lines)


def timeline(h: RunHistory, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(12, 7), sharex=True)
    kinds = sorted({f.kind for f in h.faults})
    for f in h.faults:
        y = kinds.index(f.kind)
        ax1.barh(y, f.end - f.start, left=f.start, height=0.6)
    ax1.set_yticks(range(len(kinds)), kinds, fontsize=7)
    ax1.set_title("faults (and leader changes)")
    prev = None
    for smp in h.samples:
        if smp.leader != prev and prev is not None:
            ax1.axvline(smp.t, color="k", linestyle=":", linewidth=0.8)
        prev = smp.leader
    end = max([s.end for s in h.serve if s.end != float("inf")] + [f.end for f in h.faults] + [1.0])
    buckets = max(1, int(end // 2) + 1)
    tot, err, api_tot, api_bad = [0] * buckets, [0] * buckets, [0] * buckets, [0] * buckets
    for s in h.serve:
        b = min(buckets - 1, int(s.start // 2))
        tot[b] += 1
        err[b] += 0 if s.ok else 1
    for o in h.api:
        b = min(buckets - 1, int(o.start // 2))
        api_tot[b] += 1
        api_bad[b] += 0 if o.result == OK else 1
    xs = [i * 2 for i in range(buckets)]
    ax2.plot(xs, [e / t if t else 0 for e, t in zip(err, tot, strict=True)], label="serving errors")
    ax2.plot(xs, [e / t if t else 0 for e, t in zip(api_bad, api_tot, strict=True)], label="API not ok")
    ax2.set_ylabel("error rate")
    ax2.legend(fontsize=7)
    ax3.plot([s.t for s in h.samples], [s.running for s in h.samples], label="Running instances")
    ax3.plot([s.t for s in h.samples], [s.instances for s in h.samples], label="instances")
    ax3.set_xlabel("seconds since start")
    ax3.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def write(out: Path, h: RunHistory, verdicts: list[Verdict], meta: dict[str, Any]) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    s = summary(h, verdicts, meta)
    (out / "report.json").write_text(json.dumps(s, indent=2, default=str))
    (out / "report.md").write_text(markdown(s))
    try:
        timeline(h, out / "timeline.png")
    except Exception as e:  # the picture is a convenience; the verdicts stand without it
        (out / "timeline.error").write_text(f"{type(e).__name__}: {e}\n")
    return s
