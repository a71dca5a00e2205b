"""The acceptance report: `report.md` (a summary table, then each layer's checkpoints with their
evidence and pictures), `report.json` (the same data), and the SVG pictures beside them."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from controlplane.cli.verify import svg
from controlplane.cli.verify.model import LayerResult, Run


def summary_rows(run: Run) -> list[tuple[str, str, str, str, str]]:
    """(layer, checkpoint, measured, threshold, result) for every checkpoint."""
    return [
        (str(c.layer), c.name, c.measured, c.threshold, c.verdict.upper())
        for layer in run.layers
        for c in layer.checkpoints
    ]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _pictures(layer: LayerResult, out: Path) -> list[str]:
    names = []
    if layer.utilization and any(s.points for s in layer.utilization):
        name = f"layer{layer.layer}-utilization.svg"
        _write(
            out / name,
            svg.lines(f"Layer {layer.layer}: utilization per card", layer.utilization, marks=layer.marks),
        )
        names.append(name)
    if layer.latencies_ms:
        name = f"layer{layer.layer}-latency.svg"
        _write(out / name, svg.histogram(f"Layer {layer.layer}: request latency", layer.latencies_ms))
        names.append(name)
    return names


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write(run: Run, out: Path) -> list[Path]:
    """Write the report into `out` (created); the files written."""
    out.mkdir(parents=True, exist_ok=True)
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(run.started_unix_ms / 1000))
    md = [
        "# Kunlun Platform acceptance report",
        "",
        f"Run at {when} against {', '.join(run.endpoints)}: **{'PASS' if run.passed else 'FAIL'}**.",
        "",
        "| Layer | Checkpoint | Measured | Threshold | Result |",
        "|---|---|---|---|---|",
    ]
    md += [f"| {' | '.join(_cell(c) for c in row)} |" for row in summary_rows(run)]
    md += [
        f"| {layer.layer} | (skipped) | {_cell(layer.skipped)} | | SKIPPED |"
        for layer in run.layers
        if layer.skipped
    ]
    files = []
    for layer in run.layers:
        md += ["", f"## Layer {layer.layer}: {layer.title}", ""]
        if layer.skipped:
            md.append(f"Skipped: {layer.skipped}")
            continue
        for name in _pictures(layer, out):
            files.append(out / name)
            md += [f"![{name}]({name})", ""]
        for c in layer.checkpoints:
            md += [
                f"### {c.name}: {c.verdict.upper()}",
                "",
                f"- measured: {c.measured}",
                f"- threshold: {c.threshold}",
            ]
            if c.note:
                md.append(f"- note: {c.note}")
            for e in c.evidence:
                md += ["", f"`{e.command}`", "", "```", e.output.rstrip(), "```"]
            md.append("")
    if run.cleanup:
        md += ["", "## Cleanup", ""] + [f"- {line}" for line in run.cleanup]
    _write(out / "report.md", "\n".join(md) + "\n")
    _write(out / "report.json", json.dumps(run.to_json(), indent=2) + "\n")
    return [out / "report.md", out / "report.json", *files]
