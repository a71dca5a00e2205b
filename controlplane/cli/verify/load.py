"""The request burst `kunlun-cli verify` sends through a gateway (like `wrk -c 32 -n 1000`).

Bounded in count and in time: `requests` requests over `concurrency` keep-alive connections, each
request with its own timeout, the whole burst stopped at `deadline_s` (what did not run is counted as
not sent). Each request is an OpenAI chat completion; with `stream` the time to the first body piece
is the first-token latency. Plain asyncio + httptools (the gateway's HTTP client lives in the gateway
package, which the control plane never imports).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import Counter
from dataclasses import dataclass, field

import httptools

from kunlun_common.i18n import _
from kunlun_common.messages import Message, msg, msg_list, plain

MIN_BURST_S = 6.0
"""The layers' bursts are spread over at least this long: tools sample about every second and the
platform shows a sample a few seconds later, so a burst of a fraction of a second could go unseen."""


@dataclass
class BurstResult:
    sent: int = 0
    not_sent: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    """HTTP status -> count; 0 is a connection error, -1 a request timeout."""
    latencies_ms: list[float] = field(default_factory=list)
    """Of the requests answered 200, in completion order."""
    first_piece_ms: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    """The first few error lines (status, body), for the evidence."""
    wall_s: float = 0.0

    @property
    def ok(self) -> int:
        return self.statuses.get(200, 0)

    @property
    def timeouts(self) -> int:
        return self.statuses.get(-1, 0)

    @property
    def error_rate(self) -> float:
        return (self.sent - self.ok) / self.sent if self.sent else 0.0

    def summary(self) -> Message:
        """What the burst did, one line (status codes as they are: `timeout`, `conn-error`, 200, ...)."""
        codes = ", ".join(
            f"{'timeout' if k == -1 else ('conn-error' if k == 0 else k)}: {v}"
            for k, v in sorted(self.statuses.items())
        )
        return msg(
            "verify.burst",
            "sent {sent} (not sent {not_sent}) in {wall_s:.1f} s; statuses {{{codes}}}; "
            "p50 {p50:.1f} ms, p95 {p95:.1f} ms, max {max:.1f} ms",
            sent=self.sent,
            not_sent=self.not_sent,
            wall_s=self.wall_s,
            codes=codes,
            p50=quantile(self.latencies_ms, 0.5),
            p95=quantile(self.latencies_ms, 0.95),
            max=max(self.latencies_ms, default=0.0),
        )

    def report(self, always_newline: bool = False) -> Message:
        """The summary, then the first error lines (as they are), one a line (`always_newline`: a
        line break after the summary also when there are none)."""
        if not self.errors and not always_newline:
            return self.summary()
        lines = [plain(e) for e in self.errors] or [plain("")]
        return msg_list("verify.burst_errors", "{parts}", [self.summary(), *lines], bullet="", sep="\n")


def quantile(values: list[float], q: float) -> float:
    """Nearest-rank quantile (0 for no values)."""
    if not values:
        return 0.0
    s = sorted(values)
    k = min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))
    return s[k]


class _Reply:
    def __init__(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.body = bytearray()
        self.first_piece: float | None = None
        self.done = False
        self.keep_alive = True

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_body(self, body: bytes) -> None:
        if self.first_piece is None:
            self.first_piece = time.monotonic()
        self.body.extend(body)

    def on_message_complete(self) -> None:
        self.done = True


class Connection:
    """One keep-alive HTTP/1.1 connection to host:port; one request at a time."""

    def __init__(self, address: str) -> None:
        self.host, port = address.rsplit(":", 1)
        self.port = int(port)
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            try:
                await self.writer.wait_closed()
            except OSError:
                pass
        self.reader = self.writer = None

    async def post(self, path: str, body: dict[str, object], headers: dict[str, str]) -> tuple[_Reply, float]:
        """POST JSON; (reply, monotonic start). Raises OSError / ConnectionError when the link fails."""
        if self.writer is None or self.reader is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        data = json.dumps(body).encode()
        head = [f"POST {path} HTTP/1.1", f"Host: {self.host}:{self.port}", "Content-Type: application/json"]
        head += [f"{k}: {v}" for k, v in headers.items()]
        head.append(f"Content-Length: {len(data)}")
        started = time.monotonic()
        self.writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + data)
        await self.writer.drain()
        reply = _Reply()
        parser = httptools.HttpResponseParser(reply)
        while not reply.done:
            chunk = await self.reader.read(65536)
            if not chunk:
                await self.close()
                raise ConnectionError(_("the gateway closed the connection before the answer was complete"))
            parser.feed_data(chunk)
        reply.status = parser.get_status_code()
        if not parser.should_keep_alive():
            await self.close()
        return reply, started


def chat_body(model: str, stream: bool = False, max_tokens: int = 8) -> dict[str, object]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "kunlun verify: say a few words"}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


async def burst(
    address: str,
    model: str,
    requests: int,
    concurrency: int,
    deadline_s: float,
    request_timeout_s: float = 10.0,
    api_key: str = "",
    stream: bool = False,
    min_duration_s: float = 0.0,
) -> BurstResult:
    """Send `requests` chat completions for `model` through the gateway at `address`; with
    `min_duration_s` request k starts no earlier than k/requests of it (spread so that a tool that
    samples every second or so sees the load)."""
    result = BurstResult()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    next_index = 0
    started = time.monotonic()
    stop_at = started + deadline_s

    async def worker() -> None:
        nonlocal next_index
        conn = Connection(address)
        try:
            while next_index < requests and time.monotonic() < stop_at:
                k = next_index
                next_index += 1
                wait = started + k * min_duration_s / requests - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(min(wait, max(0.0, stop_at - time.monotonic())))
                result.sent += 1
                budget = max(0.1, min(request_timeout_s, stop_at - time.monotonic()))
                try:
                    reply, t0 = await asyncio.wait_for(
                        conn.post("/v1/chat/completions", chat_body(model, stream), headers), budget
                    )
                except TimeoutError:
                    result.statuses[-1] += 1
                    await conn.close()
                    continue
                except (OSError, ConnectionError, httptools.HttpParserError) as e:
                    result.statuses[0] += 1
                    if len(result.errors) < 5:
                        result.errors.append(f"connection error: {e}")
                    await conn.close()
                    continue
                elapsed_ms = (time.monotonic() - t0) * 1000
                result.statuses[reply.status] += 1
                if reply.status == 200:
                    result.latencies_ms.append(elapsed_ms)
                    if reply.first_piece is not None:
                        result.first_piece_ms.append((reply.first_piece - t0) * 1000)
                elif len(result.errors) < 5:
                    result.errors.append(
                        f"HTTP {reply.status}: {bytes(reply.body[:300]).decode(errors='replace')}"
                    )
        finally:
            await conn.close()

    await asyncio.gather(*(worker() for _ in range(max(1, min(concurrency, requests)))))
    result.not_sent = requests - result.sent
    result.wall_s = time.monotonic() - started
    return result


def run_burst(
    address: str, model: str, requests: int, concurrency: int, deadline_s: float, **kw: object
) -> BurstResult:
    """`burst` from synchronous code (the CLI)."""
    return asyncio.run(burst(address, model, requests, concurrency, deadline_s, **kw))  # type: ignore[arg-type]
