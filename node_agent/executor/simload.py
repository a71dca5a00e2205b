"""Simulated nodes only: how busy each engine keeps its chips, from the engine's own request counter.

On real hardware the vendor tool reports utilization; on a simulated node the stand-in chips' usage
is written by the executor (`manager._chip_usage`). A Running engine is shown at a base utilization,
and this adds what its traffic costs: every LOAD_POLL_S the executor reads each Running engine's
`GET /get_load` (the test engine answers `{"requests": N}`, its generation requests so far) and maps
the request rate over the last WINDOW_S onto up to EXTRA_UTILIZATION points, saturating at
SATURATING_RPS (like a vendor tool's utilization, an average over a period: a short burst stays
visible for a few samples). An engine that
does not answer in that shape (SGLang's own /get_load, a template engine) adds nothing.
"""

from __future__ import annotations

import asyncio
import json
import time

from node_agent.executor.probes import http_request

LOAD_POLL_S = 1.0
"""Seconds between two reads of the engines' counters."""
WINDOW_S = 5.0
"""The request rate is averaged over this many seconds."""
SATURATING_RPS = 40.0
"""Requests per second at which an engine's chips show the full extra utilization."""
EXTRA_UTILIZATION = 60.0
"""Utilization points a saturated engine adds on top of the Running base."""


class EngineLoad:
    """Per instance: the extra utilization its recent request rate stands for."""

    def __init__(self) -> None:
        self.extra: dict[str, float] = {}
        self._reads: dict[str, list[tuple[float, int]]] = {}

    async def _count(self, host: str, port: int) -> int | None:
        try:
            resp = await http_request(host, port, "GET", "/get_load", timeout_s=2.0)
            value = json.loads(resp.body)["requests"] if resp.status == 200 else None
        except (OSError, TimeoutError, ValueError, KeyError, TypeError, asyncio.IncompleteReadError):
            return None
        return value if isinstance(value, int) else None

    async def poll(self, engines: dict[str, tuple[str, int]]) -> bool:
        """Read every engine's counter (instance -> (host, port)); True when an extra value changed."""
        changed = False
        counts = await asyncio.gather(*(self._count(h, p) for h, p in engines.values()))
        now = time.monotonic()
        for iid, n in zip(engines, counts, strict=True):
            if n is None:
                continue
            reads = self._reads.setdefault(iid, [])
            if reads and n < reads[-1][1]:  # the engine restarted
                reads.clear()
            reads.append((now, n))
            while len(reads) > 2 and now - reads[1][0] >= WINDOW_S:
                reads.pop(0)
            if len(reads) < 2:
                continue
            (t0, n0), (t1, n1) = reads[0], reads[-1]
            rate = (n1 - n0) / max(1e-3, t1 - t0)
            extra = round(min(EXTRA_UTILIZATION, EXTRA_UTILIZATION * rate / SATURATING_RPS), 1)
            if self.extra.get(iid, 0.0) != extra:
                self.extra[iid] = extra
                changed = True
        for iid in set(self._reads) - set(engines):
            del self._reads[iid]
            changed |= self.extra.pop(iid, 0.0) != 0.0
        return changed
