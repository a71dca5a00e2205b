"""Utilization over time: the platform's telemetry of some devices, polled in a thread while a layer
runs (the report's per-card picture and the peaks)."""

from __future__ import annotations

import threading
import time

from controlplane.cli.client import CliError
from controlplane.cli.verify.api import Api
from controlplane.cli.verify.model import Series


class Sampler:
    """Polls `TelemetryService.DeviceMetrics` for `devices` every `interval_s` until stopped."""

    def __init__(self, api: Api, devices: list[str], interval_s: float = 0.5) -> None:
        self.api = api
        self.devices = list(devices)
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
        flt = "device=~" + "|".join(d.replace(".", "\\.") for d in self.devices)
        try:
            rows = self.api.metrics(flt)
        except CliError:
            self.errors += 1
            return
        t = self.now()
        for r in rows:
            if r.device in self.series:
                self.series[r.device].points.append((t, r.utilization * 100.0))

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample_once()
            self._stop.wait(self.interval_s)

    def values(self, device: str, start: float = 0.0, end: float = float("inf")) -> list[float]:
        return [v for t, v in self.series[device].points if start <= t <= end]
