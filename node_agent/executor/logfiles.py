"""Engine log files: whole-line, size-rotated writing (the supervisor) and reading (`NodeService.Logs`).

The supervisor writes `engine.log` in the instance dir; before a write would make it larger than
`max_bytes` it renames `engine.log` to `engine.log.1` (shifting older copies up, dropping the
oldest beyond `backup_count`) and starts a new file. Rotation happens between lines, never inside
one, so a reader sees every line whole exactly once: the rotated copies (oldest first) and then
the current file.

Readers: `read_lines` returns what is kept now (optionally the last N lines); `LogFollower` reads
the same snapshot and then every line appended afterwards, across rotations (it keeps the file it
has open until it is drained, then moves to the new `engine.log`).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class LogSettings:
    """Engine log rotation."""

    file_name: str = "engine.log"
    """Log file name inside the instance dir; rotated copies get .1, .2... (1 is the newest)."""
    max_bytes: int = 10 * 1024 * 1024
    """Rotate before a write would make the file larger than this (a longer single line is kept whole)."""
    backup_count: int = 5
    """Rotated files kept; older lines are dropped deliberately."""
    max_line_bytes: int = 1024 * 1024
    """A line longer than this without a newline is written in pieces (bounds the supervisor's memory)."""


class LineSplitter:
    """Cuts a byte stream into whole lines (each ending with a newline)."""

    def __init__(self, max_line_bytes: int) -> None:
        self.max_line_bytes = max_line_bytes
        self.partial = b""

    def feed(self, chunk: bytes) -> bytes:
        """Return the complete lines now available; keep the unfinished tail."""
        data = self.partial + chunk
        cut = data.rfind(b"\n") + 1
        self.partial = data[cut:]
        out = data[:cut]
        while len(self.partial) > self.max_line_bytes:
            out += self.partial[: self.max_line_bytes] + b"\n"
            self.partial = self.partial[self.max_line_bytes :]
        return out

    def flush(self) -> bytes:
        """At end of stream: the unfinished last line, newline-terminated."""
        out, self.partial = (self.partial + b"\n" if self.partial else b""), b""
        return out


class RotatingLineLog:
    """Append-only log that rotates by size between lines, never inside one."""

    def __init__(self, path: Path, max_bytes: int, backup_count: int) -> None:
        self.path, self.max_bytes, self.backup_count = path, max_bytes, backup_count
        self._open()

    def _open(self) -> None:
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o640)
        self.size = os.fstat(self.fd).st_size

    def _copy(self, i: int) -> Path:
        return self.path.with_name(f"{self.path.name}.{i}")

    def _rotate(self) -> None:
        os.close(self.fd)
        if self.backup_count > 0:
            rotated = 0  # existing copies .1 .. .n (contiguous), shifted up by one, the oldest dropped
            while rotated < self.backup_count and self._copy(rotated + 1).exists():
                rotated += 1
            for i in range(min(rotated, self.backup_count - 1), 0, -1):
                os.replace(self._copy(i), self._copy(i + 1))
            os.replace(self.path, self._copy(1))
        else:
            self.path.unlink(missing_ok=True)
        self._open()

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view) :]
        self.size += len(data)

    def write_lines(self, data: bytes) -> None:
        """Write whole lines (`data` ends with a newline), rotating between lines as needed."""
        while data:
            room = self.max_bytes - self.size
            cut = len(data) if len(data) <= room else data.rfind(b"\n", 0, max(room, 0)) + 1
            if cut == 0:
                if self.size > 0:
                    self._rotate()
                    continue
                cut = data.index(b"\n") + 1  # a single line longer than max_bytes: kept whole
            self._write(data[:cut])
            data = data[cut:]

    def close(self) -> None:
        """Close the file."""
        os.close(self.fd)


# --- Reading --------------------------------------------------------------------------------------


def rotated_files(path: Path) -> list[Path]:
    """The rotated copies of `path` that exist, oldest first (`.N` ... `.1`)."""
    found: list[tuple[int, Path]] = []
    for p in path.parent.glob(f"{path.name}.*"):
        suffix = p.name[len(path.name) + 1 :]
        if suffix.isdigit():
            found.append((int(suffix), p))
    return [p for _, p in sorted(found, reverse=True)]


def _decode(data: bytes) -> list[str]:
    return data.decode("utf-8", errors="replace").splitlines()


def read_lines(path: Path, tail: int = 0) -> list[str]:
    """Every kept line of the log at `path` (rotated copies first), or its last `tail` lines (tail > 0)."""
    lines: list[str] = []
    for p in [*rotated_files(path), path]:
        try:
            lines.extend(_decode(p.read_bytes()))
        except FileNotFoundError:
            continue
        if tail > 0 and len(lines) > 4 * tail:
            del lines[:-tail]
    return lines[-tail:] if tail > 0 else lines


def _inode(path: Path) -> int | None:
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return None


class LogFollower:
    """Read a rotating log once, then follow what is appended, across rotations, losing nothing.

    `snapshot(tail)` opens the current file first and reads the rotated copies (skipping the one
    that may have become our open file meanwhile) and then the open file to its end; `follow()` yields
    the new complete lines as they come. Call `close()` at the end.
    """

    def __init__(self, path: Path, poll_s: float = 0.2) -> None:
        self.path = path
        self.poll_s = poll_s
        self.fd: int | None = None
        self.ino: int | None = None
        self.partial = b""

    def _open_current(self) -> bool:
        try:
            self.fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        self.ino = os.fstat(self.fd).st_ino
        return True

    def _drain(self) -> list[str]:
        if self.fd is None:
            return []
        chunks = []
        while True:
            data = os.read(self.fd, 1 << 20)
            if not data:
                break
            chunks.append(data)
        data = self.partial + b"".join(chunks)
        cut = data.rfind(b"\n") + 1
        self.partial = data[cut:]
        return _decode(data[:cut])

    def snapshot(self, tail: int = 0) -> list[str]:
        """What is kept now (the last `tail` lines when tail > 0); `follow` continues right after it."""
        self._open_current()
        lines: list[str] = []
        for p in rotated_files(self.path):
            if self.ino is not None and _inode(p) == self.ino:
                continue  # rotated after we opened it: it is our open file
            try:
                lines.extend(_decode(p.read_bytes()))
            except FileNotFoundError:
                continue
            if tail > 0 and len(lines) > 4 * tail:
                del lines[:-tail]
        lines.extend(self._drain())
        return lines[-tail:] if tail > 0 else lines

    async def follow(self, alive: Path | None = None) -> AsyncIterator[list[str]]:
        """Yield batches of new lines forever (until `alive`, a directory, disappears)."""
        while True:
            lines = self._drain()
            if lines:
                yield lines
                continue
            current = _inode(self.path)
            if current is not None and current != self.ino:
                # rotated: what was appended to the old file before the rename is read above; move on
                lines = self._drain()
                if lines:
                    yield lines
                self.close()
                self._open_current()
                continue
            if self.fd is None and self._open_current():
                continue
            if alive is not None and _inode(alive) is None:
                return
            await asyncio.sleep(self.poll_s)

    def close(self) -> None:
        """Close the open file."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self.ino = None
        self.partial = b""
