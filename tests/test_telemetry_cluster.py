"""Telemetry against a real local cluster: every exporter is `promtool check metrics` clean and
refuses other roles; a real Prometheus (Debian's, on a free port, configured from deploy/monitoring
with targets from `kunlun-cli telemetry targets`) answers PromQL about devices, the scheduler and
the gateways' traffic per version, and fires the device alert when the stand-in tool reports a
device Critical; `telemetry metrics --filter` selects exactly the matching devices; run-time
profiling switches on and off in every process without restart."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from controlplane.cli.config import ClientConfig, write_client_config
from controlplane.cli.main import main as cli_main
from devcluster.cluster import LocalCluster
from devcluster.procs import wait_for
from kunlun_common.api import types_pb2
from kunlun_common.pki import paths_for
from tests.prom_helpers import Prometheus, promtool, scrape, scrape_roots, tls_context
from tests.sched_helpers import delete_all, get, submit
from tests.test_monitoring_rules import EXPORTED, family
from tests.test_profiling import check_nesting, markers, process_files, read_trace


@pytest.fixture(scope="module")
def cli_config(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = paths_for(cluster.cert_dir, "operator", "admin")
    path = tmp_path_factory.mktemp("cli") / "config.yaml"
    write_client_config(path, ClientConfig(tuple(cluster.endpoints), str(p.ca), str(p.cert), str(p.key)))
    wait_for(
        lambda: all(d.status == types_pb2.DEVICE_STATUS_READY for d in cluster.devices()),
        60,
        "every device Ready",
    )
    return path


def cli(config: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """kunlun-cli in this process (a new interpreter per call costs seconds on a busy machine)."""
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            cli_main(["--config", str(config), *args])
        except SystemExit as e:
            code = int(e.code or 0)
    r = subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())
    if check:
        assert r.returncode == 0, r.stderr
    return r


def cli_json(config: Path, *args: str) -> Any:
    return json.loads(cli(config, *args, "-o", "json").stdout)


def test_every_exporter_is_promtool_clean_and_only_for_monitoring(cluster: LocalCluster) -> None:
    assert len(cluster.metrics_addrs) == 3 + 2 + 3  # replicas, agents, gateways
    monitoring = tls_context(cluster.cert_dir, "monitoring", "prometheus")
    families: set[str] = set()
    for proc, addr in cluster.metrics_addrs.items():
        status, body = scrape(addr, monitoring)
        assert status == 200, (proc, body[:200])
        r = promtool("check", "metrics", stdin=body)
        assert r.returncode == 0, (proc, r.stdout.decode() + r.stderr.decode())
        families |= {family(m.decode()) for m in re.findall(rb"^# TYPE (kunlun_\w+) ", body, re.MULTILINE)}
        if proc.startswith("agent-"):
            node = proc.removeprefix("agent-")
            assert f'kunlun_device_utilization_ratio{{device="{node}/'.encode() in body
        if proc.startswith("replica-"):  # each replica's watch lag: measured, and sane on loopback
            lag = re.search(
                rb'^kunlun_replica_watch_lag_seconds\{replica="%s"\} (\S+)$' % proc.encode(), body, re.M
            )
            assert lag is not None and 0.0 <= float(lag.group(1)) < 10.0, (proc, lag)
    # every metric the rules and the dashboard may use is defined by some live exporter
    assert families >= EXPORTED, EXPORTED - families
    # an operator (or any other role) is refused, and a client without a certificate cannot connect
    addr = cluster.metrics_addrs["replica-1"]
    status, body = scrape(addr, tls_context(cluster.cert_dir, "operator", "admin"))
    assert status == 403 and b"monitoring" in body
    anonymous = ssl.create_default_context(cadata=scrape_roots(cluster.cert_dir).decode())
    with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
        scrape(addr, anonymous)


def test_metrics_filter_selects_exactly_the_matching_devices(cli_config: Path, cluster: LocalCluster) -> None:
    every = cli_json(cli_config, "telemetry", "metrics")["items"]
    assert len(every) == len(cluster.devices()) == 7
    got = cli_json(cli_config, "telemetry", "metrics", "--filter", "device_type==cambricon")["items"]
    assert sorted(d["device"] for d in got) == ["node-b/cambricon:0", "node-b/cambricon:1"]
    got = cli_json(cli_config, "telemetry", "metrics", "--filter", "node=~node-a|node-c, device_type!=ascend")
    assert got["items"] == [] and got["total"] == 7
    got = cli_json(cli_config, "telemetry", "metrics", "--filter", "node=~node-a,utilization>=0")["items"]
    assert sorted(d["device"] for d in got) == [f"node-a/ascend:{i}" for i in range(4)]
    assert all(d["vendor"] == "huawei" and d["memory_total_bytes"] == 32768 * 2**20 for d in got)
    table = cli(cli_config, "telemetry", "metrics", "--filter", "device_type==nvidia").stdout
    assert "node-b/nvidia:0" in table and "ascend" not in table
    bad = cli(cli_config, "telemetry", "metrics", "--filter", "utilisation>0.8", check=False)
    assert bad.returncode == 1 and "unknown field 'utilisation'" in bad.stderr
    bad = cli(cli_config, "telemetry", "metrics", "--filter", "node=~([", check=False)
    assert bad.returncode == 1 and "invalid regular expression" in bad.stderr
    top = cli(cli_config, "telemetry", "top", "--count", "1", "--filter", "node==node-b").stdout
    assert "node-b/cambricon:0" in top and "node-a" not in top


@pytest.fixture(scope="module")
def prometheus(cluster: LocalCluster, cli_config: Path) -> Iterator[Prometheus]:
    base = Path(tempfile.mkdtemp(prefix="kunlun-prom-"))
    prom = Prometheus(base, cluster.cert_dir)
    cli(cli_config, "telemetry", "targets", "--write", str(base / "targets" / "kunlun.json"))
    prom.start()
    try:
        yield prom
    finally:
        prom.stop()
        shutil.rmtree(base, ignore_errors=True)


def chat(gateway: str) -> int:
    body = json.dumps({"model": "chat", "prompt": "hi", "max_tokens": 2}).encode()
    req = urllib.request.Request(
        f"http://{gateway}/v1/completions", body, {"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            r.read()
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except OSError:
        return 0


def test_real_prometheus_scrapes_devices_scheduler_and_gateway_traffic(
    prometheus: Prometheus, cluster: LocalCluster, cli_config: Path
) -> None:
    targets = json.loads((prometheus.base / "targets" / "kunlun.json").read_text())
    assert sorted(t["labels"]["job"] for t in targets) == ["agent"] * 2 + ["gateway"] * 3 + ["replica"] * 3
    wait_for(lambda: len(prometheus.query("up == 1")) == 8, 60, "Prometheus to scrape all 8 exporters")
    # API latency by method and code (the filter test above made OK and INVALID_ARGUMENT calls)
    codes = prometheus.query(
        'sum by (code) (kunlun_api_request_duration_seconds_count{method="DeviceMetrics"})'
    )
    assert {s["metric"]["code"] for s in codes} == {"OK", "INVALID_ARGUMENT"}
    # each device's utilization, by device
    series = prometheus.query("kunlun_device_utilization_ratio")
    assert sorted(s["metric"]["device"] for s in series) == sorted(d.name for d in cluster.devices())
    assert {s["metric"]["job"] for s in series} == {"agent"}
    # the scheduler's queue depth (exported by the leader only)
    submit(cluster, name="chat", model="m", replicas=1, preferred_device_types=["nvidia"])
    submit(cluster, name="toobig", model="m", replicas=1, memory_per_device_mb=10**6)
    try:

        def queued() -> list[str]:
            return [
                s["metric"]["kunlun_name"]
                for s in prometheus.query('kunlun_scheduler_queue_depth{priority="normal"} >= 1')
            ]

        # only the leader exports it (the followers' queue would repeat the leader's)
        wait_for(
            lambda: (
                queued() == [cluster.leader()]
                and len(prometheus.query('kunlun_scheduler_queue_depth{priority="normal"}')) == 1
            ),
            90,
            "the leader's queue depth to count the workload that cannot be placed",
            interval=0.5,
        )
        wait_for(
            lambda: prometheus.query('kunlun_scheduler_unplaced_instances{reason="InsufficientMemory"} >= 1'),
            30,
            "unplaced reason InsufficientMemory",
        )
        # traffic through the gateways, then the request rate per version
        wait_for(
            lambda: (
                sum(1 for i in get(cluster, "chat").instances if i.phase == "Running" and i.endpoint) == 1
            ),
            90,
            "chat Running",
        )
        # the engine's cgroup memory and CPU, exported by its agent (the nvidia device is on node-b)
        wait_for(
            lambda: (
                prometheus.query('kunlun_instance_memory_bytes{node="node-b"} > 1e6')
                and prometheus.query('kunlun_instance_cpu_seconds_total{node="node-b"} > 0')
            ),
            60,
            "chat's cgroup memory and CPU",
        )
        gateways = list(cluster.gateway_addrs.values())
        wait_for(lambda: all(chat(g) == 200 for g in gateways), 30, "every gateway routes chat")
        statuses = [chat(gateways[i % 3]) for i in range(60)]
        assert statuses == [200] * 60

        def baseline_rate() -> float:
            r = prometheus.query(
                'sum by (version) (rate(kunlun_gateway_requests_total{workload="chat",status="200"}[5m]))'
            )
            return next((float(s["value"][1]) for s in r if s["metric"]["version"] == "baseline"), 0.0)

        # a rate needs two samples of a series: once Prometheus holds the counters, more traffic
        wait_for(
            lambda: len(prometheus.query('kunlun_gateway_requests_total{workload="chat"}')) == 3,
            60,
            "chat's request counters scraped from all 3 gateways",
        )
        assert [chat(gateways[i % 3]) for i in range(30)] == [200] * 30
        try:
            wait_for(lambda: baseline_rate() > 0, 90, "a baseline request rate for chat")
        except TimeoutError:
            raise AssertionError(prometheus.query("kunlun_gateway_requests_total")) from None
        # every request answered (64 and more: the routing checks above) had its first byte timed
        wait_for(
            lambda: (
                [
                    float(s["value"][1])
                    for s in prometheus.query(
                        'sum(kunlun_gateway_time_to_first_byte_seconds_count{workload="chat",version="baseline"})'
                    )
                ]
                >= [63.0]
            ),
            30,
            "every request's time to first byte",
        )
        # the load balance figure: in `workload describe` and exported by the leader
        lb = cli_json(cli_config, "workload", "describe", "chat")["load_balance"]
        assert lb["devices"] == 1 and lb["stddev"] == 0 and lb["max_min"] == 0
        assert (
            "Load balance: utilization across 1 devices"
            in cli(cli_config, "workload", "describe", "chat").stdout
        )
        wait_for(
            lambda: prometheus.query('kunlun_workload_utilization_stddev_ratio{workload="chat"} == 0'),
            30,
            "chat's utilization spread exported",
        )
    finally:
        delete_all(cluster)


def test_device_set_unhealthy_fires_its_alert(prometheus: Prometheus, cluster: LocalCluster) -> None:
    from node_agent.plugins.standin.state import update_chip

    wait_for(lambda: len(prometheus.query("up == 1")) == 8, 60, "all exporters scraped")
    assert not prometheus.firing("KunlunDeviceUnhealthy")
    state = cluster.base / "agents" / "node-a" / "sim-state.json"
    update_chip(state, "ascend", 2, health="Critical")
    try:
        wait_for(
            lambda: (
                [a["labels"]["device"] for a in prometheus.firing("KunlunDeviceUnhealthy")]
                == ["node-a/ascend:2"]
            ),
            60,
            "KunlunDeviceUnhealthy firing for node-a/ascend:2",
            interval=0.5,
        )
        alert = prometheus.firing("KunlunDeviceUnhealthy")[0]
        assert alert["labels"]["status"] == "Unhealthy" and alert["labels"]["vendor"] == "huawei"
    finally:
        update_chip(state, "ascend", 2, health="OK")
    wait_for(lambda: not prometheus.firing("KunlunDeviceUnhealthy"), 60, "the alert to resolve", interval=0.5)


def _trace_state(folder: Path, process: str) -> tuple[list[dict[str, Any]], list[Path]]:
    files = process_files(folder, process)
    events: list[dict[str, Any]] = []
    for p in files:
        events.extend(read_trace(p))
    return events, files


def test_profiling_toggles_at_run_time_in_every_process(cli_config: Path, cluster: LocalCluster) -> None:
    """`scheduler config set advanced_profiling=true`: every replica, agent and gateway (the same
    processes, no restart) writes Chrome trace files within one interval plus the propagation slack;
    off: a stop marker, then nothing more."""
    procs = {
        **{f"replica.{n}": p for n, p in cluster.replicas.items()},
        **{f"agent.{n}": p for n, p in cluster.agents.items()},
        **{f"gateway.{n}": p for n, p in cluster.gateways.items()},
    }
    assert len(procs) == 8
    pids = {name: p.pid for name, p in procs.items()}
    folder = cluster.profile_dir
    before = {name: len(process_files(folder, name)) for name in procs}
    interval_s, slack_s = 0.05, 20.0
    t0 = time.monotonic()
    cli(cli_config, "scheduler", "config", "set", "advanced_profiling=true", "profiling_interval_ms=50")
    started: dict[str, float] = {}

    def all_started() -> bool:
        for name in procs:
            if name not in started:
                files = process_files(folder, name)
                if len(files) > before[name] and markers(read_trace(files[-1]), "profiling started"):
                    started[name] = time.monotonic() - t0
        return len(started) == len(procs)

    wait_for(all_started, interval_s + slack_s, "every process to start profiling", interval=0.02)
    print(f"profiling on -> first trace file: max {max(started.values()):.2f} s after the set command")
    for name, proc in procs.items():
        events = read_trace(process_files(folder, name)[-1])
        start = markers(events, "profiling started")[0]
        assert start["pid"] == pids[name] == proc.pid and proc.alive(), f"{name} restarted"
        assert start["args"] == {"interval_ms": 50}
    # samples arrive (complete events of the process's own code), nested as trace viewers require
    wait_for(
        lambda: all(any(e.get("ph") == "X" for e in _trace_state(folder, n)[0]) for n in procs),
        30,
        "samples in every process's traces",
    )
    for name in procs:
        check_nesting(_trace_state(folder, name)[0])
    monitoring = tls_context(cluster.cert_dir, "monitoring", "prometheus")

    def profiling_metrics() -> dict[str, dict[str, float]]:
        out = {}
        for proc, addr in cluster.metrics_addrs.items():
            _, body = scrape(addr, monitoring)
            out[proc] = {
                m.group(1).decode(): float(m.group(2))
                for m in re.finditer(rb"^(kunlun_profiling_\w+) (\S+)$", body, re.M)
            }
        return out

    on = profiling_metrics()  # every exporter shows it on, with the profiler's own cost
    assert len(on) == 8 and all(
        m["kunlun_profiling_enabled"] == 1.0 and m["kunlun_profiling_samples_total"] > 0 for m in on.values()
    ), on
    assert all(m["kunlun_profiling_cpu_seconds_total"] >= 0 for m in on.values())
    cli(cli_config, "scheduler", "config", "set", "advanced_profiling=false")
    wait_for(
        lambda: all(markers(read_trace(process_files(folder, n)[-1]), "profiling stopped") for n in procs),
        interval_s + slack_s,
        "every process to stop profiling",
        interval=0.02,
    )
    frozen = {name: {p: p.stat().st_size for p in process_files(folder, name)} for name in procs}
    time.sleep(1.5)  # 30 intervals and a flush period: a profiler still sampling would have written
    for name in procs:
        assert {p: p.stat().st_size for p in process_files(folder, name)} == frozen[name], name
        events, files = _trace_state(folder, name)
        stop = markers(read_trace(files[-1]), "profiling stopped")[-1]["ts"]
        assert max(e.get("ts", 0) for e in read_trace(files[-1])) <= stop
        assert len(files) <= 8  # the default ring: 8 files of at most 4 MiB
        assert all(p.stat().st_size <= 4 * 2**20 for p in files)
        assert procs[name].alive() and procs[name].pid == pids[name]
    off = profiling_metrics()
    assert all(m["kunlun_profiling_enabled"] == 0.0 for m in off.values()), off
