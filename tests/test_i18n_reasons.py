"""Stored reasons, verify's measured values and describe labels in the reader's language, without a
cluster (tests/test_verify_cluster.py runs the real CLI against one): a record written before
message ids, or whose reason a node replaced, shows its English text; the unmarked scan fails on a
reason or a measured value written as plain English; every describe field has a label."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from controlplane.cli.views import describe_labels, describe_lines, device_json, node_json, shown_reason
from controlplane.feeds import overlay
from controlplane.scheduler.actions import set_reason
from controlplane.scheduler.reconcile import blocked_message, blocked_reason
from kunlun_common.api import agent_pb2, types_pb2, workload_pb2
from kunlun_common.i18n import localize
from kunlun_common.messages import msg
from scripts import i18n as tool

ROOT = Path(__file__).resolve().parent.parent


def test_old_and_replaced_reasons_stay_english(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LANGUAGE", "zh_CN")
    inst = workload_pb2.Instance(id="i-1", phase="Scheduled", node="node-a")
    set_reason(inst, msg("instance.placed", "placed on {devices}", devices="node-a/ascend:0"))
    assert inst.reason == "placed on node-a/ascend:0" and inst.reason_message
    assert shown_reason(inst) == "已放置到 node-a/ascend:0"
    old = workload_pb2.Instance(reason="placed on node-a/ascend:0")  # written before message ids
    assert shown_reason(old) == "placed on node-a/ascend:0"
    # the node's own word replaces the scheduler's, and its message with it
    overlay(inst, "node-a", agent_pb2.InstanceStatus(phase="Running", reason="engine ready"))
    assert (inst.reason, inst.reason_message, shown_reason(inst)) == ("engine ready", "", "engine ready")
    # a message that no longer matches its text (another writer) is not used
    stale = workload_pb2.Instance(reason="something else", reason_message=old.reason_message or "{}")
    assert shown_reason(stale) == "something else"


def test_blocked_reason_and_its_message_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    for reasons in (
        {},
        {"node-a": "NoFreeDevice", "node-b": "NoFreeDevice"},
        {"node-a": "InsufficientMemory (needs 9 MB, 1 free)", "node-b": "Cordoned"},
        {f"node-{i}": "NoFreeDevice" if i % 2 else "Cordoned" for i in range(40)},
    ):
        assert str(blocked_message(reasons)) == blocked_reason(reasons)
    monkeypatch.setenv("LANGUAGE", "zh_CN")
    both = {"node-a": "InsufficientMemory (needs 9 MB, 1 free)", "node-b": "NoFreeDevice"}
    assert (
        localize(blocked_message(both))
        == "node-a：InsufficientMemory (needs 9 MB, 1 free); node-b：NoFreeDevice"
    )
    assert localize(blocked_message({"node-a": "NoFreeDevice"})) == "没有空闲设备（NoFreeDevice）"


def test_every_describe_field_has_a_label(monkeypatch: pytest.MonkeyPatch) -> None:
    keys = {*device_json(types_pb2.Device()), "node_ready", "node_address"}
    keys |= {*node_json(types_pb2.Node()), "protections", "note", "device_names"}
    assert keys <= set(describe_labels())
    english = describe_lines({"device_type": "npu", "p2p_bandwidth_gbps": 0.0, "supported_dtypes": []})
    assert english == ["Device type         npu", "P2p bandwidth gbps  0.0", "Supported dtypes    -"]
    monkeypatch.setenv("LANGUAGE", "zh_CN")
    shown = describe_lines({"device_type": "npu", "p2p_bandwidth_gbps": 0.0})
    assert shown == ["设备类型         npu", "P2P 带宽 (Gbps)  0.0"]  # one column: CJK is two wide


def test_a_planted_english_reason_or_measured_value_fails_the_scan(tmp_path: Path) -> None:
    shutil.copytree(
        ROOT / "controlplane", tmp_path / "controlplane", ignore=shutil.ignore_patterns("__pycache__")
    )
    assert tool.unmarked(tmp_path) == []
    planted = {
        "controlplane/scheduler/rolling.py": '    retire_instance(inst, kv, by, f"Retiring: gen {g}")\n',
        "controlplane/rollout.py": '    r.reason = "stopped by hand"\n',
        "controlplane/cli/verify/layer4.py": '    r.add("x", f"{n} of {m} on ascend", "0", True)\n',
        "controlplane/cli/verify/layer3.py": '    evidence("kunlun-cli device list (every card)", "")\n',
    }
    for where, line in planted.items():
        path = tmp_path / where
        path.write_text(path.read_text() + "\n\ndef planted() -> None:\n" + line)
    found = tool.unmarked(tmp_path)
    assert len(found) == 4, found
    assert {f.split(":", 1)[0] for f in found} == set(planted)
