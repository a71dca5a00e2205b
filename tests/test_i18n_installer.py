"""kunlun-installer's config checks in the operator's language: run the way an operator runs it, from a
zip on PYTHONPATH (the bundle's wheel; the catalog read from inside it), with a release whose own loader
(a real process of this tree) refuses the file, the refusal names the step, the file and the field in
Chinese under LANG=zh_CN.UTF-8 and exactly as before in English; the unmarked scan covers the checks."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from scripts import i18n as tool

ROOT = Path(__file__).resolve().parent.parent
DRIVER = """
import sys
from pathlib import Path
from kunlun_installer import host
from kunlun_installer.errors import InstallError
assert host.__file__.startswith(sys.argv[1]), host.__file__  # from the zip, as from the wheel
try:
    if sys.argv[2] == "etcd":
        host.check_etcd_env(Path(sys.argv[4]))
    else:
        host.check_config(Path(sys.argv[3]), sys.argv[2], Path(sys.argv[4]))
except InstallError as e:
    print(f"kunlun-installer: {e.shown()}", file=sys.stderr)
    sys.exit(2)
"""


def _wheel_like(tmp: Path) -> Path:
    """kunlun_common and kunlun_installer (with the compiled catalog) in one zip, as in the wheel."""
    out = tmp / "kunlun.zip"
    with zipfile.ZipFile(out, "w") as z:
        for pkg in ("kunlun_common", "kunlun_installer"):
            for path in sorted((ROOT / pkg).rglob("*")):
                if path.is_file() and "__pycache__" not in path.parts:
                    z.write(path, path.relative_to(ROOT).as_posix())
    return out


def _release(tmp: Path) -> Path:
    """A release folder whose venv python is this tree's (its loaders are the real ones)."""
    rel = tmp / "releases" / "v1"
    py = rel / "venv" / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    py.chmod(0o755)
    return rel


def _check(wheel: Path, rel: Path, role: str, config: Path, lang: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(wheel), "LANG": lang}
    return subprocess.run(
        [sys.executable, "-c", DRIVER, str(wheel), role, str(rel), str(config)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",
        check=False,
    )


def test_config_check_refusals_in_chinese_and_english(tmp_path: Path) -> None:
    wheel, rel = _wheel_like(tmp_path), _release(tmp_path)
    node = tmp_path / "device-plugin-config.yaml"
    node.write_text("schema_version: 1\nnode: {name: n, address: 127.0.0.1}\ndevices: []\n")
    gateway = tmp_path / "gateway.yaml"
    gateway.write_text("name: gateway-1\nlisten: 127.0.0.1:8080\nrequire_api_kye: true\n")
    etcd = tmp_path / "etcd.env"
    etcd.write_text("ETCD_NAME=etcd-1\nETCD_DATA_DIR=/var/lib/etcd\n")
    cases = [("worker", node), ("gateway", gateway), ("etcd", etcd)]
    with ThreadPoolExecutor(6) as pool:
        runs = [
            pool.submit(_check, wheel, rel, role, cfg, lang)
            for role, cfg in cases
            for lang in ("zh_CN.UTF-8", "C.UTF-8")
        ]
        (zh_w, en_w), (zh_g, en_g), (zh_e, en_e) = (
            (runs[i].result(), runs[i + 1].result()) for i in (0, 2, 4)
        )
    for r in (zh_w, en_w, zh_g, en_g, zh_e, en_e):
        assert r.returncode == 2, r.stdout + r.stderr
    assert zh_w.stdout == f"[检查配置] {node}：由该版本自己的加载器读取\n"
    assert zh_w.stderr == (
        f"kunlun-installer: 步骤“检查配置”失败：{node}：node_agent.plugins.config.ConfigFileError: {node}:3："
        "devices：应为 非空的设备列表，实际为 空列表；在 devices: 下声明本节点的加速卡，参见 deploy/examples/；"
        "请修正该文件后重新运行 install\n"
    )
    assert en_w.stdout == f"[check config] {node}: read by the release's own loader\n"
    assert en_w.stderr == (
        f"kunlun-installer: step 'check config' failed: {node}: node_agent.plugins.config.ConfigFileError: "
        f"{node}:3: devices: expected a non-empty list of devices, found an empty list; declare the node's "
        "accelerators under devices:, see deploy/examples/; fix the file and run install again\n"
    )
    assert zh_g.stderr == (
        f"kunlun-installer: 步骤“检查配置”失败：{gateway}：  {gateway}：require_api_kye：未知字段；"
        "您是否想写 'require_api_key'？；请修正该文件后重新运行 install\n"
    )
    assert en_g.stderr == (
        f"kunlun-installer: step 'check config' failed: {gateway}:   {gateway}: require_api_kye: unknown field; "
        "did you mean 'require_api_key'?; fix the file and run install again\n"
    )
    missing = "ETCD_LISTEN_CLIENT_URLS, ETCD_ADVERTISE_CLIENT_URLS"
    assert zh_e.stderr == (
        f"kunlun-installer: 步骤“检查配置”失败：{etcd}：缺少 {missing}；参见 examples/etcd.env\n"
    )
    assert en_e.stderr == (
        f"kunlun-installer: step 'check config' failed: {etcd}: missing {missing}; see examples/etcd.env\n"
    )


def test_a_planted_unmarked_installer_check_fails_the_scan(tmp_path: Path) -> None:
    for part in tool.INSTALLER_CHECKS:
        (tmp_path / part).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / part, tmp_path / part)
    assert tool.unmarked(tmp_path) == []
    host = tmp_path / "kunlun_installer" / "host.py"
    text = host.read_text()
    anchor = '    py = rel / "venv" / "bin" / "python"\n    r = subprocess.run(\n        [str(py), "-c", _LOADER.format(code=code), str(path)]'
    assert text.count(anchor) == 1
    planted = '    say("check config", f"{path}: looks fine")\n'
    host.write_text(
        text.replace(anchor, planted + anchor) + '\n\ndef other() -> None:\n    say("x", "not a check")\n'
    )
    found = tool.unmarked(tmp_path)
    assert len(found) == 2, found
    assert "'check config'" in found[0] and "looks fine'" in found[1]
