"""Stored reasons, verify's measured values and describe labels in the reader's language, without a
cluster (tests/test_verify_cluster.py runs the real CLI against one): a record written before
message ids, or whose reason a node replaced, shows its English text; the unmarked scan fails on a
reason or a measured value written as plain English; every describe field has a label."""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from controlplane.cli.client import CliError
from controlplane.cli.verify.layer5 import Watch, missing_names, no_answer
from controlplane.cli.views import describe_labels, describe_lines, device_json, node_json, shown_reason
from controlplane.cli.workload_cmd import spec_labels
from controlplane.feeds import overlay
from controlplane.scheduler import filters
from controlplane.scheduler.actions import set_reason
from controlplane.scheduler.reasons import reason_message
from controlplane.scheduler.reconcile import blocked_message, blocked_reason, bounded_reasons
from controlplane.workloads.spec import spec_json
from kunlun_common.api import agent_pb2, types_pb2, workload_pb2
from kunlun_common.errors import ConfigError
from kunlun_common.i18n import error_text, localize
from kunlun_common.messages import msg, plain, to_stored
from kunlun_common.settings import from_mapping
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


def test_a_nodes_reason_travels_with_its_message(monkeypatch: pytest.MonkeyPatch) -> None:
    """What an agent says of its instance (a message beside the English text) reaches the instance
    record, and the CLI shows it in the reader's language; the English texts are as before."""
    from node_agent.executor.instance import Ended, describe_exit, joined

    assert describe_exit(None).reason == "the supervisor vanished without recording how the engine ended"
    ended = Ended(msg("instance.engine_exited", "engine exited with code {code}", code=3))
    why = msg(
        "instance.restart_in", "{why}; restart {restart} in {delay:.1f}s", why=ended.why, restart=2, delay=1.5
    )
    note = msg(
        "prepare.sglang_fallback",
        "SGLang is not installed on {node}: serving with kunlun-test-engine (a test engine)",
        node="node-a",
    )
    reason = joined([why, note])
    english = "engine exited with code 3; restart 2 in 1.5s; SGLang is not installed on node-a: serving with kunlun-test-engine (a test engine)"
    assert str(reason) == english
    inst = workload_pb2.Instance(id="i-1", phase="Scheduled", node="node-a")
    st = agent_pb2.InstanceStatus(phase="CrashLoopBackOff", reason=english, reason_message=to_stored(reason))
    overlay(inst, "node-a", st)
    assert inst.reason == english and inst.reason_message == st.reason_message
    monkeypatch.setenv("LANGUAGE", "zh_CN")
    assert shown_reason(inst) == (
        "引擎以退出码 3 退出；1.5 秒后进行第 2 次重启; node-a 上未安装 SGLang：使用 kunlun-test-engine（测试引擎）提供服务"
    )


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
        == "node-a：内存不足（InsufficientMemory：需要 9 MB，可用 1 MB）; node-b：没有空闲设备（NoFreeDevice）"
    )
    assert localize(blocked_message({"node-a": "NoFreeDevice"})) == "没有空闲设备（NoFreeDevice）"
    many = bounded_reasons({f"node-{i:02}": "NodeCordoned" for i in range(40)})
    assert "(37 more nodes)" in blocked_reason(many)
    assert "（另有 37 个节点）：节点已封锁（NodeCordoned）" in localize(blocked_message(many))


def test_every_filter_reason_reads_back_as_its_own_message(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each code of the feasibility stack and each formatter's text: a message (not a bare text)
    whose English text is the reason, byte for byte; translated, the code stays and the explanation
    is Chinese. Any other text is shown as it is."""
    texts = [
        *(f.reason for f in filters.FILTERS),
        filters.NO_FREE_DEVICE,
        filters.INSUFFICIENT_DEVICES,
        filters.unsupported_dtype("int8", ("fp16", "bf16")),
        filters.unsupported_dtype("fp8", ()),
        filters.insufficient_memory(40000, 32768),
        filters.too_hot(91.5, 85),
        filters.too_hot(85, 85),
        filters.insufficient_devices(5, 4),
    ]
    texts.append("UnsupportedEngine (sglang on iluvatar: upstream SGLang has no Iluvatar CoreX device)")
    ids = set()
    for text in texts:
        m = reason_message(text)
        assert m.id != "text" and str(m) == text, (text, m)
        ids.add(m.id)
    assert len(ids) == len(set(texts)) - 1  # one message per form (the two UnsupportedDtype lists share one)
    assert reason_message("SomethingNew (from a newer replica)") == plain(
        "SomethingNew (from a newer replica)"
    )
    assert reason_message("InsufficientMemory (needs lots)").id == "text"
    monkeypatch.setenv("LANGUAGE", "zh_CN")
    for text in texts:
        shown = localize(reason_message(text))
        code = text.split(" ", 1)[0]
        assert code in shown and shown != text and re.search(r"[\u4e00-\u9fff]", shown), (text, shown)
    engine = localize(reason_message(texts[-1]))
    assert (
        engine
        == "不支持该引擎（UnsupportedEngine：sglang 无法在 iluvatar 上运行：上游 SGLang 不支持天数智芯 CoreX 设备）"
    )


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


def test_every_spec_field_has_a_label(monkeypatch: pytest.MonkeyPatch) -> None:
    """`workload describe`'s spec lines: in English the JSON key as always, under zh_CN a Chinese label."""
    keys = set(spec_json(workload_pb2.WorkloadSpec()))
    assert {k: v for k, v in spec_labels().items() if k in keys} == {k: k for k in keys}
    monkeypatch.setenv("LANGUAGE", "zh_CN")
    labels = spec_labels()
    assert keys <= set(labels) and all(re.search(r"[\u4e00-\u9fff]", labels[k]) for k in keys)


def test_layer5_reads_nobody_answered_in_chinese(monkeypatch: pytest.MonkeyPatch) -> None:
    """verify layer 5's `missing:` list: the workloads a read missed and the reads no replica
    answered, in English as before (`(no answer: ERROR) xN`) and wrapped in Chinese under zh_CN."""
    w = Watch()
    error = "no replica answered (127.0.0.1:1: unavailable)"
    w.missing.update([no_answer(w, CliError(error)), no_answer(w, CliError(error)), "kunlun-verify-a"])
    assert str(missing_names(w)) == f"(no answer: {error}) x2, kunlun-verify-a x1"
    monkeypatch.setenv("LANGUAGE", "zh_CN")
    assert localize(missing_names(w)) == f"（无副本应答：{error}） ×2, kunlun-verify-a ×1"


@dataclass(frozen=True)
class _Typed:
    names: tuple[str, ...] = ()
    limit: int | None = None


def test_list_and_alternative_types_read_in_chinese(monkeypatch: pytest.MonkeyPatch) -> None:
    """A settings field of a list or an alternative type, given the wrong type: English as before,
    and under zh_CN without English words in the type's description."""
    with pytest.raises(ConfigError) as e:
        from_mapping(_Typed, {"names": "a", "limit": "b"}, "x.yaml")
    assert str(e.value) == (
        "invalid settings:\n  x.yaml: names: expected a list of a string, found 'a'\n"
        "  x.yaml: limit: expected an integer or null, found 'b'"
    )
    monkeypatch.setenv("LANGUAGE", "zh_CN")
    shown = error_text(e.value)
    assert "字符串列表" in shown and "整数或null" in shown and "a list of" not in shown, shown


def test_preparation_and_package_refusals_travel_as_messages(monkeypatch: pytest.MonkeyPatch) -> None:
    """Why an agent could not prepare an instance (a package it cannot use, a device that is not its
    own) is a message: the English text as before, the Chinese one on the client."""
    from kunlun_common.messages import of_error
    from node_agent.executor.package_cache import CacheFull
    from node_agent.executor.packages import PackageRefused, check_ref

    with pytest.raises(PackageRefused) as refused:
        check_ref("qwen")
    assert str(refused.value) == "package: 'qwen' is not NAME@sha256:DIGEST"
    why = msg(
        "prepare.package_problem",
        "package {package}…: {error}",
        package="qwen",
        error=of_error(refused.value),
    )
    assert str(why) == "package qwen…: package: 'qwen' is not NAME@sha256:DIGEST"
    full = CacheFull(msg("package.no_replica", "no replica endpoint"))
    assert str(full) == "no replica endpoint" and of_error(full).id == "package.no_replica"
    monkeypatch.setenv("LANGUAGE", "zh_CN")
    assert localize(why) == "模型包 qwen…：package：'qwen' 不是 NAME@sha256:DIGEST 形式"
    assert localize(of_error(full)) == "没有副本端点"
