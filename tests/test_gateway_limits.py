"""Gateway hardening against hostile clients, on a real kunlun-gateway process over raw sockets:
authentication from the head before any body byte is read, limits on the head, the URL and the
body, slow clients (408), idle keep-alive, pipelining, the connection bound, per-key rate limits,
the memory of the process under unauthenticated floods, and the checks of the settings.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from gateway.main import build_settings
from kunlun_common.api import gateway_pb2, workload_pb2
from kunlun_common.errors import ConfigError
from kunlun_common.traffic import key_hash
from tests.test_gateway_support import FakeControlPlane, GatewayProc, until

KEY_A = "kl-aaaa1111-throttled-key-0123456789abcdefghijklmnop"
KEY_B = "kl-bbbb2222-unthrottled-key-0123456789abcdefghijklmn"
GIB = 1024**3
CONFIG = """\
name: gateway-1
endpoints: [{endpoints}]
cert_dir: {cert_dir}
require_api_key: true
health_check_interval_s: 0
max_url_bytes: 1024
max_header_bytes: 4096
max_headers: 20
max_pipelined: 4
header_timeout_s: 1.5
body_timeout_s: 1.5
keepalive_timeout_s: 2.0
max_connections: 64
key_rate_limits:
  - key: aaaa1111
    per_s: 0.2
    burst: 3
"""


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gateway-limits")


@pytest.fixture(scope="module")
def cp(cert_dir: Path) -> Iterator[FakeControlPlane]:
    c = FakeControlPlane(cert_dir, replicas=1)
    c.start()
    c.publish([], gateway_pb2.GatewayConfig(key_hashes=[key_hash(KEY_A), key_hash(KEY_B)]))
    yield c
    c.close()


@pytest.fixture(scope="module")
async def gw(base: Path, cp: FakeControlPlane, cert_dir: Path) -> AsyncIterator[GatewayProc]:
    cfg = base / "gw-limits.yaml"
    cfg.write_text(CONFIG.format(endpoints=cp.addresses[0], cert_dir=cert_dir))
    g = GatewayProc(base, "gw-limits", f"--config={cfg}", key=KEY_B)
    try:
        await g.ready()
        yield g
    finally:
        g.stop()


class Raw:
    """One raw TCP connection to the gateway; reads whole responses (content-length framed)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, gw: GatewayProc) -> Raw:
        r, w = await asyncio.open_connection("127.0.0.1", gw.port)
        return cls(r, w)

    def send(self, data: bytes | memoryview) -> None:
        self.writer.write(data)

    async def response(self, within_s: float = 5.0) -> tuple[int, dict[str, str], bytes]:
        head = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), within_s)
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ")[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
        body = await asyncio.wait_for(self.reader.readexactly(int(headers["content-length"])), within_s)
        return status, headers, body

    async def closed(self, within_s: float = 5.0) -> bool:
        """True once the gateway closed the connection (EOF or reset), within the deadline."""
        try:
            return await asyncio.wait_for(self.reader.read(65536), within_s) == b""
        except (ConnectionResetError, BrokenPipeError):
            return True

    async def close(self) -> None:
        self.writer.transport.abort()  # unsent data is dropped: some tests fill the buffers
        with contextlib.suppress(OSError, TimeoutError):
            await asyncio.wait_for(self.writer.wait_closed(), 5)


def get(path: str, key: str = "", extra: str = "") -> bytes:
    auth = f"authorization: Bearer {key}\r\n" if key else ""
    return f"GET {path} HTTP/1.1\r\nhost: gw\r\n{auth}{extra}\r\n".encode()


def post_head(path: str, length: int, key: str = "") -> bytes:
    auth = f"authorization: Bearer {key}\r\n" if key else ""
    return (
        f"POST {path} HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
        f"{auth}content-length: {length}\r\n\r\n"
    ).encode()


def memory_kib(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak RSS) of a process, KiB, from /proc."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            out[name] = int(value.split()[0])
    return out


# ---------------------------------------------------------------------------- settings
def test_limits_are_checked_when_the_config_is_loaded(tmp_path: Path) -> None:
    def refused(text: str) -> str:
        cfg = tmp_path / "gw.yaml"
        cfg.write_text("static_endpoints: ['chat=127.0.0.1:9']\n" + text)
        with pytest.raises(ConfigError) as e:
            build_settings([f"--config={cfg}"])
        assert str(cfg) in str(e.value), e.value
        return str(e.value)

    assert "max_header_bytes" in refused("max_header_bytes: 100\n")
    assert "max_url_bytes" in refused("max_url_bytes: 0\n")
    assert "header_timeout_s" in refused("header_timeout_s: -1\n")
    assert "max_connections" in refused("max_connections: 0\n")
    assert "max_pipelined" in refused("max_pipelined: 0\n")
    msg = refused("require_api_key: false\nrate_limit_per_s: 5\n")
    assert "rate_limit_per_s" in msg and "require_api_key" in msg
    msg = refused("key_rate_limits: [{key: abc, per_s: -1}]\n")
    assert "key_rate_limits[0].per_s" in msg
    msg = refused("key_rate_limits: [{key: abc, rate: 1}]\n")
    assert "key_rate_limits[0]" in msg and "rate" in msg
    # production: a non-loopback address needs HTTPS and API keys, unless explicitly allowed
    msg = refused("listen: 0.0.0.0:8080\n")
    assert "listen" in msg and "tls_cert" in msg and "require_api_key" in msg
    cfg = tmp_path / "ok.yaml"
    cfg.write_text(
        "static_endpoints: ['chat=127.0.0.1:9']\nlisten: 0.0.0.0:8080\nallow_insecure_listen: true\n"
    )
    assert build_settings([f"--config={cfg}"]).allow_insecure_listen


def test_the_production_example_turns_on_https_and_keys() -> None:
    import yaml

    root = Path(__file__).resolve().parent.parent
    data = yaml.safe_load((root / "deploy/examples/gateway.example.yaml").read_text())
    assert data["tls_cert"] and data["tls_key"] and data["require_api_key"] is True
    assert not data.get("allow_insecure_listen")
    assert data["rate_limit_per_s"] > 0


# ---------------------------------------------------------------------------- auth before body
async def test_no_key_is_refused_from_the_head_without_reading_the_body(gw: GatewayProc) -> None:
    for key in ("", "kl-nope-not-a-key"):
        c = await Raw.open(gw)
        try:
            t0 = time.monotonic()
            c.send(post_head("/v1/chat/completions", GIB, key))  # a 1 GiB body announced, not sent
            status, headers, body = await c.response(within_s=3)
            assert status == 401 and b'"code":401' in body and time.monotonic() - t0 < 3
            assert headers.get("connection") == "close" and "www-authenticate" in headers
            assert await c.closed(), "the connection is closed: the body is never read"
        finally:
            await c.close()
    # a valid key announcing an oversized body gets 413 at once, also without the body being read
    c = await Raw.open(gw)
    try:
        c.send(post_head("/v1/chat/completions", GIB, KEY_B))
        status, headers, _ = await c.response(within_s=3)
        assert status == 413 and headers.get("connection") == "close"
        assert await c.closed()
    finally:
        await c.close()
    # a refused request without a body keeps its keep-alive connection
    c = await Raw.open(gw)
    try:
        c.send(get("/v1/models"))
        assert (await c.response())[0] == 401
        c.send(get("/v1/models", KEY_B))
        assert (await c.response())[0] == 200
    finally:
        await c.close()


async def test_unauthenticated_floods_leave_memory_bounded(gw: GatewayProc) -> None:
    """16 connections at once each pipeline 4 POSTs of 8 MiB without a key (512 MiB offered), as a
    client streaming its body would: 256 KiB at a time, stopping once it has an answer."""
    before = memory_kib(gw.proc.pid)
    head = post_head("/v1/chat/completions", 8 * 1024 * 1024)
    piece = memoryview(b"x" * (256 * 1024))

    async def flood() -> int:
        c = await Raw.open(gw)
        answer = asyncio.create_task(c.response(within_s=30))
        try:
            with contextlib.suppress(OSError):  # reset once the gateway stopped discarding
                for _ in range(4):
                    c.send(head)
                    for _ in range(32):
                        c.send(piece)
                        await asyncio.wait_for(c.writer.drain(), 30)
                        if answer.done():
                            break
                    if answer.done():
                        break
            status, _, _ = await answer
            return status
        except (OSError, asyncio.IncompleteReadError):
            return 0  # reset before the answer arrived
        finally:
            answer.cancel()
            await c.close()

    statuses = await asyncio.gather(*(flood() for _ in range(16)))
    assert set(statuses) <= {401, 0} and statuses.count(401) >= 12, statuses
    after = memory_kib(gw.proc.pid)
    grown_mib = (after["VmHWM"] - max(before["VmHWM"], before["VmRSS"])) / 1024
    assert grown_mib < 48, f"peak RSS grew by {grown_mib:.0f} MiB (before {before}, after {after})"
    assert (await gw.status())["api_keys"]["count"] == 2, "the gateway still serves"


# ---------------------------------------------------------------------------- head and body limits
async def test_oversized_url_head_and_headers_are_refused(gw: GatewayProc) -> None:
    cases = [
        (get("/v1/models?" + "q" * 2000, KEY_B), 414),
        (get("/v1/models", KEY_B, "x-big: " + "v" * 5000 + "\r\n"), 431),
        (get("/v1/models", KEY_B, "".join(f"x-h{i}: v\r\n" for i in range(30))), 431),
    ]
    for request, want in cases:
        c = await Raw.open(gw)
        try:
            c.send(request)
            status, headers, body = await c.response()
            assert status == want and f'"code":{want}'.encode() in body, (want, body)
            assert headers.get("connection") == "close" and await c.closed()
        finally:
            await c.close()
    # one endless header line, sent in pieces: refused once it passes the limit, not buffered
    c = await Raw.open(gw)
    answer = asyncio.create_task(c.response())
    try:
        c.send(b"GET /v1/models HTTP/1.1\r\nx-endless: ")
        with contextlib.suppress(OSError):
            for _ in range(64):
                c.send(b"v" * 1024)
                await c.writer.drain()
                if answer.done():
                    break
        status, _, _ = await answer
        assert status == 431 and await c.closed()
    finally:
        answer.cancel()
        await c.close()


async def test_chunked_body_over_the_limit_is_refused(gw: GatewayProc) -> None:
    c = await Raw.open(gw)
    answer = asyncio.create_task(c.response())
    try:
        c.send(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\nauthorization: Bearer %s\r\n"
            b"transfer-encoding: chunked\r\n\r\n" % KEY_B.encode()
        )
        chunk = b"%x\r\n%s\r\n" % (1024 * 1024, b"x" * 1024 * 1024)
        with contextlib.suppress(OSError):
            for _ in range(20):  # 20 MiB at most, the limit is 16 MiB
                c.send(chunk)
                await c.writer.drain()
                if answer.done():
                    break
        status, headers, _ = await answer
        assert status == 413 and headers.get("connection") == "close"
    finally:
        answer.cancel()
        await c.close()


# ---------------------------------------------------------------------------- slow and idle clients
async def slow_head(gw: GatewayProc) -> None:
    """slowloris: a head that never ends."""
    c = await Raw.open(gw)
    try:
        c.send(b"GET /v1/models HTTP/1.1\r\nhost: gw\r\n")
        t0 = time.monotonic()
        status, headers, _ = await c.response(within_s=10)
        assert status == 408 and headers.get("connection") == "close" and await c.closed()
        assert time.monotonic() - t0 >= 1.0
    finally:
        await c.close()


async def slow_body(gw: GatewayProc) -> None:
    """a body that never ends."""
    c = await Raw.open(gw)
    try:
        c.send(post_head("/v1/chat/completions", 100, KEY_B) + b"{")
        status, _, _ = await c.response(within_s=10)
        assert status == 408 and await c.closed()
    finally:
        await c.close()


async def idle_keepalive(gw: GatewayProc) -> None:
    """an idle keep-alive connection is closed without an answer."""
    c = await Raw.open(gw)
    try:
        c.send(get("/v1/models", KEY_B))
        assert (await c.response())[0] == 200
        t0 = time.monotonic()
        assert await c.closed(within_s=10) and time.monotonic() - t0 >= 1.5
    finally:
        await c.close()


async def silent(gw: GatewayProc) -> None:
    """a connection that never sends anything is closed too."""
    c = await Raw.open(gw)
    try:
        assert await c.closed(within_s=10)
    finally:
        await c.close()


async def test_slow_clients_get_408_and_idle_connections_close(gw: GatewayProc) -> None:
    await asyncio.gather(slow_head(gw), slow_body(gw), idle_keepalive(gw), silent(gw))


async def test_pipelined_requests_are_all_answered_in_order(gw: GatewayProc) -> None:
    c = await Raw.open(gw)
    try:
        paths = ["/v1/models", "/health", "/nope"] * 10
        c.send(b"".join(get(p, KEY_B) for p in paths))
        got = [(await c.response())[0] for _ in paths]
        assert got == [{"/v1/models": 200, "/health": 200, "/nope": 404}[p] for p in paths]
    finally:
        await c.close()


# ---------------------------------------------------------------------------- connections and rate
async def test_connections_beyond_the_bound_are_refused(gw: GatewayProc) -> None:
    """max_connections is 64: of 72 connections opened at once, the ones past it get 503."""

    async def one() -> tuple[int, bytes, Raw]:
        c = await Raw.open(gw)
        try:
            c.send(get("/v1/models", KEY_B))
            status, _, body = await c.response()
        except (OSError, asyncio.IncompleteReadError):
            status, body = 0, b""  # reset: refused before it read our request
        return status, body, c

    held = await asyncio.gather(*(one() for _ in range(72)))
    try:
        statuses = [s for s, _, _ in held]
        assert set(statuses) <= {200, 503, 0} and statuses.count(200) <= 64, statuses
        refused = [b for s, b, _ in held if s == 503]
        assert len(refused) >= 8 - statuses.count(0) and all(b"max_connections" in b for b in refused)
    finally:
        for _, _, c in held:
            await c.close()

    async def admitted() -> bool:
        c = await Raw.open(gw)
        try:
            c.send(get("/v1/models", KEY_B))
            return (await c.response())[0] == 200
        except (OSError, asyncio.IncompleteReadError):
            return False
        finally:
            await c.close()

    await until(admitted, 10, "a connection to be admitted once the others closed", 0.1)


async def test_rate_limits_are_per_key(gw: GatewayProc) -> None:
    a, b = await Raw.open(gw), await Raw.open(gw)
    try:
        for _ in range(3):  # key A's burst
            a.send(get("/v1/models", KEY_A))
            assert (await a.response())[0] == 200
        a.send(get("/v1/models", KEY_A))
        status, headers, body = await a.response()
        assert status == 429 and b'"code":429' in body and 1 <= int(headers["retry-after"]) <= 5
        for _ in range(20):  # key B has no limit of its own, and the default is none
            b.send(get("/v1/models", KEY_B))
            assert (await b.response())[0] == 200
        a.send(get("/v1/models", KEY_A))  # the keep-alive connection survives a 429 without a body
        assert (await a.response())[0] == 429
        a.send(post_head("/v1/chat/completions", 1000, KEY_A))  # with a body: answered, then closed
        status, headers, _ = await a.response()
        assert status == 429 and headers.get("connection") == "close" and await a.closed()
    finally:
        await a.close()
        await b.close()


async def test_a_connection_past_max_pipelined_is_not_read(gw: GatewayProc, cp: FakeControlPlane) -> None:
    """The first request hangs on an engine that never answers; the client keeps pipelining 1 MiB
    requests. Past max_pipelined (4) queued requests the gateway stops reading: the client's
    writes stall once the socket buffers are full, and the gateway's memory stays put."""
    engine_conns: list[asyncio.StreamWriter] = []

    async def never_answers(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        engine_conns.append(writer)
        with contextlib.suppress(OSError):
            while await reader.read(65536):
                pass

    server = await asyncio.start_server(never_answers, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    hung = workload_pb2.Endpoint(instance_id="hung-0", address=f"127.0.0.1:{port}", workload="hung", node="n")
    cp.publish([hung])
    c = await Raw.open(gw)
    try:
        await until(lambda: _serves(gw, "hung"), 10, "the gateway to route workload hung")
        before = memory_kib(gw.proc.pid)
        first = b'{"model": "hung", "messages": [{"role": "user", "content": "x"}]}'
        c.send(post_head("/v1/chat/completions", len(first), KEY_B) + first)
        await until(lambda: engine_conns, 10, "the first request to reach the engine")
        body = b"x" * (1024 * 1024)
        sent = 0
        stalled = False
        for _ in range(100):
            c.send(post_head("/v1/chat/completions", len(body), KEY_B) + body)
            try:
                await asyncio.wait_for(c.writer.drain(), 3)
            except TimeoutError:
                stalled = True
                break
            sent += 1
        after = memory_kib(gw.proc.pid)
        grown_mib = (after["VmHWM"] - max(before["VmHWM"], before["VmRSS"])) / 1024
        assert stalled and sent < 40, f"{sent} MiB were taken without a stall"
        assert grown_mib < 32, f"peak RSS grew by {grown_mib:.0f} MiB"
    finally:
        await c.close()
        cp.publish([])
        for w in engine_conns:
            w.close()
        server.close()
        await server.wait_closed()


async def _serves(gw: GatewayProc, workload: str) -> bool:
    return workload in (await gw.status())["workloads"]
