"""The backup file: written atomically with a header and checksum; any damage refused by name."""

from __future__ import annotations

import dataclasses
import json
import stat
from pathlib import Path

import pytest

from controlplane.store.backup import creation_batches
from controlplane.store.backup_file import (
    BackupFileError,
    BackupHeader,
    Record,
    read_backup,
    write_backup,
)

RECORDS = [
    Record("/kunlun/v1/workloads/w-1", b'{"schema":1,"message":{"id":"w-1"}}', 5, 9, 2),
    Record("/kunlun/v1/workload-names/chat", b'{"id":"w-1","schema":1}', 5, 5, 1),
    Record("/kunlun/v1/alloc/node-a/ascend:0", bytes(range(256)), 12, 12, 1),
]


def header(**kw: object) -> BackupHeader:
    base = BackupHeader(
        revision=42,
        cluster_id="c0ffee",
        taken_at="2026-12-01T04:00:00+00:00",
        taken_at_ms=1_796_097_600_000,
        prefix="/kunlun/",
        keys=len(RECORDS),
        kunlun_version="0.1.0",
        skipped={"leased": 4},
    )
    return dataclasses.replace(base, **kw)  # type: ignore[arg-type]


def test_round_trip_private_and_atomic(tmp_path: Path) -> None:
    path = tmp_path / "cluster.backup"
    path.write_text("an older backup\n")
    write_backup(path, header(), RECORDS)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # it holds workload environment values
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cluster.backup"]  # no temporary left
    h, records = read_backup(path)
    assert h == header()
    assert records == RECORDS
    first = json.loads(path.read_bytes().split(b"\n", 1)[0])
    assert first["format"] == "kunlun-backup" and first["revision"] == 42 and len(first["sha256"]) == 64


def _refused(path: Path) -> str:
    with pytest.raises(BackupFileError) as e:
        read_backup(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}: "), msg
    return msg


def test_any_flipped_byte_is_refused_naming_the_checksum(tmp_path: Path) -> None:
    path = tmp_path / "b"
    write_backup(path, header(), RECORDS)
    data = path.read_bytes()
    body_at = data.index(b"\n") + 10
    header_at = data.index(b'"revision":42') + len('"revision":4')  # 42 -> 43: still valid JSON
    for at in (body_at, header_at):
        damaged = bytearray(data)
        damaged[at] ^= 0x01
        path.write_bytes(bytes(damaged))
        msg = _refused(path)
        assert "header.sha256" in msg and "use another copy" in msg, msg


def test_truncated_and_foreign_files_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "b"
    write_backup(path, header(), RECORDS)
    data = path.read_bytes()
    path.write_bytes(data[: data.rindex(b"\n", 0, len(data) - 1) + 1])  # last key line lost
    assert "header.sha256" in _refused(path)
    path.write_bytes(data[:100])  # the header line cut
    assert "header: no complete first line" in _refused(path)
    path.write_bytes(b"")
    assert "header: no complete first line" in _refused(path)
    path.write_bytes(b'{"format": "etcd-snapshot"}\n')
    assert "header.format: expected 'kunlun-backup'" in _refused(path)
    assert "file: cannot be read" in _refused(tmp_path / "missing")


def test_a_newer_format_names_the_release_to_use(tmp_path: Path) -> None:
    path = tmp_path / "b"
    write_backup(path, header(format_version=2, kunlun_version="0.9.0"), RECORDS)
    msg = _refused(path)
    assert "header.format_version" in msg and "release 0.9.0 or later" in msg, msg


def test_records_are_checked_even_with_a_matching_checksum(tmp_path: Path) -> None:
    """A file written with the right checksum but wrong contents (a bug, or hand-made)."""
    path = tmp_path / "b"
    outside = [*RECORDS, Record("/etc/passwd", b"x", 1, 1, 1)]
    write_backup(path, header(keys=len(outside)), outside)
    assert "line 5.key: '/etc/passwd' is outside the prefix '/kunlun/'" in _refused(path)
    twice = [*RECORDS, RECORDS[0]]
    write_backup(path, header(keys=len(twice)), twice)
    assert "appears twice" in _refused(path)
    write_backup(path, header(keys=7), RECORDS)
    assert "header.keys: says 7 keys, the file holds 3" in _refused(path)


def test_restore_keeps_the_order_and_ties_of_creation() -> None:
    """Workloads never share a transaction with a workload of another original create revision;
    everything else fills transactions of at most 128, in order of creation."""
    recs = [
        Record("/kunlun/v1/workloads/b", b"", 30, 30, 1),
        Record("/kunlun/v1/workloads/c", b"", 30, 30, 1),  # created with b: a tie to keep
        Record("/kunlun/v1/workloads/a", b"", 50, 50, 1),
        Record("/kunlun/v1/instances/b-0", b"", 31, 31, 2),
        *(Record(f"/kunlun/v1/alloc/n/x:{i:03d}", b"", 40 + i, 40 + i, 1) for i in range(130)),
    ]
    batches = creation_batches(recs, ("/kunlun/v1/workloads/",))
    assert [len(b) for b in batches] == [14, 120]  # workload a (50) opens a transaction of its own
    flat = [r for b in batches for r in b]
    assert [r.create_revision for r in flat] == sorted(r.create_revision for r in recs)
    where = {r.key: i for i, b in enumerate(batches) for r in b}
    assert (
        where["/kunlun/v1/workloads/b"] == where["/kunlun/v1/workloads/c"] < where["/kunlun/v1/workloads/a"]
    )
    # workloads created one by one: each in its own transaction, in order; the rest fill in
    one_by_one = [Record(f"/kunlun/v1/workloads/w{i:03d}", b"", 100 + i, 100 + i, 1) for i in range(5)]
    batches = creation_batches([*one_by_one, *recs[3:]], ("/kunlun/v1/workloads/",))
    where = {r.key: i for i, b in enumerate(batches) for r in b}
    assert [where[r.key] for r in one_by_one] == sorted(set(where[r.key] for r in one_by_one))
    assert len(batches) == 5 and all(len(b) <= 128 for b in batches)
    assert creation_batches([]) == []
