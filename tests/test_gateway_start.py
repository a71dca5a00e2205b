"""A (re)starting gateway listens only once the control plane has fed it: during a rolling upgrade a
restarted gateway must not answer 503 "no endpoint snapshot yet" while its peers serve. Bounded: with
no control plane it listens after `start_sync_s` anyway (and says why it cannot route)."""

from __future__ import annotations

import asyncio
import signal
import socket
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from kunlun_common.api import gateway_pb2, workload_pb2
from kunlun_common.traffic import key_hash
from tests.test_gateway_support import Engine, FakeControlPlane, GatewayProc, post, start_engines

KEY = "kl-test-start-0123456789abcdefghijklmnopqrstuvwxyz012345"
AUTH = {"authorization": f"Bearer {KEY}"}
BODY = b'{"model": "chat", "prompt": "hi"}'


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gateway-start")


@pytest.fixture(scope="module")
async def engine(base: Path) -> AsyncIterator[Engine]:
    (e,) = await start_engines(base, ["c0"])
    yield e
    e.stop()


@pytest.fixture(scope="module")
def cp(cert_dir: Path, engine: Engine) -> Iterator[FakeControlPlane]:
    c = FakeControlPlane(cert_dir, replicas=1)
    c.start()
    c.publish(
        [workload_pb2.Endpoint(instance_id="chat-0", address=engine.address, workload="chat")],
        gateway_pb2.GatewayConfig(key_hashes=[key_hash(KEY)]),
    )
    yield c
    c.close()


def first_accept(port: int, within_s: float) -> float:
    """Seconds until 127.0.0.1:port first accepts a connection (polled every 2 ms)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < within_s:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return time.monotonic() - t0
        except OSError:
            time.sleep(0.002)
    raise AssertionError(f"nothing listened on {port} within {within_s} s")


async def test_the_first_request_a_starting_gateway_accepts_is_served(
    base: Path, cp: FakeControlPlane, cert_dir: Path
) -> None:
    gw = GatewayProc(
        base, "gateway-1", "--name=gateway-1", f"--endpoints={','.join(cp.addresses)}",
        f"--cert-dir={cert_dir}", "--require-api-key", "--health-interval=0",
    )  # fmt: skip
    try:
        await asyncio.to_thread(first_accept, gw.port, 30)
        conn = gw.connect()
        try:
            r = await post(conn, "/v1/completions", BODY, AUTH)
            assert r.status == 200, r.body
        finally:
            await conn.close()
    finally:
        gw.stop()


async def test_without_a_control_plane_it_listens_after_start_sync_s(base: Path, cert_dir: Path) -> None:
    cfg = base / "gw2.yaml"
    cfg.write_text("start_sync_s: 1.5\n")
    gone = FakeControlPlane(cert_dir, replicas=1).addresses[0]  # never started: nothing answers
    gw = GatewayProc(
        base, "gateway-2", f"--config={cfg}", "--name=gateway-2", f"--endpoints={gone}",
        f"--cert-dir={cert_dir}", "--require-api-key", "--health-interval=0",
    )  # fmt: skip
    try:
        waited = await asyncio.to_thread(first_accept, gw.port, 30)
        assert waited >= 1.0, f"listened after {waited:.2f} s, before start_sync_s"
        conn = gw.connect()
        try:
            r = await post(conn, "/v1/completions", BODY, AUTH)
            assert r.status == 503, r.body
        finally:
            await conn.close()
        assert "listening without" in gw.proc.log_text()
    finally:
        gw.stop()


async def test_sigterm_drains_requests_in_flight_and_refuses_new_connections(
    base: Path, cert_dir: Path, cp: FakeControlPlane
) -> None:
    """What a rolling upgrade relies on: a stopping gateway finishes what it accepted (the client
    gets its answer) while new connections are refused at once, so clients go to another gateway."""
    (slow,) = await start_engines(base, ["slow"], "--latency-ms", "1500", tcp_only=True)
    cp.publish([workload_pb2.Endpoint(instance_id="slow-0", address=slow.address, workload="slow")])
    gw = GatewayProc(
        base, "gateway-3", "--name=gateway-3", f"--endpoints={','.join(cp.addresses)}",
        f"--cert-dir={cert_dir}", "--require-api-key", "--health-interval=0",
    )  # fmt: skip
    try:
        await asyncio.to_thread(first_accept, gw.port, 30)
        conn = gw.connect()
        try:
            body = b'{"model": "slow", "prompt": "hi"}'
            inflight = asyncio.create_task(post(conn, "/v1/completions", body, AUTH))
            await asyncio.sleep(0.5)  # the request is at the engine (1.5 s latency)
            assert not inflight.done()
            gw.proc.signal(signal.SIGTERM)

            def refused() -> bool:
                try:
                    socket.create_connection(("127.0.0.1", gw.port), timeout=0.5).close()
                    return False
                except ConnectionRefusedError:
                    return True

            t0 = time.monotonic()
            while not await asyncio.to_thread(refused):
                assert time.monotonic() - t0 < 5, "new connections still accepted while draining"
                await asyncio.sleep(0.02)
            assert not inflight.done(), "refusing new connections came before the answer in flight"
            r = await inflight
            assert r.status == 200, r.body
        finally:
            await conn.close()
        assert gw.proc.wait(15) == 0
    finally:
        gw.stop()
        slow.stop()
        cp.publish([workload_pb2.Endpoint(instance_id="chat-0", address="127.0.0.1:1", workload="chat")])
