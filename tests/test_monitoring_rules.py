"""deploy/monitoring: the alert rules pass `promtool check rules` and their unit tests
(`promtool test rules`), the Prometheus configuration passes `promtool check config`, and every
Grafana panel's query is valid PromQL over metrics our exporters define."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import yaml

from tests.prom_helpers import MONITORING, promtool

# every kunlun_* metric name the exporters define (families; counters end in _total, histograms
# add _bucket/_sum/_count); tests/test_telemetry_cluster.py checks the list against live scrapes
EXPORTED = {
    "kunlun_api_request_duration_seconds",
    "kunlun_etcd_request_duration_seconds",
    "kunlun_etcd_request_errors",
    "kunlun_scheduler_queue_depth",
    "kunlun_scheduler_placements",
    "kunlun_scheduler_preemptions",
    "kunlun_scheduler_decision_duration_seconds",
    "kunlun_scheduler_unplaced_instances",
    "kunlun_scheduler_temperature_limit_celsius",
    "kunlun_replica_leader",
    "kunlun_replica_leader_epoch",
    "kunlun_replica_leader_terms",
    "kunlun_replica_watch_lag_seconds",
    "kunlun_rollout_phase",
    "kunlun_rollout_canary_weight_ratio",
    "kunlun_node_ready",
    "kunlun_workload_utilization_stddev_ratio",
    "kunlun_workload_utilization_spread_ratio",
    "kunlun_etcd_db_size_bytes",
    "kunlun_etcd_db_quota_bytes",
    "kunlun_etcd_member_healthy",
    "kunlun_certificate_expiry_timestamp_seconds",
    "kunlun_device_utilization_ratio",
    "kunlun_device_memory_used_bytes",
    "kunlun_device_memory_total_bytes",
    "kunlun_device_temperature_celsius",
    "kunlun_device_power_watts",
    "kunlun_device_sample_timestamp_seconds",
    "kunlun_device_status",
    "kunlun_instance_phase",
    "kunlun_instance_restarts",
    "kunlun_instance_memory_bytes",
    "kunlun_instance_cpu_seconds",
    "kunlun_instance_prepare_seconds",
    "kunlun_instance_first_token_seconds",
    "kunlun_instance_oom_killed",
    "kunlun_agent_connected",
    "kunlun_gateway_requests",
    "kunlun_gateway_request_duration_seconds",
    "kunlun_gateway_time_to_first_byte_seconds",
    "kunlun_gateway_retries",
    "kunlun_gateway_ejections",
    "kunlun_gateway_inflight_requests",
    "kunlun_gateway_client_connections",
    "kunlun_gateway_instances",
    "kunlun_gateway_ejected_instances",
    "kunlun_gateway_upstream_inflight_requests",
    "kunlun_gateway_upstream_idle_connections",
    "kunlun_gateway_upstream_connections_opened",
    "kunlun_gateway_refused",
}
_SUFFIXES = ("_total", "_bucket", "_sum", "_count")


def family(name: str) -> str:
    for s in _SUFFIXES:
        if name.endswith(s) and name.removesuffix(s) in EXPORTED:
            return name.removesuffix(s)
    return name


def referenced(text: str) -> set[str]:
    labels = {"kunlun_name"}  # the target label from `telemetry targets`
    return {family(m) for m in re.findall(r"\bkunlun_[a-z0-9_]+", text)} - labels


def dashboard_exprs() -> list[str]:
    dash = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 20
    return exprs


def test_alert_rules_check_and_unit_tests_pass() -> None:
    r = promtool("check", "rules", "alerts.yml", cwd=MONITORING)
    assert r.returncode == 0, r.stdout.decode() + r.stderr.decode()
    rules = yaml.safe_load((MONITORING / "alerts.yml").read_text())["groups"][0]["rules"]
    names = {rule["alert"] for rule in rules}
    assert {
        "KunlunNodeNotReady",
        "KunlunDeviceUnhealthy",
        "KunlunDeviceTemperatureOverLimit",
        "KunlunCanaryDegraded",
        "KunlunLeaderChangesTooOften",
        "KunlunEtcdDatabaseNearQuota",
        "KunlunGatewayErrorRatio",
        "KunlunCertificateExpiresSoon",
        "KunlunReplicaWatchLagging",
    } <= names
    r = promtool("test", "rules", "alerts.test.yml", cwd=MONITORING)
    assert r.returncode == 0, r.stdout.decode() + r.stderr.decode()
    tested = set(re.findall(r"alertname: (\w+)", (MONITORING / "alerts.test.yml").read_text()))
    assert names == tested, f"rules without a promtool test: {names - tested}"


def test_a_broken_rule_test_fails(tmp_path: Path) -> None:
    """The unit tests can fail: a threshold moved past the test's data makes promtool say so."""
    shutil.copy(MONITORING / "alerts.test.yml", tmp_path)
    text = (MONITORING / "alerts.yml").read_text().replace("> 0.8", "> 0.99")
    (tmp_path / "alerts.yml").write_text(text)
    r = promtool("test", "rules", "alerts.test.yml", cwd=tmp_path)
    assert r.returncode != 0 and b"KunlunEtcdDatabaseNearQuota" in r.stdout + r.stderr


def test_prometheus_config_is_valid(tmp_path: Path) -> None:
    for f in ("prometheus.yml", "alerts.yml"):
        shutil.copy(MONITORING / f, tmp_path)
    (tmp_path / "certs" / "monitoring").mkdir(parents=True)
    for f in ("certs/ca.crt", "certs/monitoring/prometheus.crt", "certs/monitoring/prometheus.key"):
        (tmp_path / f).write_text("")
    r = promtool("check", "config", "prometheus.yml", cwd=tmp_path)
    assert r.returncode == 0, r.stdout.decode() + r.stderr.decode()


def test_dashboard_and_rules_use_only_exported_metrics_and_valid_promql(tmp_path: Path) -> None:
    exprs = dashboard_exprs()
    used = referenced("\n".join(exprs)) | referenced((MONITORING / "alerts.yml").read_text())
    assert used <= EXPORTED, f"not exported by any process: {used - EXPORTED}"
    # promtool parses PromQL in rule files: every panel query becomes a recording rule
    rules = [
        {"record": f"kunlun:dashboard_{i}", "expr": e.replace("$device_type", ".*")}
        for i, e in enumerate(exprs)
    ]
    (tmp_path / "dash.yml").write_text(yaml.safe_dump({"groups": [{"name": "dash", "rules": rules}]}))
    r = promtool("check", "rules", "dash.yml", cwd=tmp_path)
    assert r.returncode == 0, r.stdout.decode() + r.stderr.decode()
