"""The recorded history of a chaos run: client calls, requests through gateways, faults, leader
changes and samples, each one JSON object per line so a run can be checked again later.

Times are seconds since the run began (the runner's monotonic clock); `math.inf` as an end means
"never answered" (written as null).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

OK = "ok"
FAILED = "failed"
UNKNOWN = "unknown"
RESULTS = (OK, FAILED, UNKNOWN)


@dataclass(frozen=True)
class ApiOp:
    """One workload API call by a chaos client."""

    client: int
    """Which client made it (each client makes one call at a time)."""
    kind: str
    """submit | scale | delete | get."""
    name: str
    """Workload name."""
    arg: int | None
    """Replicas asked for (submit, scale); None otherwise."""
    start: float
    """When the call was sent."""
    end: float
    """When its answer came (`math.inf` when it never did)."""
    result: str
    """ok: done; failed: refused, certainly without effect; unknown: may or may not have taken effect."""
    code: str = ""
    """The gRPC status code name of a failure ("" on success)."""
    read: str | None = None
    """What a successful get returned: "r=<replicas>" or "deleting" ("" when absent, on NOT_FOUND)."""


@dataclass(frozen=True)
class ServeOp:
    """One OpenAI request through the gateways (after the client's retries over gateways)."""

    start: float
    end: float
    stream: bool
    ok: bool
    gateway: str
    """The gateway that gave the final answer (or the last one tried)."""
    attempts: int
    error: str = ""


@dataclass(frozen=True)
class FaultRecord:
    """One fault: injected at `start`, healed at `end`."""

    kind: str
    target: str
    start: float
    end: float
    detail: str = ""


@dataclass
class Sample:
    """A periodic observation: leader, instance counts."""

    t: float
    leader: str
    running: int
    instances: int


@dataclass
class RunHistory:
    """Everything a run recorded."""

    api: list[ApiOp] = field(default_factory=list)
    serve: list[ServeOp] = field(default_factory=list)
    faults: list[FaultRecord] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    last_heal: float = 0.0

    def write(self, path: Path) -> None:
        with path.open("w") as f:
            for kind, rows in (
                ("api", self.api),
                ("serve", self.serve),
                ("fault", self.faults),
                ("sample", self.samples),
            ):
                for r in rows:
                    f.write(json.dumps({"type": kind, **_jsonable(asdict(r))}) + "\n")
            f.write(json.dumps({"type": "meta", "last_heal": self.last_heal}) + "\n")

    @classmethod
    def read(cls, path: Path) -> RunHistory:
        h = cls()
        for obj in _lines(path):
            h.add(obj)
        return h

    def add(self, row: dict[str, Any]) -> None:
        """Add one recorded row (as written by `write` or by the load generator)."""
        obj = dict(row)
        kind = obj.pop("type", "")
        obj = {k: (math.inf if v is None and k == "end" else v) for k, v in obj.items()}
        if kind == "api":
            self.api.append(ApiOp(**obj))
        elif kind == "serve":
            self.serve.append(ServeOp(**obj))
        elif kind == "fault":
            self.faults.append(FaultRecord(**obj))
        elif kind == "sample":
            self.samples.append(Sample(**obj))
        elif kind == "meta":
            self.last_heal = float(obj["last_heal"])


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in d.items()}


def _lines(path: Path) -> Iterator[dict[str, Any]]:
    with path.open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e}); the file is damaged") from e
            if isinstance(obj, dict):
                yield obj


def read_jsonl(paths: Iterable[Path]) -> list[dict[str, Any]]:
    """All JSON objects of several JSONL files (damaged last lines of a killed writer are skipped)."""
    out: list[dict[str, Any]] = []
    for p in paths:
        try:
            text = p.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict):
                out.append(obj)
    return out
