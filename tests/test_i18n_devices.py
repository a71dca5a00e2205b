"""Why a device cannot be used, in the reader's language: a real kunlun-device-probe prints every line,
its help and its errors in Chinese under LANG=zh_CN.UTF-8 and exactly as before in English, while
`-o json` stays English; the reasons the agent gives its devices (vendor tool errors, cross-checks,
health notes) are messages that travel beside their English text; the unmarked scan covers the
modules that make them."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kunlun_common.messages import from_stored
from node_agent.plugins.standin.state import SimChip, write_state
from scripts import i18n as tool

ROOT = Path(__file__).resolve().parent.parent
NODE_A = ROOT / "deploy" / "examples" / "node-a.yaml"
_SECONDS = re.compile(r"\d+\.\d\d (s|秒)")


def _probe(args: list[str], lang: str, path: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LANG", "LC_", "KUNLUN_"))}
    env["LANG"] = lang
    if path is not None:
        env["PATH"] = path
    r = subprocess.run(
        [sys.executable, "-m", "node_agent.probe", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        check=False,
    )
    r.stdout = _SECONDS.sub(r"T \1", r.stdout)  # how long a tool ran is the one thing that varies
    return r


def _both(args: list[str], path: str | None = None) -> tuple[subprocess.CompletedProcess[str], ...]:
    """The same probe in Chinese and in English (at once: each is a Python start-up)."""
    with ThreadPoolExecutor(2) as pool:
        return tuple(pool.map(lambda lang: _probe(args, lang, path), ("zh_CN.UTF-8", "C.UTF-8")))


def _node(tmp_path: Path, simulated: bool, chips: list[SimChip]) -> Path:
    state = tmp_path / "state.json"
    write_state(state, chips)
    mode = f"simulated: true\n  simulator_state: {state}" if simulated else "simulated: false"
    config = tmp_path / "node.yaml"
    config.write_text(NODE_A.read_text().replace("simulated: true", mode))
    return config


def test_probe_of_a_node_with_a_missing_a_wrong_and_a_warning_chip(tmp_path: Path) -> None:
    chips = [
        SimChip("ascend", 0, "910B3", 32768, utilization_pct=12.5, memory_used_mb=100),
        SimChip("ascend", 1, "910B3", 32768, health="Warning"),
        SimChip("ascend", 2, "910B3", 32768, present=False),
        SimChip("ascend", 3, "910A", 16384),
    ]
    cfg = _node(tmp_path, True, chips)
    agent = tmp_path / "agent"
    zh, en = _both(["--config", str(cfg), "--state-dir", str(agent)])
    assert zh.returncode == en.returncode == 1, (zh.stderr, en.stderr)
    rows = ["[0, 1, 2, 2]", "[1, 0, 2, 2]", "[2, 2, 0, 1]", "[2, 2, 1, 0]"]
    zh_decl = "".join(
        f"  node-a/ascend:{i}：声明于 {cfg}:11：类型 ascend，索引 {i}，型号 910B，32768 MB，p2p 开，拓扑行 {row}\n"
        for i, row in enumerate(rows)
    )
    zh_missing = "ascend:2 已声明，但 npu-smi 没有找到它（它报告的索引：0, 1, 3）"
    zh_wrong = (
        "ascend:3：声明的型号为 '910B'，npu-smi 报告为 '910A'; ascend:3：声明 32768 MB，npu-smi 报告 16384 MB"
    )
    assert zh.stdout == (
        f"第 1 步：读取 {cfg}\n"
        "  正常：节点 node-a，地址 127.0.0.1，模拟 true，每 1 秒检查健康，4 个设备，类型 ascend\n"
        f"{zh_decl}"
        "第 2 步：工具环境\n"
        f"  模式：模拟（node.simulated: true）：使用替身厂商工具，垫片位于 {agent}/sim-bin\n"
        f"  替身状态文件：{tmp_path}/state.json；给出 --state-dir 可查看某个代理自己的状态\n"
        "第 3 步：运行厂商工具\n"
        f"  ascend：运行 `npu-smi info`（{agent}/sim-bin/npu-smi）\n"
        "    -> T 秒内成功：报告了 3 个设备\n"
        "       索引 0：型号 '910B3'，32768 MB，健康状态 OK\n"
        "       索引 1：型号 '910B3'，32768 MB，健康状态 Warning\n"
        "       索引 3：型号 '910A'，16384 MB，健康状态 OK\n"
        "第 4 步：构建设备\n"
        f"  node-a/ascend:0：由 {cfg}:11 的声明构建\n"
        "    npu-smi 索引 0：型号 '910B3'，32768 MB，健康状态 OK，繁忙 12%，已用 100 MB\n"
        "    -> Ready\n"
        f"  node-a/ascend:1：由 {cfg}:11 的声明构建\n"
        "    npu-smi 索引 1：型号 '910B3'，32768 MB，健康状态 Warning，繁忙 0%，已用 0 MB\n"
        "    -> Ready（npu-smi 报告健康状态为 Warning）\n"
        f"  node-a/ascend:2：由 {cfg}:11 的声明构建\n"
        f"    -> Error（{zh_missing}）\n"
        f"  node-a/ascend:3：由 {cfg}:11 的声明构建\n"
        f"    -> Error（{zh_wrong}）\n"
        "第 5 步：结果\n"
        "  设备             类型    型号  状态   原因\n"  # titles as kunlun-cli's, aligned by display width
        "  node-a/ascend:0  ascend  910B  Ready\n"
        "  node-a/ascend:1  ascend  910B  Ready  npu-smi 报告健康状态为 Warning\n"
        f"  node-a/ascend:2  ascend  910B  Error  {zh_missing}\n"
        f"  node-a/ascend:3  ascend  910B  Error  {zh_wrong}\n"
        f"4 个设备中有 2 个不可用（配置文件 {cfg}）：\n"
        f"  node-a/ascend:2：Error：{zh_missing}\n"
        f"  node-a/ascend:3：Error：{zh_wrong}\n"
    )
    en_decl = "".join(
        f"  node-a/ascend:{i}: declared at {cfg}:11: type ascend, index {i}, model 910B, 32768 MB, p2p on, "
        f"topology row {row}\n"
        for i, row in enumerate(rows)
    )
    en_missing = "ascend:2 declared but not found by npu-smi (indexes it reports: 0, 1, 3)"
    en_wrong = (
        "ascend:3: declared model '910B', npu-smi reports '910A'; ascend:3: declared 32768 MB, npu-smi "
        "reports 16384 MB"
    )
    assert en.stdout == (
        f"step 1: reading {cfg}\n"
        "  ok: node node-a, address 127.0.0.1, simulated true, health every 1 s, 4 device(s) of type ascend\n"
        f"{en_decl}"
        "step 2: tool environment\n"
        f"  mode: simulated (node.simulated: true): stand-in vendor tools, shims in {agent}/sim-bin\n"
        f"  stand-in state file: {tmp_path}/state.json; give --state-dir to see an agent's own state\n"
        "step 3: running the vendor tools\n"
        f"  ascend: running `npu-smi info` ({agent}/sim-bin/npu-smi)\n"
        "    -> ok in T s: 3 device(s) reported\n"
        "       index 0: model '910B3', 32768 MB, health OK\n"
        "       index 1: model '910B3', 32768 MB, health Warning\n"
        "       index 3: model '910A', 16384 MB, health OK\n"
        "step 4: building the devices\n"
        f"  node-a/ascend:0: built from the declaration at {cfg}:11\n"
        "    npu-smi index 0: model '910B3', 32768 MB, health OK, 12% busy, 100 MB used\n"
        "    -> Ready\n"
        f"  node-a/ascend:1: built from the declaration at {cfg}:11\n"
        "    npu-smi index 1: model '910B3', 32768 MB, health Warning, 0% busy, 0 MB used\n"
        "    -> Ready (npu-smi reports health Warning)\n"
        f"  node-a/ascend:2: built from the declaration at {cfg}:11\n"
        f"    -> Error ({en_missing})\n"
        f"  node-a/ascend:3: built from the declaration at {cfg}:11\n"
        f"    -> Error ({en_wrong})\n"
        "step 5: result\n"
        "  DEVICE           TYPE    MODEL  STATUS  REASON\n"
        "  node-a/ascend:0  ascend  910B   Ready\n"
        "  node-a/ascend:1  ascend  910B   Ready   npu-smi reports health Warning\n"
        f"  node-a/ascend:2  ascend  910B   Error   {en_missing}\n"
        f"  node-a/ascend:3  ascend  910B   Error   {en_wrong[:97]}...\n"  # the table shortens to 100
        f"2 of 4 devices unusable (config file {cfg}):\n"
        f"  node-a/ascend:2: Error: {en_missing}\n"
        f"  node-a/ascend:3: Error: {en_wrong}\n"
    )


def test_probe_json_stays_english_under_zh_cn(tmp_path: Path) -> None:
    """`-o json` under LANG=zh_CN: every text English (log, why, reasons), no message field added."""
    cfg = _node(tmp_path, False, [])
    r = _probe(["--config", str(cfg), "-o", "json"], "zh_CN.UTF-8", path=str(tmp_path / "bin"))
    assert r.returncode == 1, r.stderr
    report = json.loads(r.stdout)
    assert report["log"][0] == f"step 1: reading {cfg}"
    assert report["log"][-1] == f"  ascend: {report['tools'][0]['error']}"
    assert report["why"][0] == f"no usable device on node node-a (config file {cfg}):"
    assert report["tools"][0]["error"].startswith(f"npu-smi not found on PATH ({tmp_path / 'bin'})")
    assert all(set(d) >= {"status_reason"} and "status_reason_message" not in d for d in report["devices"])
    assert not re.search(r"[\u4e00-\u9fff]", r.stdout), "a Chinese text in -o json"


def test_probe_missing_tool_bad_file_and_help_in_chinese_and_english(tmp_path: Path) -> None:
    cfg = _node(tmp_path, False, [])
    bad = tmp_path / "bad.yaml"
    bad.write_text("schema_version: 1\nnode: {name: n, address: 127.0.0.1}\ndevices: []\n")
    bin_dir = tmp_path / "bin"
    with ThreadPoolExecutor(6) as pool:
        runs = [
            pool.submit(_probe, args, lang, str(bin_dir))
            for args in (["--config", str(cfg)], ["--config", str(bad)], ["--help"])
            for lang in ("zh_CN.UTF-8", "C.UTF-8")
        ]
        (zh, en), (zh_bad, en_bad), (zh_help, en_help) = (
            (runs[i].result(), runs[i + 1].result()) for i in (0, 2, 4)
        )
    assert zh.returncode == en.returncode == 1, (zh.stderr, en.stderr)
    zh_tool = (
        f"运行 `npu-smi info` 时在 PATH（{bin_dir}）上找不到 npu-smi；请安装提供 npu-smi 的厂商驱动和工具包，"
        "或把它所在的目录加入 PATH（模拟模式下，用 node_agent.plugins.standin.state.install_shims 安装替身垫片）"
    )
    zh_after = zh.stdout.split("第 2 步：工具环境\n", 1)[1]
    assert zh_after == (
        "  模式：真实硬件：在本进程的 PATH 上查找厂商工具\n"
        "第 3 步：运行厂商工具\n"
        "  ascend：运行 `npu-smi info`（PATH 上找不到）\n"
        f"    -> T 秒后失败：{zh_tool}\n"
        "第 4 步：构建设备\n"
        + "".join(
            f"  node-a/ascend:{i}：由 {cfg}:10 的声明构建\n    -> Error（npu-smi 无法使用，见第 3 步）\n"
            for i in range(4)
        )
        + "第 5 步：结果\n  设备             类型    型号  状态   原因\n"
        + "".join(f"  node-a/ascend:{i}  ascend  910B  Error  {zh_tool[:97]}...\n" for i in range(4))
        + f"节点 node-a 上没有可用设备（配置文件 {cfg}）：\n  ascend：{zh_tool}\n"
    )
    en_tool = (
        f"npu-smi not found on PATH ({bin_dir}) while running `npu-smi info`; install the vendor driver and "
        "toolkit that provide npu-smi, or add its directory to PATH (in simulated mode, install the stand-in "
        "shims with node_agent.plugins.standin.state.install_shims)"
    )
    en_after = en.stdout.split("step 2: tool environment\n", 1)[1]
    assert en_after == (
        "  mode: real hardware: the vendor tools are looked up on this process's PATH\n"
        "step 3: running the vendor tools\n"
        "  ascend: running `npu-smi info` (not found on PATH)\n"
        f"    -> failed after T s: {en_tool}\n"
        "step 4: building the devices\n"
        + "".join(
            f"  node-a/ascend:{i}: built from the declaration at {cfg}:10\n"
            "    -> Error (npu-smi could not be used, see step 3)\n"
            for i in range(4)
        )
        + "step 5: result\n  DEVICE           TYPE    MODEL  STATUS  REASON\n"
        + "".join(f"  node-a/ascend:{i}  ascend  910B   Error   {en_tool[:97]}...\n" for i in range(4))
        + f"no usable device on node node-a (config file {cfg}):\n  ascend: {en_tool}\n"
    )

    assert zh_bad.returncode == en_bad.returncode == 2
    assert zh_bad.stdout == (
        f"第 1 步：读取 {bad}\n  该文件无法使用（1 个问题）：\n"
        f"    {bad}:3：devices：应为 非空的设备列表，实际为 空列表；在 devices: 下声明本节点的加速卡，参见 deploy/examples/\n"
    )
    assert en_bad.stdout == (
        f"step 1: reading {bad}\n  the file cannot be used (1 problem(s)):\n"
        f"    {bad}:3: devices: expected a non-empty list of devices, found an empty list; declare the node's "
        "accelerators under devices:, see deploy/examples/\n"
    )

    assert zh_help.returncode == en_help.returncode == 0
    assert zh_help.stdout.startswith("用法：kunlun-device-probe [-h] --config CONFIG")
    assert "\n逐步展示节点代理会如何发现它的设备，而不启动它。\n" in zh_help.stdout
    assert "  --config CONFIG       本节点的 device-plugin-config.yaml\n" in zh_help.stdout
    assert "模拟模式：代理的状态目录（默认：新建一个临时目录）" in zh_help.stdout
    assert en_help.stdout.startswith("usage: kunlun-device-probe [-h] --config CONFIG")
    assert "  --config CONFIG       the node's device-plugin-config.yaml\n" in en_help.stdout


def test_a_device_reason_travels_with_its_message(tmp_path: Path) -> None:
    """What the agent sends: `status_reason` in English, `status_reason_message` the same reason as a
    message whose English text equals it (a client translates it; a stale one is ignored)."""
    from node_agent.plugins.config import load_config
    from node_agent.plugins.vendor_plugin import VendorPlugin

    cfg = _node(tmp_path, False, [])
    plugin = VendorPlugin(load_config(str(cfg)), "ascend", {"PATH": str(tmp_path / "bin")})
    plugin.apply(plugin.poll())
    dev = plugin.devices()[0]
    m = from_stored(dev.status_reason_message, dev.status_reason)
    assert m is not None and m.id == "device.tool.not_found" and str(m) == dev.status_reason
    assert from_stored(dev.status_reason_message, dev.status_reason + " (changed)") is None


def test_a_planted_unmarked_device_reason_fails_the_scan(tmp_path: Path) -> None:
    parts = [*tool.DEVICE_MODULES, *tool.PROBE_MODULES]
    for part in parts:
        src = ROOT / part
        if src.is_dir():
            shutil.copytree(src, tmp_path / part)
        else:
            (tmp_path / part).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, tmp_path / part)
    assert tool.unmarked(tmp_path) == []
    base = tmp_path / "node_agent" / "vendors" / "base.py"
    base.write_text(
        base.read_text()
        + '\n\ndef planted(tool: str, c: list[str]) -> ToolFailed:\n    return ToolFailed(f"{tool} crashed", tool=tool, command=c)\n'
    )
    plugin = tmp_path / "node_agent" / "plugins" / "vendor_plugin.py"
    plugin.write_text(
        plugin.read_text()
        + "\n\ndef planted(reasons: list[Message], t: str) -> Message:\n"
        + '    reasons.append(f"{t} reports a hot chip")\n'
        + '    return msg("x", "{tool} is {what}", tool=t, what="slow")\n'
    )
    probe = tmp_path / "node_agent" / "probe.py"
    probe.write_text(
        probe.read_text() + '\n\ndef planted(out: Report) -> None:\n    out.say("step 6: done")\n'
    )
    found = tool.unmarked(tmp_path)
    assert len(found) == 4, found
    assert found[0].startswith("node_agent/vendors/base.py:") and "'crashed'" in found[0]
    assert "'reports a hot chip'" in found[1] and "'slow'" in found[2]
    assert found[3].startswith("node_agent/probe.py:") and "'step 6: done'" in found[3]


def test_a_declaration_problem_of_a_loaded_config_travels_with_its_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A config that loads with one device's row wrong: that device is in Error with the problem as its
    reason, English as the agent always sent it, and its message (expected, found, hint each
    translated) what a client shows in Chinese."""
    from kunlun_common.i18n import localize
    from node_agent.devices import DeviceManager
    from node_agent.plugins.config import load_config

    cfg = tmp_path / "node.yaml"
    cfg.write_text(
        NODE_A.read_text()
        .replace("- [1, 0, 2, 2]", "- [1, 0, 2]")
        .replace("simulated: true", "simulated: false")
    )
    manager = DeviceManager(load_config(str(cfg)), {"PATH": str(tmp_path / "bin")})
    manager.sample_blocking()
    dev = manager.devices()[1]
    where = f"{cfg}:18: devices[0].topology_distance[1] (node-a/ascend:1)"
    assert dev.status_reason == (
        f"{where}: expected a row of 4 distances for this device (the node declares 4 devices: a 4x4 matrix, "
        "16 values), found 3 values [1, 0, 2]; list its distance to every device of the node in declaration "
        "order, 0 for itself"
    )
    m = from_stored(dev.status_reason_message, dev.status_reason)
    assert m is not None
    monkeypatch.setenv("LANGUAGE", "zh_CN")
    assert localize(m) == (
        f"{cfg}:18：devices[0].topology_distance[1] (node-a/ascend:1)：应为 此设备的一行 4 个距离值（节点声明了 4 个"
        "设备：4x4 矩阵，共 16 个值），实际为 3 个值 [1, 0, 2]；按声明顺序列出它到本节点每个设备的距离，到自身为 0"
    )
