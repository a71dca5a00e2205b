"""kunlun-gateway against its peers, on loopback, in one run.

The same two kunlun-test-engine backends are reached three ways: directly (the client alternates
between them), through kunlun-gateway (static endpoints, round_robin, default settings) and through
sglang-router (round_robin, default settings, --log-level warn). A lean asyncio + httptools client
with keep-alive connections measures:
- latency p50/p99 at concurrency 1 and 32, and what each proxy adds over direct;
- requests/s at concurrency 32 (and the proxy's CPU per 1000 requests);
- streaming time to first byte (SSE, 16 chunks), and what each proxy adds;
- with one backend SIGKILLed mid-run (fresh backends and proxy per run, concurrency 16): the errors
  clients saw, and how long the proxy kept sending requests to the dead backend (a listener put on
  the dead port right after the kill logs every request that still reaches it, and drops it).
Every loop is bounded by a request count or a deadline. Usage:
    python -m bench.gateway_vs_peers [--requests 20000] [--skip-router]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import httptools

from bench.common import cpu_seconds, pct
from devcluster.procs import ManagedProcess, free_port

PY = sys.executable
CHAT = json.dumps(
    {"model": "bench", "messages": [{"role": "user", "content": "hello world"}], "max_tokens": 4}
).encode()
STREAM = json.dumps({"model": "bench", "prompt": "one two three", "max_tokens": 16, "stream": True}).encode()
Addr = tuple[str, int]


def encode(path: str, body: bytes, host: str) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode() + body


class _Conn(asyncio.Protocol):
    """One keep-alive client connection; `send()` returns a future (status, body, first byte time)."""

    def __init__(self, keep_body: bool) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.fut: asyncio.Future[tuple[int, bytes, float]] | None = None
        self.keep_body = keep_body
        self.body: list[bytes] = []
        self.status = 0
        self.first = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.fut is not None and not self.fut.done():
            self.fut.set_exception(ConnectionError(f"connection lost ({exc or 'EOF'})"))

    def data_received(self, data: bytes) -> None:
        if not self.first:
            self.first = time.perf_counter()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            if self.fut is not None and not self.fut.done():
                self.fut.set_exception(ConnectionError(f"bad HTTP: {e}"))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        if self.keep_body:
            self.body.append(body)

    def on_message_complete(self) -> None:
        if self.fut is not None and not self.fut.done():
            self.fut.set_result((self.status, b"".join(self.body), self.first))

    def send(self, data: bytes) -> asyncio.Future[tuple[int, bytes, float]]:
        self.fut = asyncio.get_running_loop().create_future()
        self.body, self.first = [], 0.0
        assert self.transport is not None
        self.transport.write(data)
        return self.fut


async def connect(addr: Addr, keep_body: bool = False) -> _Conn:
    _, conn = await asyncio.get_running_loop().create_connection(lambda: _Conn(keep_body), *addr)
    return conn


@dataclass
class Result:
    latencies: list[float] = field(default_factory=list)
    ttfb: list[float] = field(default_factory=list)
    errors: int = 0
    elapsed: float = 0.0
    cpu_s: float = 0.0

    @property
    def rps(self) -> float:
        return len(self.latencies) / self.elapsed if self.elapsed else 0.0


async def load(
    addrs: list[Addr], concurrency: int, total: int, path: str, body: bytes, pid: int = 0
) -> Result:
    """`total` requests by `concurrency` workers, each on its own keep-alive connection."""
    res = Result()
    per_worker = max(1, total // concurrency)

    async def worker(i: int) -> None:
        addr = addrs[i % len(addrs)]
        data = encode(path, body, f"{addr[0]}:{addr[1]}")
        conn = await connect(addr)
        try:
            for _ in range(per_worker):
                t0 = time.perf_counter()
                try:
                    status, _, first = await conn.send(data)
                except ConnectionError:
                    res.errors += 1
                    conn = await connect(addr)
                    continue
                t1 = time.perf_counter()
                if status != 200:
                    res.errors += 1
                res.latencies.append(t1 - t0)
                res.ttfb.append(first - t0)
        finally:
            if conn.transport is not None:
                conn.transport.close()

    cpu0 = cpu_seconds(pid) if pid else 0.0
    start = time.perf_counter()
    async with asyncio.timeout(300):
        await asyncio.gather(*(worker(i) for i in range(concurrency)))
    res.elapsed = time.perf_counter() - start
    res.cpu_s = (cpu_seconds(pid) - cpu0) if pid else 0.0
    return res


# ------------------------------------------------------------------------------ processes
def start_engine(base: Path, name: str) -> tuple[ManagedProcess, Addr]:
    port = free_port()
    argv = [PY, "-m", "node_agent.testengine", "--port", str(port), "--served-model-name", name]
    p = ManagedProcess(name, argv, base / f"{name}.log")
    p.start()
    return p, ("127.0.0.1", port)


def start_gateway(
    base: Path, backends: list[Addr], name: str = "kunlun-gateway"
) -> tuple[ManagedProcess, Addr]:
    port = free_port()
    eps = ",".join(f"bench={h}:{p}" for h, p in backends)
    argv = [PY, "-m", "gateway.main", f"--listen=127.0.0.1:{port}", f"--static-endpoints={eps}"]
    argv += ["--policy=round_robin", "--log-level=warning"]
    p = ManagedProcess(name, argv, base / f"{name}.log")
    p.start()
    return p, ("127.0.0.1", port)


def start_router(
    base: Path, backends: list[Addr], name: str = "sglang-router"
) -> tuple[ManagedProcess, Addr]:
    port = free_port()
    argv = [PY, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--policy", "round_robin", "--log-level", "warn", "--worker-urls"]
    argv += [f"http://{h}:{p}" for h, p in backends]
    p = ManagedProcess(name, argv, base / f"{name}.log")
    p.start()
    return p, ("127.0.0.1", port)


async def served_by(addr: Addr, want: int, within_s: float = 60.0) -> None:
    """Wait until requests through `addr` succeed and reach `want` distinct backends."""
    seen: set[str] = set()
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        try:
            conn = await connect(addr, keep_body=True)
            try:
                for _ in range(4):
                    status, body, _ = await asyncio.wait_for(
                        conn.send(encode("/v1/chat/completions", CHAT, "x")), 5
                    )
                    if status == 200:
                        seen.add(json.loads(body)["model"])
            finally:
                if conn.transport is not None:
                    conn.transport.close()
            if len(seen) >= want:
                return
        except (OSError, ConnectionError, TimeoutError, ValueError):
            pass
        await asyncio.sleep(0.1)
    raise TimeoutError(f"{addr} did not serve from {want} backends within {within_s}s (saw {seen})")


# ------------------------------------------------------------------------------ kill run
class _Tombstone(asyncio.Protocol):
    """Listens on a dead backend's port: logs each request that still arrives, drops it."""

    def __init__(self, log: list[tuple[float, bytes]]) -> None:
        self.log = log
        self.transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.log.append((time.perf_counter(), data.split(b"\r\n", 1)[0]))
        assert self.transport is not None
        self.transport.close()


async def kill_run(
    base: Path, start_proxy: Callable[[Path, list[Addr], str], tuple[ManagedProcess, Addr]], tag: str
) -> dict[str, Any]:
    (e0, a0), (e1, a1) = start_engine(base, f"{tag}-b0"), start_engine(base, f"{tag}-b1")
    proxy, addr = start_proxy(base, [a0, a1], f"{tag}-proxy")
    tomb: asyncio.Server | None = None
    try:
        await served_by(addr, 2)
        arrivals: list[tuple[float, bytes]] = []
        outcomes: list[tuple[float, bool]] = []
        kill_at = 0.0
        start = time.perf_counter()
        deadline = start + 6.0

        async def worker() -> None:
            conn: _Conn | None = None
            data = encode("/v1/chat/completions", CHAT, f"{addr[0]}:{addr[1]}")
            while time.perf_counter() < deadline:
                t0 = time.perf_counter()
                try:
                    if conn is None or conn.transport is None:
                        conn = await connect(addr)
                    status, _, _ = await asyncio.wait_for(conn.send(data), 10)
                    outcomes.append((t0, status == 200))
                except (ConnectionError, OSError, TimeoutError):
                    outcomes.append((t0, False))
                    conn = None
            if conn is not None and conn.transport is not None:
                conn.transport.close()

        async def killer() -> None:
            nonlocal kill_at, tomb
            await asyncio.sleep(2.0)
            e1.kill()
            kill_at = time.perf_counter()
            loop = asyncio.get_running_loop()
            tomb = await loop.create_server(lambda: _Tombstone(arrivals), *a1, reuse_address=True)

        await asyncio.gather(killer(), *(worker() for _ in range(16)))
        posts = [t - kill_at for t, line in arrivals if line.startswith(b"POST")]
        return {
            "requests": len(outcomes),
            "errors": sum(1 for _, ok in outcomes if not ok),
            "errors_after_kill": sum(1 for t, ok in outcomes if not ok and t >= kill_at - 0.05),
            "requests_to_dead_backend": len(posts),
            "last_request_to_dead_backend_s": round(max(posts), 3) if posts else 0.0,
            "health_checks_to_dead_backend": len(arrivals) - len(posts),
        }
    finally:
        if tomb is not None:
            tomb.close()
        proxy.stop(5)
        e0.stop(5)
        e1.stop(5)


# ------------------------------------------------------------------------------ main
def ms(v: float) -> str:
    return f"{v * 1000:.2f}"


async def measure(base: Path, total: int, router: bool) -> dict[str, Any]:
    (e0, a0), (e1, a1) = start_engine(base, "b0"), start_engine(base, "b1")
    procs = [e0, e1]
    targets: dict[str, tuple[list[Addr], int]] = {"direct": ([a0, a1], 0)}
    try:
        gw, gaddr = start_gateway(base, [a0, a1])
        procs.append(gw)
        targets["kunlun-gateway"] = ([gaddr], gw.pid)
        if router:
            rt, raddr = start_router(base, [a0, a1])
            procs.append(rt)
            targets["sglang-router"] = ([raddr], rt.pid)
        await served_by(a0, 1)
        await served_by(a1, 1)
        for addrs, _ in targets.values():
            if len(addrs) == 1:
                await served_by(addrs[0], 2)
        out: dict[str, Any] = {}
        for name, (addrs, pid) in targets.items():
            await load(addrs, 32, 2000, "/v1/chat/completions", CHAT)  # warm-up
            c1 = await load(addrs, 1, max(500, total // 10), "/v1/chat/completions", CHAT)
            c32 = await load(addrs, 32, total, "/v1/chat/completions", CHAT, pid)
            st = await load(addrs, 1, 300, "/v1/completions", STREAM)
            out[name] = {"c1": c1, "c32": c32, "stream": st}
            print(f"  measured {name}: {c32.rps:.0f} req/s at concurrency 32", flush=True)
        return out
    finally:
        for p in procs:
            p.stop(5)


def report(out: dict[str, Any], kills: dict[str, dict[str, Any]]) -> None:
    names = list(out)
    d = out["direct"]

    def row(
        label: str,
        fn: Callable[[dict[str, Any]], float],
        added: bool = True,
        fmt: Callable[[float], str] = ms,
    ) -> None:
        cells = []
        for n in names:
            v = fn(out[n])
            cell = fmt(v)
            if added and n != "direct":
                delta = v - fn(d)
                cell += f" ({'+' if delta >= 0 else '-'}{fmt(abs(delta))})"
            cells.append(cell)
        print(f"{label:<34}" + "".join(f"{c:>22}" for c in cells))

    print(
        f"\ngateway benchmark: 2 kunlun-test-engine backends on loopback, {os.cpu_count()} CPUs, round_robin"
    )
    print(f"{'':<34}" + "".join(f"{n:>22}" for n in names))
    row("latency c=1   p50 ms", lambda r: pct(r["c1"].latencies, 50))
    row("latency c=1   p99 ms", lambda r: pct(r["c1"].latencies, 99))
    row("latency c=32  p50 ms", lambda r: pct(r["c32"].latencies, 50))
    row("latency c=32  p99 ms", lambda r: pct(r["c32"].latencies, 99))
    row("throughput c=32 req/s", lambda r: r["c32"].rps, added=False, fmt=lambda v: f"{v:.0f}")
    row(
        "proxy CPU s per 1000 req (c=32)",
        lambda r: 1000 * r["c32"].cpu_s / max(1, len(r["c32"].latencies)),
        added=False,
        fmt=lambda v: f"{v:.3f}" if v else "-",
    )
    row("stream TTFB p50 ms (16 chunks)", lambda r: pct(r["stream"].ttfb, 50))
    row("stream TTFB p99 ms", lambda r: pct(r["stream"].ttfb, 99))
    row(
        "errors (all runs above)", lambda r: r["c1"].errors + r["c32"].errors + r["stream"].errors, False, str
    )
    if kills:
        print("\none backend SIGKILLed after 2 s of a 6 s run at concurrency 16 (fresh backends and proxy):")
        for name, k in kills.items():
            print(
                f"  {name:<16} requests {k['requests']:>6}  client-visible errors {k['errors']:>4}  "
                f"requests still sent to the dead backend {k['requests_to_dead_backend']:>4}  "
                f"(last {k['last_request_to_dead_backend_s'] * 1000:.0f} ms after the kill)  "
                f"health checks to it {k['health_checks_to_dead_backend']}"
            )


async def amain(args: argparse.Namespace) -> None:
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="kunlun-bench-gw-"))
    router = not args.skip_router
    if router and importlib.util.find_spec("sglang_router") is None:
        print("sglang-router is not installed (pip install -e '.[bench]'); measuring without it")
        router = False
    print(f"logs in {base}", flush=True)
    out = await measure(base, args.requests, router)
    kills = {"kunlun-gateway": await kill_run(base, start_gateway, "kill-gw")}
    if router:
        kills["sglang-router"] = await kill_run(base, start_router, "kill-router")
    report(out, kills)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=20000, help="requests at concurrency 32 per target")
    ap.add_argument("--skip-router", action="store_true", help="leave sglang-router out")
    args = ap.parse_args()
    try:
        import uvloop

        factory: Any = uvloop.new_event_loop
    except ImportError:  # pragma: no cover
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(amain(args))


if __name__ == "__main__":
    main()
