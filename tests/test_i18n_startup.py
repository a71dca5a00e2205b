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
