"""kunlun-gateway under hostile clients: memory, answer latency and refusals, on loopback.

A real gateway process (API keys required, the default limits except a 2 s header timeout) fed by
in-memory replicas over mTLS (tests/test_gateway_support.FakeControlPlane, since a gateway gets its
keys only from the control plane). Each scenario prints the gateway's resident memory before, its
peak during the scenario (VmHWM, reset through /proc/PID/clear_refs), and what the clients got:

- flood: unauthenticated connections each pipelining POSTs of large bodies (streamed 256 KiB at a
  time, stopping at the answer, as a client would);
- oversize: a valid key announcing a 1 GiB body (413 from the head);
- slowloris: connections sending a head that never ends (408 after header_timeout_s);
- pipelined: valid-key GETs pipelined on a few connections (back-pressure, answered in order);
- rate: one key limited to 20/s with a burst of 20, sending as fast as it can for 2 s.

    .venv/bin/python -m bench.gateway_hostile [--connections 32 --pipelined 4 --body-mib 8]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path

from bench.common import pct
from devcluster.procs import ManagedProcess, free_port
from kunlun_common.api import gateway_pb2
from kunlun_common.pki import ClusterCerts, init_cluster_certs
from kunlun_common.traffic import key_hash
from tests.test_gateway_support import PY, FakeControlPlane

KEY = "kl-0b0b0b0b-bench-key-0123456789abcdefghijklmnopqrstuv"
SLOW_KEY = "kl-5105105a-bench-slow-key-0123456789abcdefghijklmnopq"


def memory_kib(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) in KiB."""
    rss = hwm = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1])
        elif line.startswith("VmHWM:"):
            hwm = int(line.split()[1])
    return rss, hwm


def reset_peak(pid: int) -> None:
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/clear_refs").write_text("5")


async def read_response(reader: asyncio.StreamReader, within_s: float) -> int:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), within_s)
    lines = head.split(b"\r\n")
    length = next(int(x.split(b":")[1]) for x in lines if x.lower().startswith(b"content-length:"))
    await asyncio.wait_for(reader.readexactly(length), within_s)
    return int(lines[0].split(b" ")[1])


def head(method: str, path: str, key: str = "", length: int = -1) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "host: bench"]
    if key:
        lines.append(f"authorization: Bearer {key}")
    if length >= 0:
        lines.append(f"content-length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


class Client:
    def __init__(self, port: int) -> None:
        self.port = port

    async def open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection("127.0.0.1", self.port)


async def flood(c: Client, connections: int, pipelined: int, body_mib: int) -> dict[str, object]:
    piece = memoryview(b"x" * (256 * 1024))
    pieces = body_mib * 4
    sent = 0
    latencies: list[float] = []

    async def one() -> int:
        nonlocal sent
        r, w = await c.open()
        t0 = time.monotonic()
        answer = asyncio.create_task(read_response(r, 60))
        try:
            with contextlib.suppress(OSError):
                for _ in range(pipelined):
                    w.write(head("POST", "/v1/chat/completions", length=body_mib * 1024 * 1024))
                    for _ in range(pieces):
                        w.write(piece)
                        sent += len(piece)
                        await asyncio.wait_for(w.drain(), 60)
                        if answer.done():
                            break
                    if answer.done():
                        break
            status = await answer
            latencies.append(time.monotonic() - t0)
            return status
        except (OSError, asyncio.IncompleteReadError):
            return 0
        finally:
            answer.cancel()
            w.close()

    statuses = Counter(await asyncio.gather(*(one() for _ in range(connections))))
    return {
        "offered_mib": connections * pipelined * body_mib,
        "sent_mib": round(sent / 2**20, 1),
        "answers": dict(statuses),
        "answer_p50_ms": round(pct(latencies, 50) * 1000, 1),
        "answer_p99_ms": round(pct(latencies, 99) * 1000, 1),
    }


async def oversize(c: Client, n: int) -> dict[str, object]:
    latencies: list[float] = []
    statuses: Counter[int] = Counter()
    for _ in range(n):
        r, w = await c.open()
        t0 = time.monotonic()
        w.write(head("POST", "/v1/chat/completions", KEY, 2**30))
        statuses[await read_response(r, 10)] += 1
        latencies.append(time.monotonic() - t0)
        w.close()
    return {"answers": dict(statuses), "answer_p50_ms": round(pct(latencies, 50) * 1000, 2)}


async def slowloris(c: Client, n: int) -> dict[str, object]:
    conns = []
    for _ in range(n):
        r, w = await c.open()
        w.write(b"GET /v1/models HTTP/1.1\r\nhost: bench\r\nx-slow: ")
        conns.append((r, w))
    t0 = time.monotonic()

    async def wait(r: asyncio.StreamReader) -> tuple[int, float]:
        try:
            return await read_response(r, 30), time.monotonic() - t0
        except (OSError, asyncio.IncompleteReadError, TimeoutError):
            return 0, time.monotonic() - t0

    got = await asyncio.gather(*(wait(r) for r, _ in conns))
    for _, w in conns:
        w.close()
    return {
        "connections": n,
        "answers": dict(Counter(s for s, _ in got)),
        "closed_after_s_p50": round(pct([t for _, t in got], 50), 2),
    }


async def pipelined(c: Client, connections: int, depth: int) -> dict[str, object]:
    async def one() -> int:
        r, w = await c.open()
        w.write(head("GET", "/v1/models", KEY) * depth)
        ok = 0
        for _ in range(depth):
            ok += await read_response(r, 30) == 200
        w.close()
        return ok

    t0 = time.monotonic()
    ok = sum(await asyncio.gather(*(one() for _ in range(connections))))
    dt = time.monotonic() - t0
    return {"requests": connections * depth, "ok": ok, "req_per_s": round(ok / dt)}


async def rate(c: Client, seconds: float) -> dict[str, object]:
    r, w = await c.open()
    statuses: Counter[int] = Counter()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        w.write(head("GET", "/v1/models", SLOW_KEY))
        statuses[await read_response(r, 10)] += 1
    w.close()
    return {"seconds": seconds, "answers": dict(statuses), "limit": "20/s, burst 20"}


async def run(args: argparse.Namespace, base: Path) -> None:
    certs = base / "certs"
    init_cluster_certs(certs, ClusterCerts(nodes=("node-a",)))
    cp = FakeControlPlane(certs, replicas=1)
    cp.start()
    cp.publish([], gateway_pb2.GatewayConfig(key_hashes=[key_hash(KEY), key_hash(SLOW_KEY)]))
    port = free_port()
    cfg = base / "gateway.yaml"
    cfg.write_text(
        f"name: gateway-1\nlisten: 127.0.0.1:{port}\nendpoints: [{cp.addresses[0]}]\ncert_dir: {certs}\n"
        "require_api_key: true\nhealth_check_interval_s: 0\nheader_timeout_s: 2\nlog_level: warning\n"
        "key_rate_limits: [{key: 5105105a, per_s: 20, burst: 20}]\n"
    )
    gw = ManagedProcess("gateway", [PY, "-m", "gateway.main", f"--config={cfg}"], base / "gateway.log")
    gw.start()
    c = Client(port)
    try:
        end = time.monotonic() + 60
        while True:
            try:
                r, w = await c.open()
                w.write(head("GET", "/v1/models", KEY))
                status = await read_response(r, 2)
                w.close()
                if status == 200:
                    break
            except (OSError, asyncio.IncompleteReadError, TimeoutError):
                pass
            if time.monotonic() > end or not gw.alive():
                raise SystemExit(f"gateway did not start: {gw.log_text()[-2000:]}")
            await asyncio.sleep(0.1)
        scenarios: list[tuple[str, Callable[[], Awaitable[dict[str, object]]]]] = [
            ("flood", lambda: flood(c, args.connections, args.pipelined, args.body_mib)),
            ("oversize", lambda: oversize(c, 50)),
            ("slowloris", lambda: slowloris(c, args.slow)),
            ("pipelined", lambda: pipelined(c, 8, 500)),
            ("rate", lambda: rate(c, 2.0)),
        ]
        print(f"{'scenario':10} {'rss_before_mib':>14} {'peak_mib':>9}  result")
        for name, scenario in scenarios:
            rss, _ = memory_kib(gw.pid)
            reset_peak(gw.pid)
            result = await scenario()
            _, peak = memory_kib(gw.pid)
            print(f"{name:10} {rss / 1024:14.1f} {peak / 1024:9.1f}  {result}", flush=True)
    finally:
        gw.stop(5)
        cp.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--connections", type=int, default=32, help="flooding connections (default 32)")
    p.add_argument("--pipelined", type=int, default=4, help="POSTs pipelined per connection (default 4)")
    p.add_argument("--body-mib", type=int, default=8, help="body size of each POST, MiB (default 8)")
    p.add_argument("--slow", type=int, default=200, help="slowloris connections (default 200)")
    args = p.parse_args()
    base = Path(tempfile.mkdtemp(prefix="kunlun-bench-hostile-"))
    try:
        asyncio.run(run(args, base))
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
