"""`kunlun-cli verify` against a real local cluster (3 etcd members, 3 replicas, 2 simulated agents,
3 gateways): the layers pass and the report is written; a busy card is refused and a topology that
differs from the declaration fails, each with a non-zero exit code; nothing the run created stays."""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from controlplane.cli.config import ClientConfig, write_client_config
from devcluster.cluster import EXAMPLES, LocalCluster
from devcluster.procs import wait_for
from kunlun_common.api import types_pb2
from kunlun_common.pki import paths_for
from tests.sched_helpers import delete_all, get, submit, workloads

NODE_CONFIGS = [str(EXAMPLES / "node-a.yaml"), str(EXAMPLES / "node-b.yaml")]


@pytest.fixture(autouse=True)
def clean(cluster: LocalCluster) -> Iterator[None]:
    yield
    delete_all(cluster)


@pytest.fixture
def cli(cluster: LocalCluster, tmp_path: Path) -> Any:
    p = paths_for(cluster.cert_dir, "operator", "admin")
    cfg = tmp_path / "client.yaml"
    write_client_config(cfg, ClientConfig(tuple(cluster.endpoints), str(p.ca), str(p.cert), str(p.key)))

    def run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "controlplane.cli.main", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={"KUNLUN_CONFIG": str(cfg), "PATH": "/usr/bin:/bin"},
        )

    return run


def checkpoints(report: dict[str, Any]) -> dict[tuple[int, str], dict[str, Any]]:
    return {(c["layer"], c["name"]): c for layer in report["layers"] for c in layer["checkpoints"]}


def no_verify_workloads(cluster: LocalCluster) -> bool:
    return not [w for w in workloads(cluster) if w.workload.spec.name.startswith("kunlun-verify-")]


def all_ready(cluster: LocalCluster) -> bool:
    return all(d.status == types_pb2.DEVICE_STATUS_READY for d in cluster.devices())


def test_layers_pass_and_the_report_holds_every_checkpoint(
    cluster: LocalCluster, cli: Any, tmp_path: Path
) -> None:
    # the stand-in tools are processes with a 10 s timeout: on a crowded machine a device can be in
    # Error for a sample; start from a cluster whose devices are all Ready
    wait_for(lambda: all_ready(cluster), 120, "every device Ready")
    out = tmp_path / "report"
    args = ["verify", "--layer", "1..4", "--report", str(out), "-o", "json", "--requests", "500"]
    r = cli(*args, *[a for f in NODE_CONFIGS for a in ("--declared", f)])
    report = json.loads(r.stdout)
    failed = [c for c in checkpoints(report).values() if c["result"] != "pass"]
    assert r.returncode == 0 and not failed, (r.stderr[-2000:], json.dumps(failed, indent=1)[:6000])
    cps = checkpoints(report)
    assert {(1, "every declared device Ready"), (1, "memory equal to the vendor tool's figure")} <= set(cps)
    assert cps[(1, "every declared device Ready")]["measured"] == "7/7 Ready"
    assert cps[(1, "memory equal to the vendor tool's figure")]["measured"].startswith("7/7 match")
    memory_ev = cps[(1, "memory equal to the vendor tool's figure")]["evidence"]
    assert any(e["command"].startswith("npu-smi info") for e in memory_ev)  # the tool's own output
    assert any(e["command"].startswith("cnmon") for e in memory_ev)
    for name in ("preparation time", "first-token latency", "utilization peak during the burst"):
        assert (2, name) in cps and cps[(2, name)]["evidence"], name
    # the files: the same data as JSON, a markdown summary, pictures that are well-formed SVG
    assert json.loads((out / "report.json").read_text())["result"] == "pass"
    md = (out / "report.md").read_text()
    assert "| 2 | preparation time |" in md and "PASS" in md
    for pic in ("layer2-utilization.svg", "layer2-latency.svg"):
        root = ET.fromstring((out / pic).read_text())
        assert root.tag.endswith("svg") and len(list(root)) > 5, pic
    layer2 = next(layer for layer in report["layers"] if layer["layer"] == 2)
    assert len(layer2["latencies_ms"]) == 100  # a fifth of --requests, every one answered
    assert max(v for s in layer2["utilization"] for _, v in s["points"]) > 35  # the burst shows
    # layer 3: one instance per ascend card of node-a, 500 requests, a small spread
    assert cps[(3, "instances on the node's cards")]["measured"].startswith("4 of 4 instances on node-a")
    assert cps[(3, "burst answered without OOM or timeout")]["measured"].startswith("500/500 answered 200")
    layer3 = next(layer for layer in report["layers"] if layer["layer"] == 3)
    assert sorted(s["name"] for s in layer3["utilization"]) == [f"node-a/ascend:{i}" for i in range(4)]
    # layer 4: on both cambricon cards, none on ascend, and the filtered view shows it
    assert cps[(4, "the int8 workload lands on cambricon")]["measured"].startswith("2 of 2")
    assert cps[(4, "none of its instances on ascend")]["measured"] == "0 on ascend"
    shown = cps[(4, "telemetry device_type==cambricon shows the load")]
    assert "cambricon" in shown["evidence"][0]["output"] and "ascend" not in shown["evidence"][0]["output"]
    for pic in ("layer3-utilization.svg", "layer4-utilization.svg", "layer3-latency.svg"):
        assert (out / pic).exists(), pic
    assert no_verify_workloads(cluster)
    assert any("deleted" in line for line in report["cleanup"])


def test_a_card_serving_another_workload_is_refused(cluster: LocalCluster, cli: Any) -> None:
    submit(cluster, name="tenant", model="m", replicas=1, pin="node-b/cambricon:1", memory_per_device_mb=1024)
    wait_for(lambda: bool(get(cluster, "tenant").instances[0].target_devices), 60, "tenant placed")
    r = cli("verify", "--layer", "2", "--device", "node-b/cambricon:1", "-o", "json")
    assert r.returncode == 1, r.stderr
    cps = checkpoints(json.loads(r.stdout))
    refused = cps[(2, "the card is free")]
    assert refused["result"] == "fail" and "tenant" in refused["measured"]
    assert "tenant" in refused["evidence"][0]["output"]
    assert list(cps) == [(2, "the card is free")]  # nothing was deployed or measured
    # layer 4 needs every cambricon card: refused too
    r4 = cli("verify", "--layer", "4", "-o", "json")
    assert r4.returncode == 1, r4.stderr
    refused4 = checkpoints(json.loads(r4.stdout))[(4, "the cambricon cards are free")]
    assert refused4["result"] == "fail" and "node-b/cambricon:1 held by tenant" in refused4["measured"]
    assert no_verify_workloads(cluster)
    assert get(cluster, "tenant").instances[0].target_devices == ["node-b/cambricon:1"]  # untouched


def test_a_topology_that_differs_from_the_declaration_fails(
    cluster: LocalCluster, cli: Any, tmp_path: Path
) -> None:
    data = yaml.safe_load(Path(NODE_CONFIGS[0]).read_text())
    data["devices"][0]["topology_distance"][0][1] = data["devices"][0]["topology_distance"][1][0] = 3
    changed = tmp_path / "node-a.yaml"
    changed.write_text(yaml.safe_dump(data))
    r = cli("verify", "--layer", "1", "--declared", str(changed))
    assert r.returncode == 1, r.stderr
    assert "FAIL: " in r.stdout
    line = next(x for x in r.stdout.splitlines() if x.startswith("1      topology matrix as declared"))
    assert line.rstrip().endswith("FAIL") and "differs from the declared" in line
