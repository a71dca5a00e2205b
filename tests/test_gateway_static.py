"""kunlun-gateway without a control plane (static endpoints): active health checks, HTTPS, HTTP
edge cases (pipelining, HTTP/1.0, 100-continue, oversized bodies) and the sglang-router sync.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from devcluster.procs import ManagedProcess, free_port
from gateway.httpclient import HttpConnection, HttpError, fetch
from kunlun_common.pki import paths_for
from tests.test_gateway_support import Engine, GatewayProc, post, start_engines, until


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gateway-static")


@pytest.fixture(scope="module")
async def engines(base: Path) -> AsyncIterator[list[Engine]]:
    es = await start_engines(base, ["s0", "s1"])
    yield es
    for e in es:
        e.stop()


def static(workload: str, engines: list[Engine]) -> str:
    return "--static-endpoints=" + ",".join(f"{workload}={e.address}" for e in engines)


async def test_active_health_check_ejects_a_hung_engine(base: Path) -> None:
    h0, h1 = await start_engines(base, ["h0", "h1"])
    g = GatewayProc(
        base, "gw-health", static("hc", [h0, h1]), "--health-interval=0.2", "--health-timeout=0.3"
    )
    try:
        await g.ready()
        h1.proc.pause()  # SIGSTOP: the port still accepts connections, nothing answers

        async def ejected(flag: bool) -> bool:
            inst = {i["instance_id"]: i for i in (await g.status())["workloads"]["hc"]["instances"]}
            return bool(inst["hc-1"]["ejected"] is flag)

        await until(lambda: ejected(True), 3, "the hung instance to be ejected")
        conn = g.connect()
        try:
            for _ in range(6):
                t0 = time.monotonic()
                r = await post(conn, "/v1/completions", b'{"model": "hc", "prompt": "x"}')
                assert r.status == 200 and r.json()["model"] == "h0" and time.monotonic() - t0 < 0.5
        finally:
            await conn.close()
        h1.proc.resume()
        await until(lambda: ejected(False), 3, "the instance to come back")
    finally:
        g.stop()
        h0.stop()
        h1.stop()


async def test_https_on_the_client_side(base: Path, cert_dir: Path, engines: list[Engine]) -> None:
    p = paths_for(cert_dir, "gateway", "gateway-2")
    ctx = ssl.create_default_context(cafile=str(p.ca))
    g = GatewayProc(
        base, "gw-tls", static("tls", engines), f"--tls-cert={p.cert}", f"--tls-key={p.key}", tls=ctx
    )
    try:
        await g.ready()
        conn = g.connect()
        try:
            r = await post(
                conn,
                "/v1/chat/completions",
                b'{"model": "tls", "messages": [{"role": "user", "content": "hi"}]}',
            )
            assert r.status == 200 and r.json()["object"] == "chat.completion"
        finally:
            await conn.close()
        plain = HttpConnection("127.0.0.1", g.port)
        try:
            with pytest.raises(HttpError):  # never a plaintext answer
                await plain.request("GET", "/health", timeout_s=2)
        finally:
            await plain.close()
    finally:
        g.stop()


async def test_http_edge_cases(base: Path, engines: list[Engine]) -> None:
    g = GatewayProc(base, "gw-http", static("edge", engines))
    try:
        await g.ready()
        reader, writer = await asyncio.open_connection("127.0.0.1", g.port)
        try:
            body = b'{"model": "edge", "prompt": "p q", "max_tokens": 1}'
            one = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s" % (
                len(body),
                body,
            )
            writer.write(one * 3)  # pipelined: three answers, in order
            for _ in range(3):
                head = await reader.readuntil(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 200")
                length = int(
                    next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")).split(
                        b":"
                    )[1]
                )
                assert json.loads(await reader.readexactly(length))["choices"][0]["text"] == "p"
            # 100-continue is answered before the body is sent
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\ncontent-length: %d\r\n\r\n"
                % len(body)
            )
            assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 100 Continue")
            writer.write(body)
            assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
        finally:
            writer.close()
        # HTTP/1.0: answered and closed
        reader, writer = await asyncio.open_connection("127.0.0.1", g.port)
        writer.write(b"POST /v1/completions HTTP/1.0\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        data = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        assert data.startswith(b"HTTP/1.") and b" 200 " in data.split(b"\r\n")[0] and data.endswith(b"}")
        # malformed HTTP and oversized bodies: JSON errors, never a hang
        r = await fetch(
            "127.0.0.1", g.port, "POST", "/v1/completions", b"x" * (17 * 1024 * 1024), timeout_s=10
        )
        assert r.status == 413 and r.json()["error"]["code"] == 413
        reader, writer = await asyncio.open_connection("127.0.0.1", g.port)
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        data = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        assert data.startswith(b"HTTP/1.1 400") and b'"code":400' in data
    finally:
        g.stop()


async def test_sglang_router_is_kept_in_sync(base: Path, engines: list[Engine]) -> None:
    pytest.importorskip("sglang_router")
    port = free_port()
    router = ManagedProcess(
        "sglang-router",
        [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port)],
        base / "sglang-router.log",
    )
    router.start()
    g: GatewayProc | None = None
    try:

        async def workers() -> set[str]:
            r = await fetch("127.0.0.1", port, "GET", "/workers", timeout_s=2)
            return {str(w["url"]) for w in r.json()["workers"]}

        async def up() -> bool:
            return isinstance(await workers(), set)

        await until(up, 30, "the router to answer", 0.1)
        # a worker that is not ours: the gateway removes it
        await fetch(
            "127.0.0.1",
            port,
            "POST",
            "/workers",
            json.dumps({"url": f"http://{engines[1].address}"}).encode(),
            {"content-type": "application/json"},
        )
        await until(
            lambda: _has(workers, f"http://{engines[1].address}"), 20, "the foreign worker listed", 0.1
        )
        g = GatewayProc(
            base, "gw-sync", static("sync", engines[:1]), f"--sglang-router=http://127.0.0.1:{port}"
        )
        await g.ready()

        async def synced() -> bool:
            return await workers() == {f"http://{engines[0].address}"}

        await until(synced, 20, "the router to list exactly our instances", 0.1)
        conn = HttpConnection("127.0.0.1", port)
        try:
            r = await post(conn, "/v1/completions", b'{"model": "sync", "prompt": "a"}')
        finally:
            await conn.close()
        assert r.status == 200 and r.json()["model"] == "s0"
        assert (await g.status())["router_sync"]["last_error"] == ""
    finally:
        if g is not None:
            g.stop()
        router.stop()


async def _has(workers: Callable[[], Awaitable[set[str]]], url: str) -> bool:
    return url in await workers()


class _OneRequestPerConnection(asyncio.Protocol):
    """An engine that answers the first request of a connection and drops the connection on the
    second without answering (like a keep-alive timeout that fires as the gateway reuses it)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.seen = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        self.seen += 1
        if self.seen > 1:
            self.transport.close()
            return
        body = b'{"model": "flaky", "choices": []}'
        self.transport.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
            % (len(body), body)
        )


async def test_stale_keep_alive_connection_is_retried_on_a_new_one(base: Path) -> None:
    port = free_port()
    server = await asyncio.get_running_loop().create_server(_OneRequestPerConnection, "127.0.0.1", port)
    g = GatewayProc(base, "gw-stale", f"--static-endpoints=flaky=127.0.0.1:{port}", "--health-interval=0")
    try:
        await g.ready()
        conn = g.connect()
        try:
            for _ in range(5):  # one instance only: no other instance to retry on
                r = await post(conn, "/v1/completions", b'{"model": "flaky", "prompt": "x"}')
                assert r.status == 200, r.body
        finally:
            await conn.close()
        inst = (await g.status())["workloads"]["flaky"]["instances"][0]
        assert not inst["ejected"] and inst["failures"] == 0, inst
    finally:
        g.stop()
        server.close()
