"""Run-time profiling in one process: the sampling profiler switched on and off while threads run,
its Chrome trace files (valid JSON after every write, nested complete events, start and stop
markers), the bounded ring (never more files nor bigger files than configured, oldest deleted
first), and the scheduler settings that switch it (validated; `scheduler config set KEY=VALUE`).
The whole-cluster toggle is in tests/test_telemetry_cluster.py."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from controlplane.cli.client import CliError
from controlplane.cli.scheduler_cmd import apply_fields
from controlplane.scheduler.config import SchedulerConfig, parse_scheduler_config
from devcluster.procs import wait_for
from kunlun_common.errors import ConfigError
from kunlun_common.profiling import Profiler, ProfilingMode
from kunlun_common.trace_ring import ProfileOutput, TraceRing


def read_trace(path: Path) -> list[dict[str, Any]]:
    """The events of one trace file; raises while it is not (yet) valid JSON."""
    data = json.loads(path.read_text())
    assert isinstance(data, list)
    return data


def process_files(folder: Path, process: str) -> list[Path]:
    return sorted(folder.glob(f"{process}-*.trace.json"))


def markers(events: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in events if e.get("ph") == "i" and e.get("name") == name]


def check_nesting(events: list[dict[str, Any]]) -> None:
    """Complete events of one thread nest (what Perfetto and chrome://tracing require)."""
    by_tid: dict[int, list[tuple[int, int]]] = {}
    for e in events:
        if e.get("ph") == "X":
            assert e["dur"] > 0 and isinstance(e["ts"], int)
            by_tid.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"]))
    for spans in by_tid.values():
        spans.sort(key=lambda s: (s[0], -s[1]))
        stack: list[tuple[int, int]] = []
        for start, end in spans:
            while stack and stack[-1][1] <= start:
                stack.pop()
            if stack:
                assert end <= stack[-1][1], f"slice {start}-{end} overlaps its parent {stack[-1]}"
            stack.append((start, end))


def _busy_inner(n: int) -> int:
    return sum(i * i for i in range(n))


def busy_profiled_worker(stop: threading.Event) -> None:
    while not stop.is_set():
        _busy_inner(2000)


@pytest.fixture
def worker() -> Iterator[threading.Event]:
    stop = threading.Event()
    t = threading.Thread(target=busy_profiled_worker, args=(stop,), name="busy-worker")
    t.start()
    yield stop
    stop.set()
    t.join(5)


def test_profiler_switches_on_and_off_and_writes_chrome_traces(
    tmp_path: Path, worker: threading.Event
) -> None:
    prof = Profiler(ProfileOutput(dir=str(tmp_path)), "unit.proc", flush_s=0.2)
    try:
        assert process_files(tmp_path, "unit.proc") == []  # off: nothing at all
        prof.apply(ProfilingMode(True, 10))
        wait_for(lambda: process_files(tmp_path, "unit.proc"), 5, "a trace file")
        wait_for(
            lambda: any(
                e.get("ph") == "X" and e["name"].startswith("busy_profiled_worker")
                for e in read_trace(process_files(tmp_path, "unit.proc")[-1])
            ),
            10,
            "samples of the busy worker",
        )
        prof.apply(ProfilingMode(False, 10))
        wait_for(
            lambda: markers(read_trace(process_files(tmp_path, "unit.proc")[-1]), "profiling stopped"),
            5,
            "the stop marker",
        )
        files = process_files(tmp_path, "unit.proc")
        sizes = {p: p.stat().st_size for p in files}
        events = read_trace(files[-1])
        assert events[0] == {
            "name": "process_name",
            "ph": "M",
            "pid": events[0]["pid"],
            "args": {"name": "unit.proc"},
        }
        start = markers(events, "profiling started")
        assert len(start) == 1 and start[0]["args"] == {"interval_ms": 10}
        stop_ts = markers(events, "profiling stopped")[0]["ts"]
        assert all(e.get("ts", 0) <= stop_ts for e in events)
        assert any(e["name"] == "thread_name" and e["args"]["name"] == "busy-worker" for e in events)
        check_nesting(events)
        time.sleep(0.3)  # 30 intervals of 10 ms: a profiler still running would have written
        assert {p: p.stat().st_size for p in process_files(tmp_path, "unit.proc")} == sizes
        # on again: a new file (a new session), same process
        prof.apply(ProfilingMode(True, 20))
        wait_for(lambda: len(process_files(tmp_path, "unit.proc")) == len(files) + 1, 5, "a second session")
    finally:
        prof.close()
    last = read_trace(process_files(tmp_path, "unit.proc")[-1])
    assert markers(last, "profiling started")[0]["args"] == {"interval_ms": 20}
    assert markers(last, "profiling stopped"), "close() ends the session with its marker"


def test_ring_never_exceeds_its_bound_and_deletes_oldest_first(
    tmp_path: Path, worker: threading.Event
) -> None:
    out = ProfileOutput(dir=str(tmp_path), max_files=3, max_file_bytes=4096)
    prof = Profiler(out, "ring.proc", flush_s=0.05)
    seen: set[str] = set()
    try:
        prof.apply(ProfilingMode(True, 5))
        deadline = time.monotonic() + 30
        while len(seen) < 6 and time.monotonic() < deadline:
            files = process_files(tmp_path, "ring.proc")
            assert len(files) <= 3, [p.name for p in files]
            for p in files:
                try:
                    assert p.stat().st_size <= 4096
                except FileNotFoundError:
                    pass  # deleted between the listing and the stat: the ring at work
            seen.update(p.name for p in files)
            time.sleep(0.01)
    finally:
        prof.close()
    assert len(seen) >= 6, f"the ring rolled over only {len(seen)} files in 30 s"
    files = process_files(tmp_path, "ring.proc")
    assert len(files) <= 3
    seqs = [int(p.name.split("-")[-1].split(".")[0]) for p in files]
    newest = max(int(n.split("-")[-1].split(".")[0]) for n in seen)
    assert seqs == list(range(seqs[-1] - len(seqs) + 1, seqs[-1] + 1)) and seqs[-1] >= newest, (
        "the newest files are kept, the oldest deleted"
    )
    for p in files:  # every kept file opens on its own: valid JSON, named process
        events = read_trace(p)
        assert events[0]["name"] == "process_name" and events[0]["args"]["name"] == "ring.proc"
        check_nesting(events)


def test_an_event_bigger_than_a_file_is_dropped_not_written(tmp_path: Path) -> None:
    ring = TraceRing(ProfileOutput(dir=str(tmp_path), max_files=2, max_file_bytes=4096), "drop.proc")
    ring.start()
    ring.write([{"name": "x" * 5000, "ph": "i", "ts": 1}, {"name": "small", "ph": "i", "ts": 2}])
    ring.close()
    events = read_trace(process_files(tmp_path, "drop.proc")[-1])
    assert [e["name"] for e in events] == ["small"] and ring.dropped == 1
    for p in process_files(tmp_path, "drop.proc"):
        assert p.stat().st_size <= 4096


def test_ring_settings_and_process_names_are_validated(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="max_files"):
        ProfileOutput(max_files=1)
    with pytest.raises(ConfigError, match="max_file_bytes"):
        ProfileOutput(max_file_bytes=100)
    with pytest.raises(ConfigError, match="trace process name"):
        TraceRing(ProfileOutput(dir=str(tmp_path)), "../escape")


def test_scheduler_settings_switch_profiling_and_refuse_bad_values() -> None:
    assert SchedulerConfig().advanced_profiling is False and SchedulerConfig().profiling_interval_ms == 50
    cfg = parse_scheduler_config("advanced_profiling: true\nprofiling_interval_ms: 20\n")
    assert cfg.advanced_profiling and cfg.profiling_interval_ms == 20
    with pytest.raises(ConfigError) as e:
        parse_scheduler_config("advanced_profiling: 'yes'\nprofiling_interval_ms: 0\n")
    assert "advanced_profiling: expected true or false" in str(e.value)
    assert "profiling_interval_ms: expected an integer from 5 to 60000" in str(e.value)
    with pytest.raises(ConfigError, match="did you mean 'advanced_profiling'"):
        parse_scheduler_config("advanced_profilng: true\n")


def test_config_set_fields_change_only_those_fields() -> None:
    import yaml

    text = apply_fields(
        "policy: binpack\npriority_weights: {high: 3}\n",
        ["advanced_profiling=true", "profiling_interval_ms=50", "priority_weights.low=0.5"],
    )
    assert yaml.safe_load(text) == {
        "policy": "binpack",
        "priority_weights": {"high": 3, "low": 0.5},
        "advanced_profiling": True,
        "profiling_interval_ms": 50,
    }
    with pytest.raises(CliError, match="expected KEY=VALUE"):
        apply_fields("", ["advanced_profiling"])
    with pytest.raises(CliError, match="policy is not a mapping"):
        apply_fields("policy: spread\n", ["policy.x=1"])


def test_an_unwritable_folder_is_logged_and_retried_at_the_next_switch(
    tmp_path: Path, worker: threading.Event
) -> None:
    blocker = tmp_path / "profiles"
    blocker.write_text("a file where the folder should be")
    prof = Profiler(ProfileOutput(dir=str(blocker)), "bad.proc", flush_s=0.1)
    try:
        prof.apply(ProfilingMode(True, 10))
        time.sleep(0.3)  # the thread tried, logged, and waits for the next switch (no busy retry)
        assert prof.sessions == 0 and prof._thread is not None and prof._thread.is_alive()
        blocker.unlink()  # the operator fixes the folder, then switches off and on
        prof.apply(ProfilingMode(False, 10))
        prof.apply(ProfilingMode(True, 10))
        wait_for(lambda: process_files(blocker, "bad.proc"), 5, "a trace file after the fix")
    finally:
        prof.close()
    assert markers(read_trace(process_files(blocker, "bad.proc")[-1]), "profiling stopped")


def test_agent_flags_set_the_ring(tmp_path: Path) -> None:
    from node_agent.main import build_settings

    base = ["--config", "n.yaml", "--endpoints", "127.0.0.1:1", "--cert-dir", str(tmp_path)]
    s = build_settings(
        [
            *base,
            "--profile-dir",
            str(tmp_path),
            "--profile-max-files",
            "3",
            "--profile-max-file-bytes",
            "8192",
        ]
    )
    assert s.profiling == ProfileOutput(dir=str(tmp_path), max_files=3, max_file_bytes=8192)
    with pytest.raises(ConfigError, match="max_files"):
        build_settings([*base, "--profile-max-files", "1"])
