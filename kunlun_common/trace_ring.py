"""A bounded ring of Chrome trace files (the JSON Array Format that chrome://tracing, Perfetto's UI
and `ui.perfetto.dev` open).

Each file is one process's events for a stretch of time, `[` + events + `]`, and stays valid JSON
after every write: new events are written over the closing bracket in one write call, followed by
a new one. A file never grows past `max_file_bytes`; when the next events would not fit, a new file
starts (with the process and thread names again, so each file opens on its own), and the oldest
files of the same process are deleted first so that at most `max_files` exist at any moment. The
bound on disk is therefore `max_files * max_file_bytes` per process.

File names: `<process>-<sequence>.trace.json`, the sequence continuing across restarts so that
names sort oldest first.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kunlun_common.errors import ConfigError

MIN_FILE_BYTES = 4096
"""Smallest allowed `max_file_bytes` (the metadata of a new file must fit with room to spare)."""
MAX_HEADER_EVENTS = 64
"""Most metadata events repeated at the top of each file (process name, then thread names)."""
_HEAD = b"[\n"
_TAIL = b"\n]\n"
_SEP = b",\n"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")


def default_dir() -> str:
    """The trace folder when none is configured: `$TMPDIR/kunlun-profiles`."""
    return str(Path(tempfile.gettempdir()) / "kunlun-profiles")


@dataclass(frozen=True)
class ProfileOutput:
    """Where one process writes its run-time profiles (switched on cluster-wide by the scheduler
    settings `advanced_profiling` and `profiling_interval_ms`). YAML key `profiling`."""

    dir: str = ""
    """Folder of the trace files; empty: `$TMPDIR/kunlun-profiles`. Created when profiling starts."""
    max_files: int = 8
    """Most trace files kept per process (the oldest is deleted first); at least 2."""
    max_file_bytes: int = 4 * 2**20
    """Largest size of one trace file in bytes; at least 4096."""

    def __post_init__(self) -> None:
        if not isinstance(self.max_files, int) or isinstance(self.max_files, bool) or self.max_files < 2:
            raise ConfigError(f"profiling.max_files: expected an integer >= 2, found {self.max_files!r}")
        b = self.max_file_bytes
        if not isinstance(b, int) or isinstance(b, bool) or b < MIN_FILE_BYTES:
            raise ConfigError(
                f"profiling.max_file_bytes: expected an integer >= {MIN_FILE_BYTES}, found {b!r}"
            )

    @property
    def folder(self) -> Path:
        return Path(self.dir or default_dir())


def encode(event: Mapping[str, Any]) -> bytes:
    return json.dumps(event, separators=(",", ":"), ensure_ascii=False).encode()


class TraceRing:
    """The files of one process. Not thread-safe: one writer (the profiler's thread)."""

    def __init__(self, output: ProfileOutput, process: str) -> None:
        if not _NAME_RE.match(process):
            raise ConfigError(f"trace process name {process!r}: expected letters, digits, '.', '_' or '-'")
        self.output = output
        self.process = process
        self.folder = output.folder
        self._fd = -1
        self._size = 0
        self._events_in_file = 0
        self._header_events = 0
        self._header: list[bytes] = []
        self.path: Path | None = None
        self.dropped = 0
        """Events larger than a whole file on their own (not written)."""

    # ------------------------------------------------------------------ files
    def files(self) -> list[Path]:
        """This process's trace files, oldest first."""
        found = []
        for p in self.folder.glob(f"{self.process}-*.trace.json"):
            seq = p.name[len(self.process) + 1 : -len(".trace.json")]
            if seq.isdigit():
                found.append((int(seq), p))
        return [p for _, p in sorted(found)]

    def _next_seq(self) -> int:
        files = self.files()
        if not files:
            return 1
        return int(files[-1].name[len(self.process) + 1 : -len(".trace.json")]) + 1

    def _open_new(self) -> None:
        self.close()
        self.folder.mkdir(parents=True, exist_ok=True)
        existing = self.files()
        for old in existing[: max(0, len(existing) - (self.output.max_files - 1))]:
            old.unlink(missing_ok=True)
        seq = self._next_seq()
        self.path = self.folder / f"{self.process}-{seq:08d}.trace.json"
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o640)
        os.write(self._fd, _HEAD + _TAIL)
        self._size = len(_HEAD) + len(_TAIL)
        self._events_in_file = 0
        self._header_events = 0
        if self._header:
            self._append(list(self._header), header=True)
            self._header_events = self._events_in_file

    def set_header(self, events: Iterable[Mapping[str, Any]]) -> None:
        """Metadata events (process and thread names) written at the top of every new file."""
        self._header = [encode(e) for e in events]

    def add_header(self, event: Mapping[str, Any]) -> None:
        """One more metadata event: kept for new files and written to the current one."""
        raw = encode(event)
        if len(self._header) < MAX_HEADER_EVENTS:
            self._header.append(raw)
        if self._fd >= 0:
            self.write_raw([raw])

    # ------------------------------------------------------------------ writing
    def start(self) -> Path:
        """Begin a new file now (a profiling session starts); returns its path."""
        self._open_new()
        assert self.path is not None
        return self.path

    def write(self, events: Iterable[Mapping[str, Any]]) -> None:
        self.write_raw([encode(e) for e in events])

    def write_raw(self, raws: list[bytes]) -> None:
        if self._fd < 0:
            self._open_new()
        pending = raws
        while pending:
            rest = self._append(pending)
            if len(rest) < len(pending):
                pending = rest
            elif self._events_in_file <= self._header_events:
                self.dropped += 1  # bigger than a whole file on its own: never written
                pending = pending[1:]
            else:
                self._open_new()

    def _append(self, raws: list[bytes], header: bool = False) -> list[bytes]:
        """Write as many of `raws` as fit; return the rest."""
        room = self.output.max_file_bytes - self._size
        chunk: list[bytes] = []
        used = 0
        first = self._events_in_file == 0
        for raw in raws:
            cost = len(raw) + (0 if first and not chunk else len(_SEP))
            if used + cost > room:
                break
            chunk.append(raw)
            used += cost
        if not chunk:
            return raws if not header else []
        body = _SEP.join(chunk)
        if not first:
            body = _SEP + body
        # one write over the closing bracket: the file is valid JSON before and after it
        os.pwrite(self._fd, body + _TAIL, self._size - len(_TAIL))
        self._size += len(body)
        self._events_in_file += len(chunk)
        return raws[len(chunk) :]

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
