"""The servers' start-up errors in the operator's language: a real kunlun-agent, kunlun-gateway and
kunlun-platform started with a bad config print their errors (ConfigErrors of the settings and flag
validators, each problem of a list) in Chinese under LANG=zh_CN.UTF-8 and exactly as before in
English otherwise; the unmarked scan covers their entry points and validators."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from scripts import i18n as tool

ROOT = Path(__file__).resolve().parent.parent


def _start(module: str, args: list[str], lang: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LANG", "LC_", "KUNLUN_"))}
    env["LANG"] = lang
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=False,
    )


def _both(module: str, args: list[str]) -> tuple[subprocess.CompletedProcess[str], ...]:
    """The same start in Chinese and in English (at once: each is a Python start-up)."""
    with ThreadPoolExecutor(2) as pool:
        return tuple(pool.map(lambda lang: _start(module, args, lang), ("zh_CN.UTF-8", "C.UTF-8")))


def test_agent_flag_errors_in_chinese_and_english(tmp_path: Path) -> None:
    base = ["--config", str(tmp_path / "node.yaml"), "--cert-dir", str(tmp_path)]
    zh, en = _both("node_agent.main", [*base, "--endpoints", "nohost"])
    assert zh.returncode == en.returncode == 2, (zh.stderr, en.stderr)
    assert zh.stderr == "kunlun-agent: --endpoints：'nohost' 不是 host:port 格式\n"
    assert en.stderr == "kunlun-agent: --endpoints: 'nohost' is not host:port\n"


def test_gateway_config_errors_in_chinese_and_english(tmp_path: Path) -> None:
    cfg = tmp_path / "gateway.yaml"
    cfg.write_text("name: gw\nlistne: 127.0.0.1:0\nretries: many\nstatic_endpoints: [m=127.0.0.1:1]\n")
    zh, en = _both("gateway.main", ["--config", str(cfg)])
    assert zh.returncode == en.returncode == 2, (zh.stderr, en.stderr)
    assert zh.stderr == (
        "kunlun-gateway: 无效的设置：\n"
        f"  {cfg}：listne：未知字段；您是否想写 'listen'？\n"
        f"  {cfg}：retries：应为整数，实际为 'many'\n"
    )
    assert en.stderr == (
        "kunlun-gateway: invalid settings:\n"
        f"  {cfg}: listne: unknown field; did you mean 'listen'?\n"
        f"  {cfg}: retries: expected an integer, found 'many'\n"
    )
    # a validator's own error, inside the list, translated on its own
    cfg.write_text("name: gw\nretries: 9\nstatic_endpoints: [m=127.0.0.1:1]\n")
    zh, en = _both("gateway.main", ["--config", str(cfg)])
    assert zh.returncode == en.returncode == 2, (zh.stderr, en.stderr)
    assert (
        zh.stderr == f"kunlun-gateway: 无效的设置：\n  {cfg}：GatewaySettings：retries：应为 0..3，实际为 9\n"
    )
    assert (
        en.stderr
        == f"kunlun-gateway: invalid settings:\n  {cfg}: GatewaySettings: retries: expected 0..3, found 9\n"
    )
    # no certificates where the config points: the TLS check's error, the file's kind translated too
    cfg.write_text(f"name: gw\nendpoints: [127.0.0.1:1]\ncert_dir: {tmp_path / 'certs'}\n")
    zh, en = _both("gateway.main", ["--config", str(cfg)])
    assert zh.returncode == en.returncode == 2, (zh.stderr, en.stderr)
    ca = tmp_path / "certs" / "ca.crt"
    assert zh.stderr == (
        f"kunlun-gateway: CA 证书 {ca} 不存在；请用 `kunlun-cli certs init DIR` 创建证书，并让配置指向 DIR\n"
    )
    assert en.stderr == (
        f"kunlun-gateway: CA certificate {ca} does not exist; create certificates with "
        "`kunlun-cli certs init DIR` and point the config at DIR\n"
    )


def test_replica_config_error_in_chinese_and_english(tmp_path: Path) -> None:
    cfg = tmp_path / "replica.yaml"
    cfg.write_text(f"name: replica-1\ncert_dir: {tmp_path}\netcd_endpoints: []\n")
    zh, en = _both("controlplane.main", ["--config", str(cfg)])
    assert zh.returncode == en.returncode == 2, (zh.stderr, en.stderr)
    assert zh.stderr == (
        "kunlun-platform: 无效的设置：\n"
        f"  {cfg}：ReplicaSettings：etcd_endpoints：至少需要一个 etcd 端点，例如 https://127.0.0.1:2379\n"
    )
    assert en.stderr == (
        "kunlun-platform: invalid settings:\n"
        f"  {cfg}: ReplicaSettings: etcd_endpoints: at least one etcd endpoint is required, "
        "e.g. https://127.0.0.1:2379\n"
    )


def test_a_planted_unmarked_start_up_error_fails_the_scan(tmp_path: Path) -> None:
    for part in (*tool.STARTUP_MAINS, *tool.STARTUP_MODULES):
        (tmp_path / part).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / part, tmp_path / part)
    assert tool.unmarked(tmp_path) == []
    main = tmp_path / "node_agent" / "main.py"
    main.write_text(
        main.read_text() + '\n\ndef planted() -> None:\n    print("kunlun-agent: node drained")\n'
    )
    settings = tmp_path / "gateway" / "settings.py"
    settings.write_text(
        settings.read_text()
        + '\n\ndef planted(x: int) -> None:\n    raise ConfigError(f"retries: bad {x}")\n'
    )
    found = tool.unmarked(tmp_path)
    assert len(found) == 2, found
    assert found[0].startswith("node_agent/main.py:") and "'kunlun-agent: node drained'" in found[0]
    assert found[1].startswith("gateway/settings.py:") and "'retries: bad'" in found[1]


def test_agent_device_plugin_config_problems_in_chinese_and_english(tmp_path: Path) -> None:
    """Every problem of a broken device-plugin-config.yaml: the frame and each of expected, found and
    hint translated on their own; file names, field paths, device names and numbers as they are."""
    cfg = tmp_path / "node.yaml"
    base = ["--config", str(cfg), "--cert-dir", str(tmp_path), "--endpoints", "127.0.0.1:1"]
    cfg.write_text(
        "schema_version: 1\nnode:\n  name: node-a\n  address: 127.0.0.1\n  helth_interval_seconds: 2\n"
        "devices:\n  - device_type: ascend\n    device_ids: [0, 1]\n    model: 910B\n"
        '    hbm_memory_mb: "32GB"\n    supported_dtypes: [fp16]\n    topology_distance: [[0, 1], [1, 0, 2]]\n'
    )
    zh, en = _both("node_agent.main", base)
    assert zh.returncode == en.returncode == 2, (zh.stderr, en.stderr)
    group = "(node-a/ascend:0, node-a/ascend:1)"
    assert zh.stderr == (
        f"kunlun-agent: {cfg}:5：node.helth_interval_seconds：应为 已知的键，实际为 未知的键 "
        "'helth_interval_seconds'；您是否想写 'health_interval_seconds'？\n"
        f'{cfg}:10：devices[0].hbm_memory_mb {group}：应为 >= 1 的整数（MB），实际为 字符串 "32GB"；'
        "写 MB 数，例如 32768\n"
        f"{cfg}:12：devices[0].topology_distance[1] (node-a/ascend:1)：应为 此设备的一行 2 个距离值（节点声明了 "
        "2 个设备：2x2 矩阵，共 4 个值），实际为 3 个值 [1, 0, 2]；按声明顺序列出它到本节点每个设备的距离，到自身为 0\n"
    )
    assert en.stderr == (
        f"kunlun-agent: {cfg}:5: node.helth_interval_seconds: expected a known key, found unknown key "
        "'helth_interval_seconds'; did you mean 'health_interval_seconds'?\n"
        f'{cfg}:10: devices[0].hbm_memory_mb {group}: expected an integer >= 1 (MB), found string "32GB"; '
        "write the number of MB, e.g. 32768\n"
        f"{cfg}:12: devices[0].topology_distance[1] (node-a/ascend:1): expected a row of 2 distances for this "
        "device (the node declares 2 devices: a 2x2 matrix, 4 values), found 3 values [1, 0, 2]; list its "
        "distance to every device of the node in declaration order, 0 for itself\n"
    )
    # a problem without a hint, a YAML 1.1 boolean, an asymmetric matrix (one problem per device)
    cfg.write_text(
        "schema_version: 1\nnode:\n  name: node-a\n  address: 127.0.0.1\n  health_interval_seconds: 0\n"
        "devices:\n  - device_type: nvidia\n    device_ids: [0, 1]\n    model: H100\n    hbm_memory_mb: 81920\n"
        "    p2p_enabled: yes\n    supported_dtypes: [fp16]\n    topology_distance: [[0, 1], [2, 0]]\n"
    )
    zh, en = _both("node_agent.main", base)
    assert zh.returncode == en.returncode == 2, (zh.stderr, en.stderr)
    a, b = "node-a/nvidia:0", "node-a/nvidia:1"
    zh_sym = (
        f"应为 {a} 与 {b} 之间双向距离相同（对称矩阵），实际为 {a} -> {b} = 1（第 13 行），"
        f"但 {b} -> {a} = 2（第 13 行）；让这两个值相等\n"
    )
    assert zh.stderr == (
        f"kunlun-agent: {cfg}:5：node.health_interval_seconds：应为 > 0 且 <= 60 的数值（秒），实际为 整数 0\n"
        f'{cfg}:11：devices[0].p2p_enabled ({a}, {b})：应为 true 或 false，实际为 字符串 "yes"；'
        "YAML 1.1 把 yes/no/on/off 读作布尔值，YAML 1.2 和编辑器不会：请写 true 或 false\n"
        f"{cfg}:13：devices[0].topology_distance[0][1] ({a})：{zh_sym}"
        f"{cfg}:13：devices[0].topology_distance[1][0] ({b})：{zh_sym}"
    )
    en_sym = (
        f"expected the same distance both ways between {a} and {b} (a symmetric matrix), found "
        f"{a} -> {b} = 1 (line 13) but {b} -> {a} = 2 (line 13); make the two values equal\n"
    )
    assert en.stderr == (
        f"kunlun-agent: {cfg}:5: node.health_interval_seconds: expected a number > 0 and <= 60 (seconds), "
        "found integer 0\n"
        f'{cfg}:11: devices[0].p2p_enabled ({a}, {b}): expected true or false, found string "yes"; '
        "YAML 1.1 read yes/no/on/off as booleans, YAML 1.2 and editors do not: write true or false\n"
        f"{cfg}:13: devices[0].topology_distance[0][1] ({a}): {en_sym}"
        f"{cfg}:13: devices[0].topology_distance[1][0] ({b}): {en_sym}"
    )


def test_a_planted_unmarked_config_problem_fails_the_scan(tmp_path: Path) -> None:
    for part in tool.CONFIG_MODULES:
        (tmp_path / part).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / part, tmp_path / part)
    assert tool.unmarked(tmp_path) == []
    config = tmp_path / "node_agent" / "plugins" / "config.py"
    config.write_text(
        config.read_text()
        + '\n\ndef planted(n: int) -> Problem:\n    return Problem("f", n, "file", "a small file", f"{n} bytes")\n'
    )
    devices = tmp_path / "node_agent" / "plugins" / "config_devices.py"
    devices.write_text(
        devices.read_text()
        + '\n\ndef planted(e: Entry) -> None:\n    hint = "sort the ids"\n'
        + '    e.fault(None, "device_ids", Fault(msg("x", "x"), describe(None), hint))\n'
    )
    found = tool.unmarked(tmp_path)
    assert len(found) == 3, found
    assert found[0].startswith("node_agent/plugins/config.py:") and "'a small file'" in found[0]
    assert "'bytes'" in found[1]
    assert found[2].startswith("node_agent/plugins/config_devices.py:") and "'sort the ids'" in found[2]


def test_a_config_problem_travels_with_its_parts() -> None:
    """A problem's expected, found and hint are messages of their own: through gRPC metadata and back
    (another process shows it), the same message, and its English text as str() of the problem."""
    from kunlun_common.messages import from_metadata
    from node_agent.plugins.config import ConfigFileError, parse_config

    try:
        parse_config("schema_version: 1\nnode: {name: n, address: 127.0.0.1}\ndevices: []\n", "x.yaml")
    except ConfigFileError as e:
        m = e.localizable
        assert m is not None and str(m) == str(e) == str(e.problems[0])
        back = from_metadata(m.to_metadata())
        assert back == m and back is not None and str(back) == str(e)
        assert back.parts[0].named["found"].id == "config.found.empty_list"
    else:
        raise AssertionError("an empty device list was accepted")
