"""Helpers of the telemetry tests: Debian's prometheus/promtool (unpacked by `make install`), HTTPS
scrapes with a role's certificate, and a real Prometheus server on a free port."""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from devcluster.procs import ManagedProcess, free_port, wait_for
from kunlun_common.pki import CLUSTER_CA, REPLICA_CA, paths_for

REPO = Path(__file__).resolve().parents[1]
MONITORING = REPO / "deploy" / "monitoring"


def tool(name: str) -> str:
    """Path of `prometheus` or `promtool`: on PATH, else unpacked into .tools/ by `make install`."""
    found = shutil.which(name)
    if found:
        return found
    local = REPO / ".tools" / "prometheus" / "usr" / "bin" / name
    assert local.exists(), f"{name} not found on PATH nor at {local}; run `make install`"
    return str(local)


def scrape_roots(cert_dir: Path) -> bytes:
    """What a scraper trusts: the cluster CA (agents, gateways) and the replica CA (replicas)."""
    return (cert_dir / CLUSTER_CA).read_bytes() + (cert_dir / REPLICA_CA).read_bytes()


def tls_context(cert_dir: Path, role: str, name: str) -> ssl.SSLContext:
    p = paths_for(cert_dir, role, name)
    ctx = ssl.create_default_context(cadata=scrape_roots(cert_dir).decode())
    ctx.load_cert_chain(str(p.cert), str(p.key))
    return ctx


def scrape(address: str, ctx: ssl.SSLContext, timeout: float = 10.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"https://{address}/metrics", context=ctx, timeout=timeout) as r:
            return int(r.status), bytes(r.read())
    except urllib.error.HTTPError as e:
        return int(e.code), bytes(e.read())


class Prometheus:
    """A real Prometheus with deploy/monitoring's configuration, scraping a local cluster's targets."""

    def __init__(self, base: Path, cert_dir: Path, interval_s: int = 3) -> None:
        self.base = base
        self.port = free_port()
        base.mkdir(parents=True, exist_ok=True)
        cfg = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
        cfg["global"]["scrape_interval"] = f"{interval_s}s"
        cfg["global"]["evaluation_interval"] = f"{interval_s}s"
        for sc in cfg["scrape_configs"]:
            for sd in sc.get("file_sd_configs", []):
                sd["refresh_interval"] = f"{interval_s}s"
        (base / "prometheus.yml").write_text(yaml.safe_dump(cfg))
        shutil.copy(MONITORING / "alerts.yml", base / "alerts.yml")
        (base / "targets").mkdir(exist_ok=True)
        certs = base / "certs"
        (certs / "monitoring").mkdir(parents=True, exist_ok=True)
        p = paths_for(cert_dir, "monitoring", "prometheus")
        (certs / "ca.crt").write_bytes(scrape_roots(cert_dir))
        shutil.copy(p.cert, certs / "monitoring" / "prometheus.crt")
        shutil.copy(p.key, certs / "monitoring" / "prometheus.key")
        self.proc = ManagedProcess(
            "prometheus",
            [
                tool("prometheus"),
                f"--config.file={base / 'prometheus.yml'}",
                f"--storage.tsdb.path={base / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--storage.tsdb.retention.time=1h",
                "--log.level=warn",
            ],
            base / "prometheus.log",
        )

    def start(self) -> None:
        self.proc.start()
        wait_for(self.ready, 60, "prometheus to be ready")

    def stop(self) -> None:
        self.proc.stop()

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def api(self, path: str, **params: str) -> Any:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        return list(self.api("query", query=expr, time=str(time.time()))["result"])

    def firing(self, alertname: str) -> list[dict[str, Any]]:
        return [
            a
            for a in self.api("alerts")["alerts"]
            if a["labels"].get("alertname") == alertname and a["state"] == "firing"
        ]


def promtool(
    *args: str, stdin: bytes | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([tool("promtool"), *args], input=stdin, capture_output=True, cwd=cwd, timeout=60)
