"""A minimal tar stream: regular files only, read and written in fixed chunks.

The standard library's `tarfile` copies every chunk several times in stream mode and accepts links,
devices and absolute paths that a package must never hold. Writing uses `TarInfo.tobuf` (POSIX pax, so
any size and any path length), so GNU tar and `tarfile` read packages; reading parses ustar headers and
the pax records `path` and `size`, and refuses every other member type. Data goes through one reused
buffer (`readinto`), so memory stays at CHUNK whatever the file size.
"""

from __future__ import annotations

import io
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import BinaryIO

from kunlun_common.messages import msg
from kunlun_common.modelpkg.errors import MalformedPackageError

BLOCK = 512
CHUNK = 4 << 20
MAX_PAX_BYTES = 1 << 20
_ZEROS = bytes(CHUNK)
Sink = Callable[[memoryview], None]


def _pad(size: int) -> int:
    return -size % BLOCK


class TarWriter:
    """Writes members to a file. Runs of zero bytes in a seekable output become holes (sparse output)."""

    def __init__(self, out: BinaryIO) -> None:
        self.out = out
        self._buf = bytearray(CHUNK)
        try:
            self._seekable = out.seekable()
        except (AttributeError, io.UnsupportedOperation):
            self._seekable = False
        self._hole = 0  # bytes skipped by seeking and not yet materialised

    def _write(self, data: bytes | bytearray | memoryview) -> None:
        if self._hole:
            self.out.seek(self._hole, io.SEEK_CUR)
            self._hole = 0
        self.out.write(data)

    def _header(self, name: str, size: int, mtime: int) -> None:
        ti = tarfile.TarInfo(name)
        ti.size, ti.mtime, ti.mode, ti.type = size, mtime, 0o644, tarfile.REGTYPE
        ti.uname = ti.gname = ""
        self._write(ti.tobuf(tarfile.PAX_FORMAT, "utf-8", "strict"))

    def add_bytes(self, name: str, data: bytes) -> None:
        self._header(name, len(data), 0)
        self._write(data + bytes(_pad(len(data))))

    def add_stream(self, name: str, src: BinaryIO, size: int, mtime: int, on_chunk: Sink) -> None:
        """Copy exactly `size` bytes of `src`, calling `on_chunk` with each chunk (hashing, progress)."""
        self._header(name, size, mtime)
        left = size
        mv = memoryview(self._buf)
        while left:
            n = src.readinto(mv[: min(CHUNK, left)])  # type: ignore[attr-defined]
            if not n:
                raise MalformedPackageError(
                    msg(
                        "package.tarstream.file_shrank_while_being",
                        "{name}: file shrank while being packed ({left} bytes missing)",
                        name=name,
                        left=left,
                    )
                )
            on_chunk(mv[:n])
            if self._seekable and (self._buf == _ZEROS if n == CHUNK else self._buf[:n] == _ZEROS[:n]):
                self._hole += n
            else:
                self._write(mv[:n])
            left -= n
        if _pad(size):
            self._write(bytes(_pad(size)))

    def close(self) -> None:
        """The end-of-archive marker (two zero blocks)."""
        self._write(bytes(2 * BLOCK))
        self.out.flush()


@dataclass(frozen=True)
class Member:
    name: str
    size: int


class TarReader:
    """Reads members in order from a stream. Every irregularity is a MalformedPackageError."""

    def __init__(self, src: BinaryIO) -> None:
        self.src = src
        self._buf = bytearray(CHUNK)
        self.offset = 0
        self._current: Member | None = None
        self._left = 0

    def _read_exact(self, n: int, what: str) -> bytes:
        data = self.src.read(n)
        if len(data) != n:
            raise MalformedPackageError(
                msg(
                    "package.tarstream.archive_truncated_at_byte",
                    "archive truncated in {what} at byte {value}",
                    what=what,
                    value=self.offset + len(data),
                )
            )
        self.offset += n
        return data

    def next(self) -> Member | None:
        """The next member's header (the previous member's data must have been read); None at the end."""
        if self._current is not None and self._left:
            self.skip()
        pax: dict[str, str] = {}
        while True:
            raw = self.src.read(BLOCK)
            if len(raw) == 0 and not pax:
                raise MalformedPackageError(
                    msg(
                        "package.tarstream.archive_truncated_at_byte_2",
                        "archive truncated at byte {offset}: no end-of-archive marker",
                        offset=self.offset,
                    )
                )
            if len(raw) != BLOCK:
                raise MalformedPackageError(
                    msg(
                        "package.tarstream.archive_truncated_member_header",
                        "archive truncated in a member header at byte {offset}",
                        offset=self.offset,
                    )
                )
            self.offset += BLOCK
            if raw.count(0) == BLOCK:  # end-of-archive marker
                return None
            try:
                ti = tarfile.TarInfo.frombuf(raw, "utf-8", "strict")
            except (tarfile.HeaderError, UnicodeDecodeError) as e:
                raise MalformedPackageError(
                    msg(
                        "package.tarstream.not_package_bad_tar",
                        "not a package: bad tar header at byte {value} ({e})",
                        value=self.offset - BLOCK,
                        e=e,
                    )
                ) from None
            if ti.type == tarfile.XHDTYPE:
                if ti.size > MAX_PAX_BYTES:
                    raise MalformedPackageError(
                        msg(
                            "package.tarstream.pax_header_bytes_at",
                            "pax header of {size} bytes at byte {offset}: too large",
                            size=ti.size,
                            offset=self.offset,
                        )
                    )
                pax.update(_parse_pax(self._read_exact(ti.size + _pad(ti.size), "a pax header")[: ti.size]))
                continue
            if ti.type not in (tarfile.REGTYPE, tarfile.AREGTYPE):
                raise MalformedPackageError(
                    msg(
                        "package.tarstream.member_not_regular_file",
                        "member {name!r} is not a regular file (tar type {type}); packages hold only files",
                        name=ti.name,
                        type=repr(ti.type),  # bytes: shown as Python shows them (b'2')
                    )
                )
            name = pax.get("path", ti.name)
            try:
                size = int(pax["size"]) if "size" in pax else ti.size
            except ValueError:
                raise MalformedPackageError(
                    msg(
                        "package.tarstream.not_package_pax_size",
                        "not a package: pax size of {name!r} is not a number",
                        name=name,
                    )
                ) from None
            self._current, self._left = Member(name, size), size
            return self._current

    def read_small(self, limit: int) -> bytes:
        """The whole data of the current member, refused when larger than `limit`."""
        assert self._current is not None
        size = self._current.size
        if size > limit:
            raise MalformedPackageError(
                msg(
                    "package.tarstream.bytes_at_most_allowed",
                    "{name} is {size} bytes; at most {limit} allowed",
                    name=self._current.name,
                    size=size,
                    limit=limit,
                )
            )
        data = self._read_exact(size, self._current.name)
        self._read_exact(_pad(size), self._current.name)
        self._left = 0
        return data

    def read_into(self, sink: Sink) -> None:
        """Stream the current member's data to `sink` in chunks of at most CHUNK bytes."""
        assert self._current is not None
        name, size = self._current.name, self._current.size
        mv = memoryview(self._buf)
        readinto = self.src.readinto  # type: ignore[attr-defined]
        while self._left:
            want = min(CHUNK, self._left)
            n = readinto(mv[:want])
            if not n:
                raise MalformedPackageError(
                    msg(
                        "package.tarstream.archive_truncated_inside_bytes",
                        "archive truncated inside {name}: {value} of {size} bytes present",
                        name=name,
                        value=size - self._left,
                        size=size,
                    )
                )
            self.offset += n
            self._left -= n
            sink(mv[:n])
        self._read_exact(_pad(size), name)

    def skip(self) -> None:
        self.read_into(lambda _: None)


def _parse_pax(data: bytes) -> dict[str, str]:
    out: dict[str, str] = {}
    pos = 0
    try:
        while pos < len(data):
            sp = data.index(b" ", pos)
            length = int(data[pos:sp])
            rec = data[sp + 1 : pos + length - 1].decode("utf-8")
            key, _, value = rec.partition("=")
            out[key] = value
            pos += length
            if length <= 0:
                raise ValueError("zero-length record")
    except (ValueError, UnicodeDecodeError) as e:
        raise MalformedPackageError(
            msg("package.tarstream.not_package_bad_pax", "not a package: bad pax header ({e})", e=e)
        ) from None
    return out
