"""The node-local engine ledger: `<agent state dir>/ledger/engines.jsonl`.

Each supervisor appends one JSON object per line when its engine starts and when it has ended
(O_APPEND, fsync per line, so lines from concurrent supervisors never interleave and survive agent
restarts): `event` ("start"|"stop"), `node`, `instance`, `devices`, `pid`, `wall_ms`, `mono_ns`
(time.monotonic_ns()), `boot_id`, `cause`. A start is stamped before the engine is spawned and a
stop after it was reaped, so the recorded interval always covers the engine's life: two intervals
that do not overlap prove the engines never ran at the same time. Tests, the chaos suite and
`kunlun-cli node engines NODE` read it.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from node_agent.executor.fence import boot_id

LEDGER_DIR = "ledger"
LEDGER_FILE = "engines.jsonl"
MAX_LINE_BYTES = 64 * 1024


def ledger_path(state_dir: Path) -> Path:
    return state_dir / LEDGER_DIR / LEDGER_FILE


def event(
    kind: str,
    node: str,
    instance: str,
    devices: Sequence[str],
    pid: int,
    cause: str,
    mono_ns: int | None = None,
) -> dict[str, Any]:
    """One ledger entry (the contract's keys)."""
    return {
        "event": kind,
        "node": node,
        "instance": instance,
        "devices": list(devices),
        "pid": int(pid),
        "wall_ms": int(time.time() * 1000),
        "mono_ns": time.monotonic_ns() if mono_ns is None else mono_ns,
        "boot_id": boot_id(),
        "cause": cause,
    }


def append(path: Path, entry: dict[str, Any]) -> None:
    """Append one line atomically (O_APPEND, one write) and fsync it. Blocking."""
    line = (json.dumps(entry, separators=(",", ":")) + "\n").encode()
    if len(line) > MAX_LINE_BYTES:
        raise ValueError(f"{path}: ledger line of {len(line)} bytes exceeds {MAX_LINE_BYTES}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)


def read(path: Path, tail: int = 0) -> list[dict[str, Any]]:
    """The entries in order (the last `tail` when > 0); a torn or foreign line is skipped. Blocking."""
    out: deque[dict[str, Any]] = deque(maxlen=tail if tail > 0 else None)
    try:
        with path.open("rb") as f:
            for raw in f:
                try:
                    data = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(data, dict) and data.get("event") in ("start", "stop"):
                    out.append(data)
    except FileNotFoundError:
        return []
    return list(out)


OPEN = 2**63
"""The stop time of a run whose engine has not stopped (yet)."""


def runs_of(state_dirs: dict[str, Path], instance: str) -> list[tuple[str, int, int]]:
    """(node, start mono_ns, stop mono_ns or OPEN) of every engine run of `instance`, from the
    ledgers of the nodes whose agent state folders are given (node -> folder). Comparing runs of
    different nodes needs one monotonic clock: the nodes of one machine (local clusters, benches)."""
    out = []
    for node, folder in state_dirs.items():
        starts: dict[int, int] = {}
        for e in read(ledger_path(folder)):
            if e.get("instance") != instance:
                continue
            if e["event"] == "start":
                starts[int(e["pid"])] = int(e["mono_ns"])
            elif int(e["pid"]) in starts:
                out.append((node, starts.pop(int(e["pid"])), int(e["mono_ns"])))
        out += [(node, s, OPEN) for s in starts.values()]
    return out


def overlap_s(runs: Sequence[tuple[str, int, int]]) -> float:
    """The longest time any two of `runs` were alive together (0 when none overlapped)."""
    worst = 0
    for i, a in enumerate(runs):
        for b in runs[i + 1 :]:
            worst = max(worst, min(a[2], b[2]) - max(a[1], b[1]))
    return worst / 1e9
