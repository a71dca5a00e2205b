"""The gateway's per-client-address request rate (`client_rate_limit_per_s`), on a real
kunlun-gateway process over raw sockets from several loopback addresses, and its refusals
exported as `kunlun_gateway_refused_total{reason}` (scraped over HTTPS, `promtool check metrics`)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from devcluster.procs import free_port
from gateway.main import build_settings
from kunlun_common.api import gateway_pb2
from kunlun_common.errors import ConfigError
from kunlun_common.traffic import key_hash
from tests.prom_helpers import promtool, scrape, tls_context
from tests.test_gateway_support import FakeControlPlane, GatewayProc, until

KEY = "kl-cccc3333-client-rate-key-0123456789abcdefghijklmno"
CONFIG = """\
name: gateway-1
endpoints: [{endpoints}]
cert_dir: {cert_dir}
require_api_key: true
health_check_interval_s: 0
metrics_listen: 127.0.0.1:{metrics_port}
client_rate_limit_per_s: 2
client_rate_limit_burst: 20
"""
BURST = 20


@pytest.fixture(scope="module")
def cp(cert_dir: Path) -> Iterator[FakeControlPlane]:
    c = FakeControlPlane(cert_dir, replicas=1)
    c.start()
    c.publish([], gateway_pb2.GatewayConfig(key_hashes=[key_hash(KEY)]))
    yield c
    c.close()


@pytest.fixture(scope="module")
async def gw(
    tmp_path_factory: pytest.TempPathFactory, cp: FakeControlPlane, cert_dir: Path
) -> AsyncIterator[tuple[GatewayProc, str]]:
    base = tmp_path_factory.mktemp("gateway-client-rate")
    metrics = f"127.0.0.1:{free_port()}"
    cfg = base / "gw.yaml"
    cfg.write_text(
        CONFIG.format(endpoints=cp.addresses[0], cert_dir=cert_dir, metrics_port=metrics.rpartition(":")[2])
    )
    g = GatewayProc(base, "gw-client-rate", f"--config={cfg}", key=KEY)
    try:
        # polled slowly: the readiness checks come from 127.0.0.1 and count against its rate too
        async def synced() -> bool:
            if not g.proc.alive():
                raise RuntimeError(g.proc.log_text()[-2000:])
            try:
                return bool((await g.status())["synced"])
            except OSError:
                return False

        await until(synced, 30, "the gateway to serve a snapshot", 1.0)
        yield g, metrics
    finally:
        g.stop()


async def _statuses(port: int, source: str, requests: list[bytes]) -> list[tuple[int, str]]:
    """Send `requests` on one keep-alive connection from `source`; (status, retry-after) of each."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    out = []
    try:
        writer.write(b"".join(requests))
        for _ in requests:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            lines = head.decode("latin-1").split("\r\n")
            headers = {
                k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)
            }
            await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), 10)
            out.append((int(lines[0].split(" ")[1]), headers.get("retry-after", "")))
    finally:
        writer.close()
    return out


def _get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nhost: gw\r\n\r\n".encode()


def _refused(text: str) -> dict[str, float]:
    return {
        m.group(1): float(m.group(2))
        for m in re.finditer(r'^kunlun_gateway_refused_total\{reason="([a-z_]+)"\} (\S+)$', text, re.M)
    }


async def test_one_address_over_its_rate_gets_429_others_and_health_do_not(
    gw: tuple[GatewayProc, str], cert_dir: Path
) -> None:
    g, metrics = gw
    ctx = tls_context(cert_dir, "monitoring", "prometheus")
    code, body = await asyncio.to_thread(scrape, metrics, ctx)
    assert code == 200
    before = _refused(body.decode())
    assert before.get("client_rate") == 0.0 and "api_key" in before  # every reason, from zero

    # a flood of unauthenticated requests from one address: the first BURST reach the key check
    # (401), the rest are cut by the address's rate before it (429 with Retry-After)
    got = await _statuses(g.port, "127.0.0.2", [_get("/v1/models")] * (BURST + 10))
    codes = [c for c, _ in got]
    assert codes.count(401) >= BURST and 429 in codes, codes
    assert codes[:BURST] == [401] * BURST and all(c in (401, 429) for c in codes)
    assert all(int(r) >= 1 for c, r in got if c == 429)
    limited = codes.count(429)
    # another address has its own bucket; /health is never limited
    assert [c for c, _ in await _statuses(g.port, "127.0.0.3", [_get("/v1/models")])] == [401]
    assert [c for c, _ in await _statuses(g.port, "127.0.0.2", [_get("/health")] * 3)] == [200] * 3

    code, body = await asyncio.to_thread(scrape, metrics, ctx)
    text = body.decode()
    after = _refused(text)
    assert after["client_rate"] - before["client_rate"] == limited
    assert after["api_key"] - before["api_key"] >= BURST + 1
    check = await asyncio.to_thread(promtool, "check", "metrics", stdin=body)
    assert check.returncode == 0 and not check.stdout.strip() and not check.stderr.strip(), check


def test_client_rate_settings_are_checked(tmp_path: Path) -> None:
    cfg = tmp_path / "gw.yaml"
    cfg.write_text("static_endpoints: ['chat=127.0.0.1:9']\nclient_rate_limit_per_s: -1\n")
    with pytest.raises(ConfigError, match="client_rate_limit_per_s"):
        build_settings([f"--config={cfg}"])
    cfg.write_text("static_endpoints: ['chat=127.0.0.1:9']\nclient_rate_limit_per_s: 50\n")
    s = build_settings([f"--config={cfg}"])
    assert s.client_rate_limit_per_s == 50 and s.client_rate_limit_burst == 0
