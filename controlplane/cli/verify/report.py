"""The acceptance report: `report.md` (a summary table, then each layer's checkpoints with their
evidence and pictures), `report.json` (the same data), and the SVG pictures beside them."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from controlplane.cli.verify import svg
from controlplane.cli.verify.model import LayerResult, Run, Text
from kunlun_common.i18n import _, localize, translate


def summary_rows(run: Run) -> list[tuple[str, str, str, str, str]]:
    """(layer, checkpoint, measured, threshold, result) for every checkpoint, in English."""
    return [
        (str(c.layer), c.name, c.measured, c.threshold, c.verdict.upper())
        for layer in run.layers
        for c in layer.checkpoints
    ]


def shown_rows(run: Run) -> list[tuple[str, str, str, str, str]]:
    """The summary rows in the reader's language (result words stay as they are)."""
    return [
        (str(c.layer), translate(c.name), c.shown_measured, c.shown_threshold, c.verdict.upper())
        for layer in run.layers
        for c in layer.checkpoints
    ]


def shown_line(line: Text) -> str:
    """A cleanup line in the reader's language."""
    return line if isinstance(line, str) else localize(line)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _pictures(layer: LayerResult, out: Path) -> list[str]:
    names = []
    if layer.utilization and any(s.points for s in layer.utilization):
        name = f"layer{layer.layer}-utilization.svg"
        _write(
            out / name,
            svg.lines(
                _("Layer {layer}: utilization per card").format(layer=layer.layer),
                layer.utilization,
                marks=layer.marks,
            ),
        )
        names.append(name)
    if layer.latencies_ms:
        name = f"layer{layer.layer}-latency.svg"
        title = _("Layer {layer}: request latency").format(layer=layer.layer)
        _write(out / name, svg.histogram(title, layer.latencies_ms))
        names.append(name)
    return names


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write(run: Run, out: Path) -> list[Path]:
    """Write the report into `out` (created); the files written. report.md and the pictures are in the
    reader's language (checkpoint names, titles, labels, measured values, thresholds, the texts of
    the evidence and the cleanup lines; tables and tools' output as they are); report.json stays
    English."""
    out.mkdir(parents=True, exist_ok=True)
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(run.started_unix_ms / 1000))
    verdict = "PASS" if run.passed else "FAIL"
    md = [
        _("# Kunlun Platform acceptance report"),
        "",
        _("Run at {when} against {endpoints}: **{verdict}**.").format(
            when=when, endpoints=", ".join(run.endpoints), verdict=verdict
        ),
        "",
        _("| Layer | Checkpoint | Measured | Threshold | Result |"),
        "|---|---|---|---|---|",
    ]
    md += [
        f"| {n} | {_cell(name)} | {_cell(measured)} | {_cell(threshold)} | {result} |"
        for n, name, measured, threshold, result in shown_rows(run)
    ]
    md += [
        _("| {layer} | (skipped) | {reason} | | SKIPPED |").format(
            layer=layer.layer, reason=_cell(translate(layer.skipped))
        )
        for layer in run.layers
        if layer.skipped
    ]
    files = []
    for layer in run.layers:
        md += ["", _("## Layer {layer}: {title}").format(layer=layer.layer, title=translate(layer.title)), ""]
        if layer.skipped:
            md.append(_("Skipped: {reason}").format(reason=translate(layer.skipped)))
            continue
        for name in _pictures(layer, out):
            files.append(out / name)
            md += [f"![{name}]({name})", ""]
        for c in layer.checkpoints:
            md += [
                f"### {translate(c.name)}: {c.verdict.upper()}",
                "",
                _("- measured: {measured}").format(measured=c.shown_measured),
                _("- threshold: {threshold}").format(threshold=c.shown_threshold),
            ]
            if c.note:
                md.append(_("- note: {note}").format(note=translate(c.note)))
            for e in c.evidence:
                md += ["", f"`{e.shown_command}`", "", "```", e.shown_output.rstrip(), "```"]
            md.append("")
    if run.cleanup:
        md += ["", _("## Cleanup"), ""] + [f"- {shown_line(line)}" for line in run.cleanup]
    _write(out / "report.md", "\n".join(md) + "\n")
    _write(out / "report.json", json.dumps(run.to_json(), indent=2) + "\n")
    return [out / "report.md", out / "report.json", *files]
