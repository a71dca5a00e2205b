"""What `kunlun-cli verify` produces: checkpoints (measured, threshold, verdict, evidence) per layer.

A checkpoint's `passed` is None when it could not be measured at all (its `note` says why); the run
fails when any checkpoint is not passed. Series (utilization over time per card, request latencies)
feed the report's pictures.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kunlun_common.i18n import localize
from kunlun_common.messages import Message

MAX_EVIDENCE_CHARS = 4000

Text = str | Message
"""A measured value, threshold or evidence text: a Message (with an id, translated where it is shown:
the terminal and report.md) or a text without words to translate (a number, a list of names, JSON).
report.json keeps the English text."""


def _cut(text: str) -> str:
    return text if len(text) <= MAX_EVIDENCE_CHARS else text[:MAX_EVIDENCE_CHARS] + "\n... (cut)"


def shown(english: str, m: Message | None) -> str:
    """`english` in the reader's language: its message's translation when it has one."""
    return localize(m, english) if m is not None else english


@dataclass(frozen=True)
class Evidence:
    """The command that shows a figure, and what it printed (cut to MAX_EVIDENCE_CHARS)."""

    command: str
    """A command an engineer can run to see the same thing (kunlun-cli ..., or the RPC called)."""
    output: str
    """What it returned, as text."""
    command_msg: Message | None = None
    """The command with its description (e.g. "(on node-a, via ...)") as a message, when it has one."""
    output_msg: Message | None = None
    """The output as a message, when it is text the verify run wrote (a burst's summary, a log)."""

    @property
    def shown_command(self) -> str:
        return shown(self.command, self.command_msg)

    @property
    def shown_output(self) -> str:
        return _cut(shown(self.output, self.output_msg)) if self.output_msg is not None else self.output

    def to_json(self) -> dict[str, str]:
        return {"command": self.command, "output": self.output}


def evidence(command: Text, output: Text) -> Evidence:
    return Evidence(
        str(command),
        _cut(str(output)),
        command if isinstance(command, Message) else None,
        output if isinstance(output, Message) else None,
    )


@dataclass
class Checkpoint:
    """One acceptance checkpoint of one layer."""

    layer: int
    name: str
    measured: str
    """The measured value, with its unit."""
    threshold: str
    """What it must be, e.g. "< 60 s" or "== declared"."""
    passed: bool | None
    """None: could not be measured (see `note`); counts as a failure."""
    evidence: list[Evidence] = field(default_factory=list)
    note: str = ""
    measured_msg: Message | None = None
    """`measured` as a message (translated where it is shown), when it has words."""
    threshold_msg: Message | None = None

    @property
    def shown_measured(self) -> str:
        return shown(self.measured, self.measured_msg)

    @property
    def shown_threshold(self) -> str:
        return shown(self.threshold, self.threshold_msg)

    @property
    def verdict(self) -> str:
        return "pass" if self.passed else ("fail" if self.passed is False else "error")

    def to_json(self) -> dict[str, Any]:
        return {
            "layer": self.layer,
            "name": self.name,
            "measured": self.measured,
            "threshold": self.threshold,
            "result": self.verdict,
            "note": self.note,
            "evidence": [e.to_json() for e in self.evidence],
        }


@dataclass
class Series:
    """Samples over time of one quantity (e.g. one card's utilization, %)."""

    name: str
    points: list[tuple[float, float]] = field(default_factory=list)
    """(seconds since the layer started, value)."""

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "points": [[round(t, 3), round(v, 3)] for t, v in self.points]}


@dataclass
class LayerResult:
    layer: int
    title: str
    checkpoints: list[Checkpoint] = field(default_factory=list)
    utilization: list[Series] = field(default_factory=list)
    """Per card, % over seconds since the layer started (the report's utilization picture)."""
    marks: list[tuple[float, str]] = field(default_factory=list)
    """Moments on the utilization time axis (burst start and end)."""
    latencies_ms: list[float] = field(default_factory=list)
    """Every request latency of the layer's burst (the report's latency distribution)."""
    skipped: str = ""
    """Why the layer did not run (then it has no checkpoints and does not count)."""

    @property
    def passed(self) -> bool:
        return not self.skipped and bool(self.checkpoints) and all(c.passed for c in self.checkpoints)

    def add(
        self,
        name: str,
        measured: Text,
        threshold: Text,
        passed: bool | None,
        *ev: Evidence,
        note: str = "",
    ) -> Checkpoint:
        cp = Checkpoint(
            self.layer,
            name,
            str(measured),
            str(threshold),
            passed,
            list(ev),
            note,
            measured if isinstance(measured, Message) else None,
            threshold if isinstance(threshold, Message) else None,
        )
        self.checkpoints.append(cp)
        return cp

    def to_json(self) -> dict[str, Any]:
        return {
            "layer": self.layer,
            "title": self.title,
            "result": "skipped" if self.skipped else ("pass" if self.passed else "fail"),
            "skipped": self.skipped,
            "checkpoints": [c.to_json() for c in self.checkpoints],
            "utilization": [s.to_json() for s in self.utilization],
            "marks": [[round(t, 3), what] for t, what in self.marks],
            "latencies_ms": [round(x, 2) for x in self.latencies_ms],
        }


@dataclass
class Run:
    """One `kunlun-cli verify` run."""

    started_unix_ms: int
    endpoints: list[str]
    layers: list[LayerResult] = field(default_factory=list)
    cleanup: list[Text] = field(default_factory=list)
    """What the run created and removed again (or failed to remove: the line says so)."""
    finished_unix_ms: int = 0

    @property
    def passed(self) -> bool:
        ran = [r for r in self.layers if not r.skipped]
        return (
            bool(ran)
            and all(r.passed for r in ran)
            and not any("NOT removed" in str(c) for c in self.cleanup)
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "result": "pass" if self.passed else "fail",
            "started_unix_ms": self.started_unix_ms,
            "finished_unix_ms": self.finished_unix_ms,
            "endpoints": self.endpoints,
            "layers": [r.to_json() for r in self.layers],
            "cleanup": [str(c) for c in self.cleanup],
        }
