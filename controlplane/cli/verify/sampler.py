"""Utilization over time: the platform's telemetry of some devices, polled in a thread while a layer
runs (the report's per-card picture and the peaks)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from controlplane.cli.client import CliError
from controlplane.cli.verify.api import Api
from controlplane.cli.verify.load import BurstResult
from controlplane.cli.verify.model import Series
from kunlun_common.api import telemetry_pb2


class Sampler:
    """Polls `TelemetryService.DeviceMetrics` for `devices` every `interval_s` until stopped."""

    def __init__(self, api: Api, devices: list[str], interval_s: float = 0.5, flt: str = "") -> None:
        self.api = api
        self.devices = list(devices)
        self.flt = flt or "device=~" + "|".join(d.replace(".", "\\.") for d in self.devices)
        """The telemetry filter polled (default: exactly `devices`)."""
        self.last: list[telemetry_pb2.DeviceMetric] = []
        """The rows of the latest poll."""
        self.not_before_ms = 0
        """Samples the vendor tool took before this (ms since the epoch) do not count as steady."""
        self.fresh_from: dict[str, float] = {}
        """Per card: the time of its first point sampled at or after `not_before_ms`."""
        self.busiest: list[telemetry_pb2.DeviceMetric] = []
        """The rows of the poll with the highest total utilization (evidence of a burst)."""
        self.interval_s = interval_s
        self.series = {d: Series(d) for d in self.devices}
        self.errors = 0
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="verify-sampler", daemon=True)
        self.marks: list[tuple[float, str]] = []

    def __enter__(self) -> Sampler:
        self.started = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def now(self) -> float:
        return time.monotonic() - self.started

    def mark(self, what: str) -> float:
        """Note a moment (burst start/end) in the series' time base; returns it."""
        t = self.now()
        self.marks.append((t, what))
        return t

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def sample_once(self) -> None:
        try:
            rows = self.api.metrics(self.flt)
        except CliError:
            self.errors += 1
            return
        t = self.now()
        self.last = rows
        if sum(r.utilization for r in rows) > sum(r.utilization for r in self.busiest) or not self.busiest:
            self.busiest = rows
        for r in rows:
            if r.device in self.series:
                self.series[r.device].points.append((t, r.utilization * 100.0))
                if r.sampled_at_unix_ms >= self.not_before_ms and r.device not in self.fresh_from:
                    self.fresh_from[r.device] = t

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample_once()
            self._stop.wait(self.interval_s)

    def values(self, device: str, start: float = 0.0, end: float = float("inf")) -> list[float]:
        return [v for t, v in self.series[device].points if start <= t <= end]


STEADY_POINTS = 4
"""Samples in a row within STEADY_TOLERANCE of each other make a card's level steady."""
STEADY_TOLERANCE = 1.0
STEADY_MAX_S = 20.0
"""The wait for steady levels before a burst ends after this (the layer still runs)."""
AFTER_S = 6.0
"""Sampling goes on this long after a burst: telemetry shows the vendor tool's sample a few seconds
later (the agent's sampling interval, its heartbeat, the replica's view)."""


@dataclass
class SampledBurst:
    result: BurstResult
    sampler: Sampler
    start: float
    end: float
    """Burst start and end in the sampler's time base."""
    before: dict[str, float]
    """Each card's last (steady) level before the burst."""

    def window(self, device: str) -> list[float]:
        """The card's samples from the burst's start to AFTER_S after its end."""
        return self.sampler.values(device, self.start, self.end + AFTER_S)

    def peak(self, device: str) -> float:
        return max(self.window(device), default=0.0)


def _steady(sampler: Sampler) -> bool:
    for device in sampler.devices:
        if device not in sampler.fresh_from:
            return False
        last = sampler.values(device, sampler.fresh_from[device])[-STEADY_POINTS:]
        if len(last) < STEADY_POINTS or max(last) - min(last) > STEADY_TOLERANCE:
            return False
    return True


def sampled_burst(
    api: Api,
    devices: list[str],
    run: Callable[[], BurstResult],
    flt: str = "",
    during: Callable[[Sampler], None] | None = None,
    not_before_ms: int = 0,
) -> SampledBurst:
    """Sample `devices` until their levels are steady in samples the tool took at or after
    `not_before_ms` (e.g. once the engines ran), run the burst (in a thread; `during` runs
    meanwhile), sample AFTER_S more."""
    with Sampler(api, devices, flt=flt) as sampler:
        sampler.not_before_ms = not_before_ms
        deadline = time.monotonic() + STEADY_MAX_S
        while not _steady(sampler) and time.monotonic() < deadline:
            time.sleep(0.2)
        before = {d: (sampler.values(d) or [0.0])[-1] for d in devices}
        t0 = sampler.mark("burst start")
        result: list[BurstResult] = []
        thread = threading.Thread(target=lambda: result.append(run()), name="verify-burst")
        thread.start()
        if during is not None:
            during(sampler)
        thread.join()
        t1 = sampler.mark("burst end")
        time.sleep(AFTER_S)
    got = result[0] if result else BurstResult(errors=["the burst did not finish"])
    return SampledBurst(got, sampler, t0, t1, before)
