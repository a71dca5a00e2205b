# ruff: noqa: RUF001  (Chinese text is written with its own full-width punctuation)
"""`kunlun-cli verify` against a real local cluster (3 etcd members, 3 replicas, 2 simulated agents,
3 gateways): the layers pass and the report is written; a busy card is refused and a topology that
differs from the declaration fails, each with a non-zero exit code; nothing the run created stays.

The replicas run under devcluster's supervisor, as `make demo` runs them: layer 5 drains one through
the operator call, its process exits and the supervisor starts a new one."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from controlplane.cli.config import ClientConfig, write_client_config
from devcluster.cluster import EXAMPLES, LocalCluster
from devcluster.procs import pid_alive, wait_for
from kunlun_common.api import cluster_pb2, cluster_pb2_grpc, rollout_pb2, rollout_pb2_grpc, types_pb2
from kunlun_common.pki import paths_for
from tests.conftest import FAST_TMP, start_cluster
from tests.sched_helpers import delete_all, get, placed, submit, workloads

NODE_CONFIGS = [str(EXAMPLES / "node-a.yaml"), str(EXAMPLES / "node-b.yaml")]


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    """The conftest's local cluster, with every replica under devcluster/supervise.py."""
    base = Path(tempfile.mkdtemp(prefix="kunlun-cluster-", dir=FAST_TMP))
    c = start_cluster(base, extra_nodes=("node-x", "node-c"), supervise_replicas=True)
    try:
        yield c
    finally:
        c.stop()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(autouse=True)
def clean(cluster: LocalCluster) -> Iterator[None]:
    yield
    delete_all(cluster)


@pytest.fixture
def cli(cluster: LocalCluster, tmp_path: Path) -> Any:
    return cli_as(cluster, tmp_path, "operator", "admin")


def cli_as(cluster: LocalCluster, tmp_path: Path, role: str, name: str) -> Any:
    p = paths_for(cluster.cert_dir, role, name)
    cfg = tmp_path / f"client-{role}.yaml"
    write_client_config(cfg, ClientConfig(tuple(cluster.endpoints), str(p.ca), str(p.cert), str(p.key)))

    def run(*args: str, timeout: float = 600, lang: str = "") -> subprocess.CompletedProcess[str]:
        env = {"KUNLUN_CONFIG": str(cfg), "PATH": "/usr/bin:/bin"}
        if lang:  # e.g. zh_CN.UTF-8: the reader's language
            env["LANG"] = lang
        return subprocess.run(
            [sys.executable, "-m", "controlplane.cli.main", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
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
    # layer 5 drains a replica and loads the shared gateways: refused while others are served
    pids = replica_pids(cluster)
    r5 = cli("verify", "--layer", "5", "--disruptive", "-o", "json")
    assert r5.returncode == 1, r5.stderr
    report5 = json.loads(r5.stdout)
    assert list(checkpoints(report5)) == [(5, "the cluster serves no workload of others")]
    refused5 = checkpoints(report5)[(5, "the cluster serves no workload of others")]
    assert refused5["result"] == "fail" and "node-b/cambricon:1 held by tenant" in refused5["measured"]
    assert replica_pids(cluster) == pids  # nobody was drained
    # and without --disruptive it does not run at all (a skipped layer is no pass)
    skipped = cli("verify", "--layer", "5", "-o", "json")
    assert skipped.returncode == 1 and json.loads(skipped.stdout)["layers"][0]["result"] == "skipped"
    assert no_verify_workloads(cluster)
    assert get(cluster, "tenant").instances[0].target_devices == ["node-b/cambricon:1"]  # untouched


def test_a_topology_that_differs_from_the_declaration_fails(
    cluster: LocalCluster, cli: Any, tmp_path: Path
) -> None:
    """Layer 1 against a declaration that differs fails, in English and in Chinese: the measured
    values, thresholds and evidence descriptions read in the reader's language on the terminal and
    in report.md; report.json holds the same English values in both runs."""
    wait_for(lambda: all_ready(cluster), 120, "every device Ready")
    data = yaml.safe_load(Path(NODE_CONFIGS[0]).read_text())
    data["devices"][0]["topology_distance"][0][1] = data["devices"][0]["topology_distance"][1][0] = 3
    changed = tmp_path / "node-a.yaml"
    changed.write_text(yaml.safe_dump(data))
    args = ("verify", "--layer", "1", "--declared", str(changed))
    zh = cli(*args, "--report", str(tmp_path / "zh"), lang="zh_CN.UTF-8")
    en = cli(*args, "--report", str(tmp_path / "en"))
    assert zh.returncode == 1 and en.returncode == 1, (zh.stderr, en.stderr)
    assert "FAIL: " in en.stdout
    line = next(x for x in en.stdout.splitlines() if x.startswith("1      topology matrix as declared"))
    assert line.rstrip().endswith("FAIL") and "differs from the declared" in line
    report = json.loads((tmp_path / "en" / "report.json").read_text())
    cps = checkpoints(report)
    ready, topo = cps[(1, "every declared device Ready")], cps[(1, "topology matrix as declared")]
    # report.json: English, the same whatever the language
    zh_cps = checkpoints(json.loads((tmp_path / "zh" / "report.json").read_text()))
    for key, c in cps.items():
        assert (zh_cps[key]["measured"], zh_cps[key]["threshold"]) == (c["measured"], c["threshold"])
        assert [e["command"] for e in zh_cps[key]["evidence"]] == [e["command"] for e in c["evidence"]]
    assert ready["measured"] == "7/7 Ready"
    assert ready["threshold"] == "7/7 Ready (none Unknown, Error or Unhealthy)"
    assert topo["measured"].startswith("node-a: graph [[0, 1,") and topo["measured"].endswith(
        "; compared with the declaration of node-a"
    )
    assert "differs from the declared [[0, 3," in topo["measured"]
    assert topo["threshold"] == "square, symmetric, zero diagonal, equal to --declared"
    # English terminal: the values as in report.json, the evidence of the failed checkpoint
    en_row = (
        r"\n1 +every declared device Ready +7/7 Ready +7/7 Ready \(none Unknown, Error or Unhealthy\) +PASS\n"
    )
    assert re.search(en_row, en.stdout), en.stdout
    assert (
        topo["measured"] in en.stdout
        and "$ kunlun-cli node describe node-a (topology_distance of each device)\n" in en.stdout
    )
    assert (
        "  [PASS ] every declared device Ready: 7/7 Ready (threshold 7/7 Ready (none Unknown, Error or Unhealthy))"
        in en.stderr
    )
    # Chinese terminal: measured values, thresholds and the evidence's description in Chinese
    zh_row = r"\n1 +所有声明的设备均为 Ready +7/7 台为 Ready +7/7 台为 Ready（没有 Unknown、Error 或 Unhealthy） +PASS\n"
    assert re.search(zh_row, zh.stdout), zh.stdout
    zh_topo = "node-a：图中的 [[0, 1, 2, 2], [1, 0, 2, 2], [2, 2, 0, 1], [2, 2, 1, 0]] 与声明的 [[0, 3,"
    assert zh_topo in zh.stdout and "不同；已与 node-a 的声明比较" in zh.stdout, zh.stdout
    assert "方阵、对称、对角线为零，且与 --declared 相同" in zh.stdout
    assert "$ kunlun-cli node describe node-a（每个设备的 topology_distance）\n" in zh.stdout
    assert "graph" not in zh.stdout and "declaration" not in zh.stdout and "Ready (none" not in zh.stdout
    # report.md: in the reader's language too, the English one unchanged in form
    md_zh, md_en = ((tmp_path / d / "report.md").read_text() for d in ("zh", "en"))
    assert (
        "| 1 | 所有声明的设备均为 Ready | 7/7 台为 Ready | 7/7 台为 Ready（没有 Unknown、Error 或 Unhealthy） | PASS |"
        in md_zh
    )
    assert "`kunlun-cli verify（平台 MEMORY 与厂商工具对比）`" in md_zh and "{" not in md_zh.split("```")[0]
    assert f"| 1 | every declared device Ready | {ready['measured']} | {ready['threshold']} | PASS |" in md_en
    assert "`kunlun-cli verify (platform MEMORY vs vendor tool)`" in md_en
    assert f"- measured: {topo['measured']}" in md_en


def test_describe_labels_in_chinese(cluster: LocalCluster, cli: Any) -> None:
    """`device describe` and `node describe`: each JSON key's label in the reader's language, values
    aligned in one column (a Chinese character is two columns wide); English labels as always."""
    from controlplane.cli.views import device_json, display_width, node_json

    shown: dict[str, str] = {}
    for args, width in (
        (("device", "describe", "node-a/ascend:0"), None),
        (("node", "describe", "node-a"), 22),
    ):
        keys = [*device_json(types_pb2.Device()), "node_ready", "node_address"]
        if args[0] == "node":
            keys = [*node_json(types_pb2.Node()), "protections", "note", "device_names"]
        en, zh = cli(*args), cli(*args, lang="zh_CN.UTF-8")
        assert en.returncode == 0 and zh.returncode == 0, (en.stderr, zh.stderr)
        en_lines, zh_lines = en.stdout.splitlines()[: len(keys)], zh.stdout.splitlines()[: len(keys)]
        pad = max(len(k) for k in keys) + 2 if width is None else width + 1
        for k, line in zip(keys, en_lines, strict=True):  # the English labels as before, byte for byte
            assert line.startswith(k.replace("_", " ").capitalize().ljust(pad)), (k, line)
            assert line[pad - 1] == " " and (len(line) == pad or line[pad] != " ")
        value_at = set()
        for en_line, zh_line in zip(en_lines, zh_lines, strict=True):
            value = en_line[pad:]
            if value and not any(c.isdigit() for c in value):  # telemetry values change from call to call
                assert zh_line.endswith(" " + value), (zh_line, value)
                value_at.add(display_width(zh_line) - display_width(value))
        assert len(value_at) == 1, value_at  # one column
        shown[args[0]] = zh.stdout
    dev, node = shown["device"], shown["node"]
    assert (
        dev.startswith("名称") and "\n设备类型 " in dev and "\nHBM 内存 (MB) " in dev and "\n拓扑距离 " in dev
    )
    assert "\n地址 " in node and "\nagent 版本 " in node and "\n所连副本 " in node and "Address" not in node


def test_stored_reasons_in_chinese(cluster: LocalCluster, cli: Any) -> None:
    """The reasons the replicas store on instances and rollouts carry a message id beside their
    English text: `workload describe` and `rollout status` show them in Chinese under zh_CN, in
    English otherwise, and `-o json` keeps the English text."""
    wait_for(lambda: all_ready(cluster), 120, "every device Ready")
    submit(cluster, name="tenant", model="m", replicas=1, pin="node-b/cambricon:1", memory_per_device_mb=1024)
    toobig = ("workload", "submit", "--name", "toobig", "--model", "m", "--memory-per-device-mb", "10000000")
    made = cli(*toobig, lang="zh_CN.UTF-8")
    assert made.returncode == 0 and re.fullmatch(r"工作负载 toobig（w-[0-9a-f]+）已创建\n", made.stdout), made
    again = cli(*toobig, "-o", "json", lang="zh_CN.UTF-8")  # JSON keeps the English result
    assert json.loads(again.stdout)["result"] == "unchanged", again
    wait_for(lambda: placed(cluster, "tenant"), 60, "tenant placed")
    # the reason a node reports (its agent serves with the test engine) travels with its message
    wait_for(lambda: get(cluster, "tenant").instances[0].phase == "Running", 90, "tenant Running")
    tenant = get(cluster, "tenant").instances[0]
    assert (
        tenant.reason == "SGLang is not installed on node-b: serving with kunlun-test-engine (a test engine)"
    )
    assert tenant.reason_message, tenant
    zh_tenant = cli("workload", "describe", "tenant", lang="zh_CN.UTF-8")
    assert "node-b 上未安装 SGLang：使用 kunlun-test-engine（测试引擎）提供服务\n" in zh_tenant.stdout, (
        zh_tenant
    )
    assert tenant.reason not in zh_tenant.stdout
    wait_for(lambda: get(cluster, "toobig").instances[0].unplaced_reasons, 60, "toobig told why")
    big = get(cluster, "toobig").instances[0]
    assert big.reason_message and big.reason.startswith("node-a: "), big.reason
    zh, en = cli("workload", "describe", "toobig", lang="zh_CN.UTF-8"), cli("workload", "describe", "toobig")
    assert zh.returncode == 0 and en.returncode == 0, (zh.stderr, en.stderr)
    assert f"target_devices: []  {big.reason}\n" in en.stdout and "waiting for placement" in en.stdout
    # the filters' codes stay, their explanations are Chinese: per node and in the instance's reason
    free = {
        n: re.fullmatch(r"InsufficientMemory \(needs 10000000 MB, (\d+) free\)", r)
        for n, r in big.unplaced_reasons.items()
    }
    assert set(free) >= {"node-a", "node-b"} and all(free.values()), big.unplaced_reasons
    zh_nodes = [
        f"{n}：内存不足（InsufficientMemory：需要 10000000 MB，可用 {m[1]} MB）"
        for n, m in sorted(free.items())
        if m
    ]
    assert f"目标设备：[]  {'; '.join(zh_nodes)}\n" in zh.stdout, zh.stdout
    assert all(f"\n      {line}\n" in zh.stdout for line in zh_nodes), zh.stdout
    dry_zh, dry_en = cli(*toobig, "--dry-run", lang="zh_CN.UTF-8"), cli(*toobig, "--dry-run", "-o", "json")
    assert json.loads(dry_en.stdout)["plan"][0].startswith("instance 0: not placed now (node-a: Insufficient")
    dry_line = dry_zh.stdout.splitlines()[1]
    assert dry_line.startswith("  实例 0：目前无法放置（") and all(n in dry_line for n in zh_nodes), (
        dry_zh.stdout
    )
    assert all(f"\n      {n}: {r}\n" in en.stdout for n, r in big.unplaced_reasons.items()), en.stdout
    assert "等待调度" in zh.stdout and "waiting for placement" not in zh.stdout and "needs" not in zh.stdout
    # the spec's labels, and who wrote each history line
    assert (
        "\n  memory_per_device_mb: 10000000\n" in en.stdout and "  Submitted  by operator:admin" in en.stdout
    )
    assert (
        "\n  每设备内存 (MB)：10000000\n  副本数：1\n" in zh.stdout
        and "  Submitted  由 operator:admin" in zh.stdout
    )

    # a rollout, promoted before its analysis has the requests it needs, then aborted
    def rollouts(method: str, req: Any) -> rollout_pb2.Rollout:
        with cluster.channel(cluster.endpoints[0]) as ch:
            got = getattr(rollout_pb2_grpc.RolloutServiceStub(ch), method)(req, timeout=10)
        assert isinstance(got, rollout_pb2.Rollout)
        return got

    spec = rollout_pb2.RolloutSpec(workload="tenant", model="m2", canary_pct=10)
    rollouts("CreateRollout", rollout_pb2.CreateRolloutRequest(spec=spec))
    rollouts("PromoteRollout", rollout_pb2.RolloutRequest(workload="tenant"))
    get_req = rollout_pb2.RolloutRequest(workload="tenant")
    wait_for(lambda: rollouts("GetRollout", get_req).step == 1, 60, "the promote applied")
    rollouts("AbortRollout", get_req)
    wait_for(lambda: rollouts("GetRollout", get_req).phase == "Aborted", 60, "the rollout aborted")
    r = json.loads(cli("rollout", "status", "tenant", "-o", "json", lang="zh_CN.UTF-8").stdout)
    assert r["reason"] == "aborted on request; canary removed, baseline untouched"
    promoted = r["history"][1]["reason"]
    assert promoted == (
        "promoted (analysis incomplete: waiting for 100 requests (canary 0, baseline 0; 50 each needed)): "
        "step 2/2, canary weight 100%"
    )
    zh, en = cli("rollout", "status", "tenant", lang="zh_CN.UTF-8"), cli("rollout", "status", "tenant")
    assert "Phase:     Aborted  aborted on request; canary removed, baseline untouched\n" in en.stdout
    assert f"Analysis:  Waiting (step 1)  {r['analysis']['reason']}\n" in en.stdout
    assert f"  {promoted}\n" in en.stdout and "by operator:admin  created\n" in en.stdout
    assert "Aborted  应请求中止；金丝雀已移除，基线未受影响\n" in zh.stdout, zh.stdout
    assert "还需等待 100 个请求（金丝雀 0，基线 0；各需 50 个）\n" in zh.stdout
    assert (
        "  已 promote（分析未完成：还需等待 100 个请求（金丝雀 0，基线 0；各需 50 个））：第 2/2 步，金丝雀权重 100%\n"
        in zh.stdout
    )
    assert "已创建\n" in zh.stdout and "request" not in zh.stdout


def replica_pids(cluster: LocalCluster) -> dict[str, int]:
    resp = cluster.call_any("ClusterStatus", cluster_pb2.ClusterStatusRequest())
    assert isinstance(resp, cluster_pb2.ClusterStatusResponse)
    return {r.name: r.pid for r in resp.replicas}


def verify_rollouts(cluster: LocalCluster) -> list[str]:
    with cluster.channel(cluster.endpoints[0]) as ch:
        resp = rollout_pb2_grpc.RolloutServiceStub(ch).ListRollouts(
            rollout_pb2.ListRolloutsRequest(), timeout=10
        )
    return [r.workload for r in resp.rollouts if r.workload.startswith("kunlun-verify-")]


def connected_replica(cluster: LocalCluster, node: str) -> str:
    resp = cluster.call_any("ListNodes", cluster_pb2.ListNodesRequest())
    assert isinstance(resp, cluster_pb2.ListNodesResponse)
    return next(n.connected_replica for n in resp.nodes if n.name == node)


def test_layer5_drains_a_replica_which_comes_back_and_the_canary_passes(
    cluster: LocalCluster, cli: Any, tmp_path: Path
) -> None:
    wait_for(lambda: all_ready(cluster), 120, "every device Ready")
    # a workload of someone else: --allow-busy runs the layer anyway, and it must come through
    submit(cluster, name="tenant", model="m", replicas=1, pin="node-b/cambricon:1", memory_per_device_mb=1024)
    wait_for(
        lambda: [i.phase for i in get(cluster, "tenant").instances] == ["Running"], 120, "tenant Running"
    )
    tenant = [(i.id, list(i.target_devices), i.restarts) for i in get(cluster, "tenant").instances]
    # drain the replica that holds node-a's agent stream: the agent must move
    target = connected_replica(cluster, "node-a")
    leader = cluster.leader()
    before = replica_pids(cluster)
    supervisors = {n: p.pid for n, p in cluster.replicas.items()}
    out = tmp_path / "report"
    args = ["--replica", target, "--allow-busy", "--report", str(out), "-o", "json", "--requests", "400"]
    r = cli("verify", "--layer", "5", "--disruptive", *args)
    report = json.loads(r.stdout)
    cps = checkpoints(report)
    failed = [c for c in cps.values() if c["result"] != "pass"]
    assert r.returncode == 0 and not failed, (r.stderr[-3000:], json.dumps(failed, indent=1)[:8000])
    # the drained process really exited (status 0, as its supervisor saw) and a new one serves
    after = replica_pids(cluster)
    assert after[target] != before[target] and not pid_alive(before[target])
    assert {n: p for n, p in after.items() if n != target} == {n: p for n, p in before.items() if n != target}
    assert cluster.replicas[target].pid == supervisors[target] and cluster.replicas[target].alive()
    assert f"supervise: pid {before[target]} exited with status 0" in cluster.replicas[target].log_text()
    assert cluster.replica_serving(target) and cluster.leader() not in ("", target)
    assert connected_replica(cluster, "node-a") not in ("", target)  # the agent moved
    handover = (
        "leadership handed over" if leader == target else "leadership unchanged (a follower was drained)"
    )
    names = [name for (layer, name) in cps if layer == 5]
    assert names == [
        "replica drained through the operator call and exited",
        handover,
        "workload list complete while the replica was away",
        "agents and gateways moved to other replicas",
        "the replica restarted",
        "canary share of the burst",
        "canary error rate",
        "canary p95 latency against the baseline",
        "rollout status consistent with the plan",
    ]
    drained = cps[(5, "replica drained through the operator call and exited")]["measured"]
    assert f"{target} (pid {before[target]}, {'leader' if leader == target else 'follower'})" in drained
    assert " 0 agent/gateway streams" not in drained, drained  # at least node-a's stream was ended
    assert "node-a" in cps[(5, "agents and gateways moved to other replicas")]["measured"].split(";")[0]
    assert cps[(5, "the replica restarted")]["measured"].startswith(
        f"{target} serves again as pid {after[target]}"
    )
    listed = cps[(5, "workload list complete while the replica was away")]["measured"]
    reads, total = listed.split(" reads", 1)[0].split("/")
    assert reads == total and int(total) > 0 and "held all 2 workloads" in listed, listed
    # the tenant's instance came through the drain untouched
    assert [(i.id, list(i.target_devices), i.restarts) for i in get(cluster, "tenant").instances] == tenant
    assert [i.phase for i in get(cluster, "tenant").instances] == ["Running"]
    layer5 = next(layer for layer in report["layers"] if layer["layer"] == 5)
    assert len(layer5["latencies_ms"]) == 400
    md = (out / "report.md").read_text()
    assert "| 5 | the replica restarted |" in md and (out / "layer5-latency.svg").exists()
    # what the run created is gone: the workload and, with it, its rollout
    assert no_verify_workloads(cluster)
    wait_for(lambda: not verify_rollouts(cluster), 30, "the verify rollout to go with its workload")


def test_only_an_operator_drains_and_only_the_replica_itself(cluster: LocalCluster, tmp_path: Path) -> None:
    wait_for(lambda: len(replica_pids(cluster)) == 3, 120, "3 replicas registered")
    before = replica_pids(cluster)
    name = sorted(before)[0]
    viewer = cli_as(cluster, tmp_path, "viewer", "viewer")
    r = viewer("cluster", "replica", "drain", name, timeout=60)
    assert r.returncode != 0 and "permission denied" in r.stderr, r.stderr
    # straight to the replica, as a viewer: refused by the role table
    creds_ch = cluster.channel(cluster.replica_addrs[name], role="viewer", name="viewer")
    with creds_ch as ch:
        with pytest.raises(grpc.RpcError) as e:
            cluster_pb2_grpc.ClusterServiceStub(ch).DrainReplica(
                cluster_pb2.DrainReplicaRequest(name=name), timeout=10
            )
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    # an operator's drain sent to another replica is refused: a replica drains only itself
    other = sorted(before)[1]
    with cluster.channel(cluster.replica_addrs[other]) as ch:
        with pytest.raises(grpc.RpcError) as e:
            cluster_pb2_grpc.ClusterServiceStub(ch).DrainReplica(
                cluster_pb2.DrainReplicaRequest(name=name), timeout=10
            )
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and f"this is replica {other}" in str(
        e.value.details()
    )
    assert replica_pids(cluster) == before  # nobody drained, nobody exited
    # the operator's command drains a follower, which its supervisor starts again
    follower = next(n for n in sorted(before) if n != cluster.leader())
    operator = cli_as(cluster, tmp_path, "operator", "admin")
    r = operator("cluster", "replica", "drain", follower, "--wait", "90", timeout=150)
    assert r.returncode == 0, r.stderr
    assert f"replica {follower} (pid {before[follower]}) drained (it did not lead)" in r.stdout
    assert f"replica {follower} serves again as pid" in r.stdout
    after = replica_pids(cluster)
    assert after[follower] != before[follower] and not pid_alive(before[follower])
