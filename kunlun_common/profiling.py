"""Run-time profiling: a sampling profiler that any process switches on and off while it runs.

The cluster-wide switch is in the scheduler settings (`advanced_profiling`,
`profiling_interval_ms`, stored in etcd); replicas read it from their watch-fed cache and push it
to agents (on their stream) and gateways (in their config), and each process hands it to its
`Profiler.apply`. No restart: a thread that sleeps while profiling is off wakes up, samples every
interval and writes Chrome trace events into a bounded ring of files (`kunlun_common.trace_ring`).

How it samples: every `interval_ms` the thread reads every other thread's current stack
(`sys._current_frames()`, a dictionary of frames, no signal and no tracing hook), compares it with
the previous sample of that thread and turns the frames that disappeared into complete events
(`"ph": "X"`, start = the first sample that saw the frame, duration = until the first sample that
did not). Frames still running are written as slices up to each flush (every `flush_s`), so every
file holds a whole picture of its time. The event loop's thread shows the coroutine running at that
instant (or the loop waiting in its selector). The cost is one stack walk per thread per interval,
paid in the profiler's own thread (`bench/profiling_overhead.py` measures it).

Markers: an instant event `profiling started` (with the interval) opens a session and `profiling
stopped` ends it; after `stopped` the process writes nothing more until profiling is switched on
again.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import structlog
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from kunlun_common.trace_ring import ProfileOutput, TraceRing

log = structlog.get_logger("profiling")

MIN_INTERVAL_MS = 5
MAX_INTERVAL_MS = 60_000
"""Bounds of `profiling_interval_ms` (also checked where the setting is stored)."""


@dataclass(frozen=True)
class ProfilingMode:
    """The cluster-wide switch, as a process receives it."""

    enabled: bool = False
    """Whether to sample at all."""
    interval_ms: int = 50
    """Milliseconds between samples."""


def _now_us() -> int:
    return time.time_ns() // 1000


class Profiler:
    """One process's sampling profiler. `apply` is cheap and may be called from the event loop."""

    def __init__(
        self, output: ProfileOutput, process: str, flush_s: float = 1.0, max_depth: int = 64
    ) -> None:
        self.output = output
        self.process = process
        self.flush_s = flush_s
        self.max_depth = max_depth
        self.ring = TraceRing(output, process)
        self.samples = 0
        """Samples taken since the process started (all sessions)."""
        self.sessions = 0
        self.cpu_s = 0.0
        """CPU seconds the profiler's thread spent sampling and writing (its whole direct cost)."""
        self._enabled = False
        self._interval_ms = 50
        self._closed = False
        self._generation = 0
        """Bumped by every change `apply` makes (a failed session waits for the next one)."""
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._names: dict[CodeType, str] = {}
        self._named_threads: set[int] = set()
        self._pid = os.getpid()

    # ------------------------------------------------------------------ control
    @property
    def enabled(self) -> bool:
        return self._enabled

    def apply(self, mode: ProfilingMode) -> None:
        """Switch on, off, or change the interval; takes effect within one interval."""
        interval = min(max(int(mode.interval_ms), MIN_INTERVAL_MS), MAX_INTERVAL_MS)
        with self._cond:
            if self._closed or (mode.enabled == self._enabled and interval == self._interval_ms):
                return
            was = self._enabled
            self._enabled, self._interval_ms = mode.enabled, interval
            self._generation += 1
            self._cond.notify_all()
            if mode.enabled and self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kunlun-profiler", daemon=True)
                self._thread.start()
        if was != mode.enabled:
            log.info(
                "profiling switched " + ("on" if mode.enabled else "off"),
                interval_ms=interval,
                folder=str(self.ring.folder),
                process=self.process,
            )

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop for good, writing the end of the current session (blocking: call from a thread)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout_s)

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._enabled and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
            with self._cond:
                generation = self._generation
            try:
                self._session()
            except OSError as e:
                log.error(
                    "profiling stopped: cannot write traces; fix the folder, then switch profiling off and on",
                    folder=str(self.ring.folder),
                    error=str(e),
                )
                self.ring.close()
                with self._cond:  # wait for the next switch instead of failing again at once
                    while self._generation == generation and not self._closed:
                        self._cond.wait()

    def _marker(self, name: str, ts: int, **args: Any) -> dict[str, Any]:
        return {
            "name": name,
            "ph": "i",
            "s": "p",
            "ts": ts,
            "pid": self._pid,
            "tid": threading.get_ident(),
            "args": args,
        }

    def _session(self) -> None:
        self._pid = os.getpid()
        self._named_threads = set()
        self.ring.set_header(
            [{"name": "process_name", "ph": "M", "pid": self._pid, "args": {"name": self.process}}]
        )
        path = self.ring.start()
        self.sessions += 1
        self.ring.write([self._marker("profiling started", _now_us(), interval_ms=self._interval_ms)])
        log.info("profiling trace file", path=str(path))
        open_frames: dict[int, list[list[Any]]] = {}
        buf: list[dict[str, Any]] = []
        last_flush = time.monotonic()
        while True:
            with self._cond:
                if not self._enabled or self._closed:
                    break
                self._cond.wait(self._interval_ms / 1000.0)
                if not self._enabled or self._closed:
                    break
            cpu = time.thread_time()
            now = _now_us()
            self._sample(now, open_frames, buf)
            if time.monotonic() - last_flush >= self.flush_s or len(buf) >= 4096:
                self._cut(now, open_frames, buf)
                self.ring.write(buf)
                buf.clear()
                last_flush = time.monotonic()
            self.cpu_s += time.thread_time() - cpu
        end = _now_us()
        for tid, stack in open_frames.items():
            self._end(tid, stack, 0, end, buf)
        buf.append(self._marker("profiling stopped", end, samples=self.samples))
        self.ring.write(buf)
        self.ring.close()

    def _sample(self, now: int, open_frames: dict[int, list[list[Any]]], buf: list[dict[str, Any]]) -> None:
        me = threading.get_ident()
        frames = sys._current_frames()
        self.samples += 1
        for tid, frame in frames.items():
            if tid == me:
                continue
            if tid not in self._named_threads:
                self._name_thread(tid)
            codes = _stack(frame)
            if len(codes) > self.max_depth:
                codes = codes[: self.max_depth]  # keep the root side: slices stay nested
            prev = open_frames.get(tid, [])
            n = 0
            limit = min(len(prev), len(codes))
            while n < limit and prev[n][0] is codes[n]:
                n += 1
            self._end(tid, prev, n, now, buf)
            del prev[n:]
            prev.extend([code, now] for code in codes[n:])
            open_frames[tid] = prev
        for tid in [t for t in open_frames if t not in frames]:
            self._end(tid, open_frames.pop(tid), 0, now, buf)

    def _end(self, tid: int, stack: list[list[Any]], keep: int, now: int, buf: list[dict[str, Any]]) -> None:
        """Complete events for the frames of `stack` above depth `keep` (innermost first)."""
        for code, start in reversed(stack[keep:]):
            buf.append(
                {
                    "name": self._name(code),
                    "cat": "sample",
                    "ph": "X",
                    "ts": start,
                    "dur": max(now - start, 1),
                    "pid": self._pid,
                    "tid": tid,
                }
            )

    def _cut(self, now: int, open_frames: dict[int, list[list[Any]]], buf: list[dict[str, Any]]) -> None:
        """Write frames still running as slices up to `now` and continue them from `now`."""
        for tid, stack in open_frames.items():
            self._end(tid, stack, 0, now, buf)
            for entry in stack:
                entry[1] = now

    def _name(self, code: CodeType) -> str:
        name = self._names.get(code)
        if name is None:
            name = f"{code.co_qualname} ({Path(code.co_filename).name}:{code.co_firstlineno})"
            self._names[code] = name
        return name

    def _name_thread(self, tid: int) -> None:
        self._named_threads.add(tid)
        names = {t.ident: t.name for t in threading.enumerate()}
        self.ring.add_header(
            {
                "name": "thread_name",
                "ph": "M",
                "pid": self._pid,
                "tid": tid,
                "args": {"name": names.get(tid, f"thread-{tid}")},
            }
        )


def _stack(frame: FrameType | None) -> list[CodeType]:
    """The code objects of a thread's stack, outermost first."""
    codes = []
    while frame is not None:
        codes.append(frame.f_code)
        frame = frame.f_back
    codes.reverse()
    return codes


class ProfilerCollector(Collector):
    """The profiler's state and its own cost, on the process's exporter (no labels: one per process)."""

    def __init__(self, profiler: Profiler) -> None:
        self.profiler = profiler

    def collect(self) -> Iterator[Metric]:
        p = self.profiler
        on = GaugeMetricFamily("kunlun_profiling_enabled", "1 while run-time profiling samples this process")
        on.add_metric([], 1.0 if p.enabled else 0.0)
        yield on
        cpu = CounterMetricFamily(
            "kunlun_profiling_cpu_seconds",
            "CPU time the profiler's thread spent sampling stacks and writing traces",
        )
        cpu.add_metric([], p.cpu_s)
        yield cpu
        samples = CounterMetricFamily("kunlun_profiling_samples", "Stack samples taken by the profiler")
        samples.add_metric([], float(p.samples))
        yield samples
