"""kunlun-gateway as a real process, fed by fake replicas (mTLS gRPC, in a thread), in front of real
kunlun-test-engine processes: routing, removal on push, failures under load, errors, the OpenAI SDK,
streaming, timeouts and the feed's failover. Waits are deadlines on observed state, never sleeps.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.httpclient import HttpConnection, Response
from kunlun_common.api import gateway_pb2
from kunlun_common.traffic import key_hash
from tests.test_gateway_support import Engine, FakeControlPlane, GatewayProc, post, start_engines, until

KEY = "kl-test-0123456789abcdefghijklmnopqrstuvwxyz"
AUTH = {"authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gateway")


@pytest.fixture(scope="module")
def cp(cert_dir: Path) -> Iterator[FakeControlPlane]:
    c = FakeControlPlane(cert_dir, replicas=2)
    c.start()
    c.publish([], gateway_pb2.GatewayConfig(key_hashes=[key_hash(KEY)]))
    yield c
    c.close()


@pytest.fixture(scope="module")
async def engines(base: Path) -> AsyncIterator[list[Engine]]:
    es = await start_engines(base, ["e0", "e1", "e2"])
    yield es
    for e in es:
        e.stop()


@pytest.fixture(scope="module")
async def gw(base: Path, cp: FakeControlPlane, cert_dir: Path) -> AsyncIterator[GatewayProc]:
    config = base / "gateway-1.yaml"
    config.write_text("access_log_sample: 1.0\n")  # every request in the access log (default 1 %)
    g = GatewayProc(
        base,
        "gateway-1",
        f"--config={config}",
        "--name=gateway-1",
        f"--endpoints={','.join(cp.addresses)}",
        f"--cert-dir={cert_dir}",
        "--require-api-key",
        "--health-interval=0",
        "--request-timeout=1",
        key=KEY,
    )
    await g.ready()
    yield g
    g.stop()


async def publish(
    gw: GatewayProc,
    cp: FakeControlPlane,
    workloads: dict[str, list[Engine]],
    policies: dict[str, str] | None = None,
    states: list[gateway_pb2.WorkloadRouteState] | None = None,
    keys: tuple[str, ...] = (KEY,),
) -> int:
    """Publish a snapshot and config; return once the gateway applied both."""
    cfg = gateway_pb2.GatewayConfig(
        key_hashes=[key_hash(k) for k in keys],
        policies=[gateway_pb2.RoutingPolicy(workload=w, policy=p) for w, p in (policies or {}).items()],
        workloads=states or [],
    )
    version = cp.publish([e.endpoint(w) for w, es in workloads.items() for e in es], cfg)

    async def applied() -> bool:
        feed = (await gw.status())["feed"]
        return bool(feed["revision"] >= version and feed["config_revision"] >= version)

    await until(applied, 5, f"the gateway to apply version {version}")
    return version


def chat_body(model: str, text: str = "hello world", **kw: Any) -> bytes:
    return json.dumps(
        {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 2, **kw}
    ).encode()


async def chat(conn: HttpConnection, model: str, text: str = "hello world", **headers: str) -> Response:
    return await post(conn, "/v1/chat/completions", chat_body(model, text), {**AUTH, **headers})


def served_by(r: Response) -> str:
    assert r.status == 200, r.body
    return str(r.json()["model"])


def connect(gw: GatewayProc) -> HttpConnection:
    return HttpConnection("127.0.0.1", gw.port)


async def test_round_robin_spreads_evenly(
    gw: GatewayProc, cp: FakeControlPlane, engines: list[Engine]
) -> None:
    await publish(gw, cp, {"rr": engines})
    conn = connect(gw)
    try:
        got = Counter([served_by(await chat(conn, "rr")) for _ in range(30)])
    finally:
        await conn.close()
    assert got == {"e0": 10, "e1": 10, "e2": 10}


async def test_least_outstanding_sends_little_to_the_slow_instance(
    base: Path, gw: GatewayProc, cp: FakeControlPlane, engines: list[Engine]
) -> None:
    (slow,) = await start_engines(base, ["lo-slow"], "--latency-ms=200")
    try:
        await publish(gw, cp, {"lo": [slow, engines[0]]}, policies={"lo": "least_outstanding"})
        got: Counter[str] = Counter()

        async def worker() -> None:
            conn = connect(gw)
            try:
                for _ in range(8):
                    got[served_by(await chat(conn, "lo"))] += 1
            finally:
                await conn.close()

        await asyncio.gather(*(worker() for _ in range(8)))
        assert sum(got.values()) == 64
        assert got["lo-slow"] <= 64 // 4, got  # round robin would send it 32
    finally:
        slow.stop()


async def test_prefix_affinity_keeps_a_prefix_on_one_instance_until_overloaded(
    base: Path, gw: GatewayProc, cp: FakeControlPlane
) -> None:
    es = await start_engines(base, ["pa0", "pa1", "pa2"], "--latency-ms=100")
    try:
        await publish(gw, cp, {"pa": es}, policies={"pa": "prefix_affinity"})
        conn = connect(gw)
        try:
            same = {served_by(await chat(conn, "pa", "a long shared system prompt")) for _ in range(6)}
            assert len(same) == 1
            sessions = {
                served_by(await chat(conn, "pa", f"turn {i}", **{"x-session-id": "s-42"})) for i in range(4)
            }
            assert len(sessions) == 1
            prompts = {served_by(await chat(conn, "pa", f"prompt number {i}")) for i in range(12)}
            assert len(prompts) >= 2  # different prefixes land on different instances
        finally:
            await conn.close()
        (home,) = same

        async def one() -> str:
            c = connect(gw)
            try:
                return served_by(await chat(c, "pa", "a long shared system prompt"))
            finally:
                await c.close()

        burst = Counter(await asyncio.gather(*(one() for _ in range(9))))
        assert len(burst) >= 2, burst  # bounded load: the home instance sheds when it is full
        assert burst[home] == max(burst.values()), burst
    finally:
        for e in es:
            e.stop()


async def test_instance_removed_from_the_snapshot_stops_receiving_at_once(
    gw: GatewayProc, cp: FakeControlPlane, engines: list[Engine]
) -> None:
    e0, e1, _ = engines
    await publish(gw, cp, {"rm": [e0, e1]})
    log: list[tuple[float, str]] = []
    stop = asyncio.Event()

    async def loop() -> None:
        conn = connect(gw)
        try:
            while not stop.is_set():
                t = time.monotonic()
                log.append((t, served_by(await chat(conn, "rm"))))
        finally:
            await conn.close()

    task = asyncio.create_task(loop())
    try:
        await until(lambda: len(log) >= 20, 10, "traffic on both instances")
        t0 = time.monotonic()
        cp.publish([e0.endpoint("rm")])
        await until(lambda: sum(1 for t, _ in log if t > t0) >= 50, 10, "50 requests after the removal")
    finally:
        stop.set()
        await task
    assert {s for _, s in log if s == "e1"}, "e1 never served before its removal"
    late = [t - t0 for t, s in log if s == "e1" and t > t0]
    assert not late or max(late) < 0.25, f"e1 still got requests {late} s after it left the snapshot"


async def test_killed_backend_under_load_fails_no_request(
    base: Path, gw: GatewayProc, cp: FakeControlPlane
) -> None:
    k0, k1 = await start_engines(base, ["k0", "k1"], "--latency-ms=5")
    await publish(gw, cp, {"kill": [k0, k1]})
    done: list[tuple[float, str]] = []
    failures: list[str] = []
    killed_at = 0.0

    async def worker() -> None:
        conn = connect(gw)
        try:
            while len(done) < 1200:
                started = time.monotonic()
                r = await post(
                    conn, "/v1/completions", b'{"model":"kill","prompt":"x y","max_tokens":2}', AUTH
                )
                if r.status != 200:
                    failures.append(f"{r.status} {r.body[:200]!r}")
                else:
                    done.append((started, str(r.json()["model"])))
        finally:
            await conn.close()

    async def killer() -> None:
        nonlocal killed_at
        await until(lambda: len(done) >= 300, 20, "load to build up")
        k1.proc.kill()  # SIGKILL, and reaped: from here on nothing can answer as k1
        killed_at = time.monotonic()

    try:
        await asyncio.gather(killer(), *(worker() for _ in range(16)))
    finally:
        k0.stop()
        k1.stop()
    assert failures == [], failures[:5]
    after = [t - killed_at for t, s in done if s == "k1" and t > killed_at]
    assert not after, f"k1 answered requests sent after it was killed: {after[:5]}"
    inst = {i["instance_id"]: i for i in (await gw.status())["workloads"]["kill"]["instances"]}
    assert inst["k1"]["ejected"] and inst["k0"]["requests"] > 300, inst


async def test_errors_are_clear_json(gw: GatewayProc, cp: FakeControlPlane, engines: list[Engine]) -> None:
    other = "kl-second-key-0123456789abcdefghijklmnop"
    pending = gateway_pb2.WorkloadRouteState(
        name="later", phase="Pending", replicas=1, reason="1 Pending (no node has 2 free ascend devices)"
    )
    await publish(gw, cp, {"ok": engines[:1]}, states=[pending], keys=(KEY, other))
    conn = connect(gw)

    async def call(path: str, body: bytes, headers: dict[str, str], method: str = "POST") -> tuple[int, str]:
        r = await conn.request(method, path, body, headers, timeout_s=5)
        assert r.headers["content-type"] == "application/json", r.headers
        err = r.json()["error"]
        assert err["code"] == r.status and isinstance(err["message"], str) and err["type"]
        return r.status, str(err["message"])

    try:
        assert (await call("/v1/chat/completions", b'{"model": "ok", ', AUTH))[0] == 400
        assert (await call("/v1/chat/completions", b"[1, 2]", AUTH))[0] == 400
        status, msg = await call("/v1/chat/completions", chat_body("ok"), {})
        assert status == 401 and "missing API key" in msg
        status, msg = await call("/v1/chat/completions", chat_body("ok"), {"authorization": "Bearer nope"})
        assert status == 401 and "invalid or revoked" in msg
        assert (await chat(conn, "ok", authorization=f"Bearer {other}")).status == 200
        await publish(gw, cp, {"ok": engines[:1]}, states=[pending], keys=(KEY,))  # `other` revoked
        status, msg = await call(
            "/v1/chat/completions", chat_body("ok"), {"authorization": f"Bearer {other}"}
        )
        assert status == 401 and "revoked" in msg
        status, msg = await call("/v1/chat/completions", chat_body("nosuch"), AUTH)
        assert status == 404 and "'nosuch' not found" in msg and "ok" in msg
        status, msg = await call("/v1/completions", b'{"model": "later", "prompt": "hi"}', AUTH)
        assert status == 503 and "'later'" in msg and "no node has 2 free ascend devices" in msg
        assert (await call("/v1/nothing", b"{}", AUTH))[0] == 404
        assert (await call("/v1/chat/completions", b"", AUTH, method="GET"))[0] == 405
        assert (await call("/v1/models", b"", {}, method="GET"))[0] == 401
    finally:
        await conn.close()


async def test_openai_sdk_works_unchanged(
    gw: GatewayProc, cp: FakeControlPlane, engines: list[Engine]
) -> None:
    import openai

    await publish(gw, cp, {"chat": engines})
    client = openai.AsyncOpenAI(base_url=f"http://{gw.address}/v1", api_key=KEY, max_retries=0)
    try:
        models = [m.id async for m in client.models.list()]
        assert models == ["chat"]
        resp = await client.chat.completions.create(
            model="chat", messages=[{"role": "user", "content": "hello there"}], max_tokens=3
        )
        assert resp.choices[0].message.content == "hello there hello"
        stream = await client.chat.completions.create(
            model="chat", messages=[{"role": "user", "content": "one two"}], max_tokens=4, stream=True
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert text == "one two one two"
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="missing", messages=[{"role": "user", "content": "x"}])
        bad = openai.AsyncOpenAI(base_url=f"http://{gw.address}/v1", api_key="wrong", max_retries=0)
        try:
            with pytest.raises(openai.AuthenticationError):
                await bad.chat.completions.create(model="chat", messages=[{"role": "user", "content": "x"}])
        finally:
            await bad.close()
    finally:
        await client.close()


async def test_streaming_passes_chunks_through_as_they_come(
    base: Path, gw: GatewayProc, cp: FakeControlPlane
) -> None:
    (slow,) = await start_engines(base, ["st0"], "--inter-token-ms=150")
    try:
        await publish(gw, cp, {"stream": [slow]})
        conn = connect(gw)
        try:
            t0 = time.monotonic()
            body = b'{"model": "stream", "prompt": "a b c d", "max_tokens": 4, "stream": true}'
            resp, pieces = await conn.stream(
                "POST", "/v1/completions", body, {**AUTH, "content-type": "application/json"}
            )
            assert resp.status == 200 and resp.headers["content-type"] == "text/event-stream"
            arrivals = [(time.monotonic() - t0, p) async for p in pieces]
        finally:
            await conn.close()
        events = b"".join(p for _, p in arrivals).split(b"\n\n")
        assert events[-2] == b"data: [DONE]" and len(events) == 7
        first, last = arrivals[0][0], arrivals[-1][0]
        assert len(arrivals) >= 5 and first < 0.3 and last - first > 0.5, [round(t, 3) for t, _ in arrivals]
    finally:
        slow.stop()


async def test_engine_that_does_not_answer_gives_504(
    base: Path, gw: GatewayProc, cp: FakeControlPlane
) -> None:
    (slow,) = await start_engines(base, ["to0"], "--latency-ms=5000", tcp_only=True)
    try:
        await publish(gw, cp, {"slowpoke": [slow]})
        conn = connect(gw)
        try:
            t0 = time.monotonic()
            r = await chat(conn, "slowpoke")
            elapsed = time.monotonic() - t0
        finally:
            await conn.close()
        assert r.status == 504 and "did not answer within 1s" in r.json()["error"]["message"]
        assert 0.9 < elapsed < 3.0
    finally:
        slow.stop()


async def test_feed_fails_over_between_replicas(
    gw: GatewayProc, cp: FakeControlPlane, engines: list[Engine]
) -> None:
    await publish(gw, cp, {"fo": engines[:1]})
    feed = (await gw.status())["feed"]
    i = cp.addresses.index(feed["connected_to"])
    sessions = feed["sessions"]
    cp.kill(i)
    try:
        t0 = time.monotonic()
        version = cp.publish([e.endpoint("fo") for e in engines[:2]])

        async def followed() -> bool:
            f = (await gw.status())["feed"]
            return bool(f["revision"] >= version and f["connected_to"] == cp.addresses[1 - i])

        await until(followed, 10, "the gateway to follow the other replica")
        assert time.monotonic() - t0 < 5
        assert (await gw.status())["feed"]["sessions"] == sessions + 1
        conn = connect(gw)
        try:
            assert {served_by(await chat(conn, "fo")) for _ in range(4)} == {"e0", "e1"}
        finally:
            await conn.close()
        assert cp.registered["gateway-1"].address == gw.address
    finally:
        cp.revive(i)


async def test_trace_id_reaches_the_engine_and_the_access_log(
    gw: GatewayProc, cp: FakeControlPlane, engines: list[Engine]
) -> None:
    """A client's x-request-id (or a new one) is forwarded to the engine, which logs it, and the
    gateway writes one access line per request with it, without the prompt text."""
    await publish(gw, cp, {"traced": engines[:1]})
    conn = connect(gw)
    try:
        r = await chat(conn, "traced", "secret prompt words", **{"x-request-id": "trace-abc.1"})
        assert r.status == 200, r.body
        bad = await chat(conn, "traced", **{"x-request-id": "not a token"})
        assert bad.status == 200, bad.body
    finally:
        await conn.close()

    def access() -> list[dict[str, Any]]:
        lines = [json.loads(x) for x in gw.proc.log_text().splitlines() if x.startswith("{")]
        return [e for e in lines if e.get("event") == "access" and e.get("workload") == "traced"]

    await until(lambda: len(access()) >= 2, 10, "two access lines")
    first, second = access()[:2]
    assert first["trace_id"] == "trace-abc.1" and first["status"] == 200 and first["attempts"] == 1
    assert first["instance"] == engines[0].address and first["path"] == "/v1/chat/completions"
    assert "secret" not in gw.proc.log_text()
    generated = second["trace_id"]
    assert generated != "not a token" and len(generated) == 16
    await until(
        lambda: all(f"x-request-id={t}" in engines[0].proc.log_text() for t in ("trace-abc.1", generated)),
        10,
        "the engine to log both trace ids",
    )
