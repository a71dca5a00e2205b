"""Chinese (zh_CN) for kunlun-cli: every user-facing message has a translation with the same
placeholders, the catalog is compiled at build time, the real CLI speaks Chinese under LANG=zh_CN
and English without it or when the catalog is missing or corrupt, and JSON stays English."""

from __future__ import annotations

import ast
import gettext
import json
import os
import re
import shutil
import string
import subprocess
import sys
from pathlib import Path

import pytest

from controlplane.cli.localize import help_texts
from kunlun_common import po
from kunlun_common.i18n import DOMAIN, PACKAGE_LOCALEDIR, _, language, localize
from kunlun_common.messages import Message, from_metadata, msg
from scripts import i18n as tool

ROOT = Path(__file__).resolve().parent.parent

ZH_PO = PACKAGE_LOCALEDIR / "zh_CN" / "LC_MESSAGES" / f"{DOMAIN}.po"
ZH_MO = ZH_PO.with_suffix(".mo")
CLI = [sys.executable, "-m", "controlplane.cli.main"]
_PERCENT = re.compile(r"%(?:\((\w+)\))?[-#0 +]*\d*(?:\.\d+)?([sdirfgxXc%])")


def placeholders(text: str) -> tuple[set[str], list[str]]:
    """The str.format fields (with conversion and spec) and the %-style placeholders of a text."""
    braces = {
        f"{name}!{conv or ''}:{spec or ''}"
        for _, name, spec, conv in string.Formatter().parse(text)
        if name is not None
    }
    percents = sorted(f"{m.group(1) or ''}{m.group(2)}" for m in _PERCENT.finditer(text))
    return braces, percents


@pytest.fixture(scope="module")
def catalog() -> dict[tuple[str | None, str], po.Entry]:
    return {e.key: e for e in po.load(ZH_PO)}


@pytest.fixture(scope="module")
def extracted() -> list[tool.Found]:
    found, problems = tool.extract()
    assert not problems, "marked strings that cannot be extracted:\n" + "\n".join(problems)
    return found


def test_every_user_facing_message_has_a_chinese_translation(
    extracted: list[tool.Found], catalog: dict[tuple[str | None, str], po.Entry]
) -> None:
    assert len(extracted) > 150  # the scan found the CLI's help and the replicas' messages
    assert any(f.context == "workload.not_found" for f in extracted)
    missing = [f for f in extracted if not (e := catalog.get((f.context, f.msgid))) or not e.translated]
    assert not missing, (
        f"{len(missing)} user-facing strings have no zh_CN translation in {ZH_PO.relative_to(ROOT)}; run "
        "`.venv/bin/python scripts/i18n.py update`, translate the empty msgstr entries, then `make install`:\n"
        + "\n".join(f"  {f.where[0]}: {f.context or ''} {f.msgid!r}" for f in missing[:40])
    )


def test_translations_keep_the_placeholders(catalog: dict[tuple[str | None, str], po.Entry]) -> None:
    bad = []
    for e in catalog.values():
        if not e.msgid or not e.translated:
            continue
        for s in e.msgstr:
            if placeholders(s) != placeholders(e.msgid):
                bad.append(f"{e.msgid!r}: {placeholders(e.msgid)} vs {s!r}: {placeholders(s)}")
            if e.msgid.endswith("\n") != s.endswith("\n"):
                bad.append(f"{e.msgid!r}: trailing newline differs")
    assert not bad, "translations whose placeholders differ from the English:\n" + "\n".join(bad)


def test_every_cli_help_text_is_in_the_catalog(
    catalog: dict[tuple[str | None, str], po.Entry], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # help texts must not depend on the environment (a path in a help text would never match)
    monkeypatch.setenv("KUNLUN_CONFIG", str(tmp_path / "odd" / "config.yaml"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    from controlplane.cli.main import build_parser

    texts = help_texts(build_parser())
    assert len(texts) > 100
    missing = [(w, t) for w, t in texts if not (e := catalog.get((None, t))) or not e.translated]
    assert not missing, "help texts without a zh_CN translation:\n" + "\n".join(
        f"  {w}: {t!r}" for w, t in missing
    )


def test_the_built_catalog_is_the_compiled_po() -> None:
    assert ZH_MO.exists(), f"{ZH_MO} is missing: `make install` compiles the catalogs"
    assert ZH_MO.read_bytes() == po.compile_mo(po.load(ZH_PO)), (
        f"{ZH_MO} is stale: run `make install` (or `.venv/bin/python scripts/i18n.py compile`)"
    )


def test_po_reads_back_and_compiles_for_gettext(tmp_path: Path) -> None:
    text = ZH_PO.read_text(encoding="utf-8")
    assert po.dump(po.parse(text)) == text
    sample = po.parse(
        'msgid ""\nmsgstr "Content-Type: text/plain; charset=UTF-8\\nPlural-Forms: nplurals=1; plural=0;\\n"\n\n'
        'msgid "one \\"a\\"\\n"\nmsgstr ""\n"\\u4e00 \\"a\\"\\n"\n\n'
        'msgctxt "x.y"\nmsgid "{n} items"\nmsgstr "{n} \\u4e2a"\n\n'
        'msgid "%d file"\nmsgid_plural "%d files"\nmsgstr[0] "%d \\u4e2a\\u6587\\u4ef6"\n\n'
        '#, fuzzy\nmsgid "unsure"\nmsgstr "?"\n\n'
        'msgid "empty"\nmsgstr ""\n'
    )
    mo = tmp_path / "t.mo"
    mo.write_bytes(po.compile_mo(sample))
    with mo.open("rb") as f:
        t = gettext.GNUTranslations(f)
    assert t.gettext('one "a"\n') == '\u4e00 "a"\n'
    assert t.pgettext("x.y", "{n} items") == "{n} \u4e2a"
    assert t.gettext("{n} items") == "{n} items"  # only under its context
    assert t.ngettext("%d file", "%d files", 5) == "%d \u4e2a\u6587\u4ef6"
    assert t.gettext("unsure") == "unsure"  # fuzzy: left out
    assert t.gettext("empty") == "empty"
    with pytest.raises(po.PoError, match=r"t\.po:2"):
        po.parse('msgid "a"\nmsgstr b\n', "t.po")


def test_a_message_id_travels_and_falls_back_to_english(monkeypatch: pytest.MonkeyPatch) -> None:
    m = msg("workload.not_found", "workload {name!r} not found; see `kunlun-cli workload list`", name="x")
    assert str(m) == "workload 'x' not found; see `kunlun-cli workload list`"
    back = from_metadata(m.to_metadata())
    assert back == m
    assert from_metadata([("kunlun-msg", "{not json")]) is None
    assert from_metadata([("other", "x")]) is None
    monkeypatch.setenv("LANGUAGE", "zh_CN")
    assert localize(m) == "未找到工作负载 'x'；请查看 `kunlun-cli workload list`"
    # a template this catalog does not know (another version's wording): the English as sent
    other = Message("workload.not_found", "no workload {name!r}", {"name": "x"})
    assert localize(other, english="no workload 'x'") == "no workload 'x'"
    # values that do not fit the translation: English, never an exception
    assert localize(Message(m.id, m.template, {}), english="E") == "E"
    monkeypatch.setenv("LANGUAGE", "C")
    monkeypatch.setenv("LC_ALL", "C")
    assert localize(m) == str(m)


@pytest.mark.parametrize(
    ("env", "chinese"),
    [
        ({"LANG": "zh_CN.UTF-8"}, True),
        ({"LANG": "zh_CN"}, True),
        ({"LANGUAGE": "zh_CN", "LANG": "C"}, True),  # LANGUAGE first
        ({"LC_ALL": "zh_CN.UTF-8", "LANG": "en_US.UTF-8"}, True),  # then LC_ALL
        ({"LC_MESSAGES": "zh_CN.UTF-8", "LANG": "en_US.UTF-8"}, True),  # then LC_MESSAGES
        ({"LANGUAGE": "en", "LANG": "zh_CN.UTF-8"}, False),
        ({"LC_ALL": "C", "LANG": "zh_CN.UTF-8"}, False),
        ({"LANG": "en_US.UTF-8"}, False),
        ({}, False),
    ],
)
def test_the_language_follows_the_usual_gettext_order(
    env: dict[str, str], chinese: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    for k in ("LANGUAGE", "LC_ALL", "LC_MESSAGES", "LANG"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert (_("options") == "选项") is chinese
    assert (language() == "zh_CN") is chinese


def _cli(args: list[str], env: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("LANG", "LC_", "KUNLUN_"))}
    base["KUNLUN_CONFIG"] = str(tmp_path / "no-such-config.yaml")
    base["COLUMNS"] = "200"  # no wrapping of help lines
    return subprocess.run(
        [*CLI, *args], env={**base, **env}, capture_output=True, text=True, timeout=60, cwd=ROOT, check=False
    )


def test_cli_help_and_errors_in_chinese_english_otherwise(tmp_path: Path) -> None:
    zh = _cli(["workload", "--help"], {"LANG": "zh_CN.UTF-8"}, tmp_path)
    assert zh.returncode == 0, zh.stderr
    assert zh.stdout.startswith("用法：kunlun-cli workload")
    assert "从 YAML 规格或命令行参数提交工作负载（幂等）" in zh.stdout
    assert "显示此帮助信息并退出" in zh.stdout
    assert "--output" in zh.stdout and "{table,json}" in zh.stdout  # flags and choices stay
    en = _cli(["workload", "--help"], {"LANG": "C"}, tmp_path)
    assert en.stdout.startswith("usage: kunlun-cli workload")
    assert "submit a workload from a YAML spec or flags (idempotent)" in en.stdout

    usage = _cli(["workload", "scale", "x"], {"LANG": "zh_CN.UTF-8"}, tmp_path)
    assert usage.returncode == 2
    assert "kunlun-cli workload scale：错误：缺少以下必需参数：replicas" in usage.stderr
    cfg = _cli(["device", "list"], {"LANG": "zh_CN.UTF-8"}, tmp_path)
    assert cfg.returncode == 1
    assert cfg.stderr.strip() == (
        f"kunlun-cli: {tmp_path / 'no-such-config.yaml'} 处没有客户端配置：运行 `make demo`（它会写入该文件）、"
        "设置 KUNLUN_CONFIG，或传入 --config"
    )


def test_a_missing_or_corrupt_catalog_means_english(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    r = _cli(["workload", "--help"], {"LANG": "zh_CN.UTF-8", "KUNLUN_LOCALEDIR": str(empty)}, tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: kunlun-cli workload")
    corrupt = tmp_path / "corrupt" / "zh_CN" / "LC_MESSAGES"
    corrupt.mkdir(parents=True)
    (corrupt / f"{DOMAIN}.mo").write_bytes(b"\xde\x12\x04\x95 not a catalog")
    env = {"LANG": "zh_CN.UTF-8", "KUNLUN_LOCALEDIR": str(tmp_path / "corrupt")}
    cases = (
        (["workload", "--help"], 0, "usage: kunlun-cli workload"),
        (["workload", "scale", "x"], 2, "the following arguments are required: replicas"),
        (["device", "list"], 1, "no client config at"),
    )
    for args, code, english in cases:
        r = _cli(args, env, tmp_path)
        assert r.returncode == code, r.stderr
        assert "Traceback" not in r.stderr
        assert english in r.stdout + r.stderr


def test_every_user_facing_text_is_marked() -> None:
    found = tool.unmarked()
    assert not found, (
        "user-facing text not marked for translation (wrap it in _() in kunlun-cli, raise it as "
        "msg(ID, TEMPLATE, ...) in replica code; scripts/i18n.py unmarked lists them):\n" + "\n".join(found)
    )


PLANTED_CLI = """
def show(x, y, e):
    print(f"deleted {x}")
    sys.stderr.write("no such workload\\n")
    raise CliError("give a name")
    print(_("node {node} {state}").format(node=x, state="cordoned" if y else "uncordoned"))
    print(_("prompt: {p}").format(p=y or "(none given)"))
"""
PLANTED_CLI_OK = """
def show(x, y, e):
    print(_("deleted {x}").format(x=x))
    print(f"{x}: {y}", "-", x)
    raise CliError(_("give a name"))
    print((_("a {n}") if y else _("b {n}")).format(n=x))
"""
PLANTED_REPLICA = """
async def handler(spec, context, problems):
    problems.append(f"name: {spec.name!r} is not valid")
    if spec.x:
        raise InvalidInput("x: required")
    raise NotFoundError(f"workload {spec.name} not found" if spec.y else msg("a.b", "no {n}", n=1))
    await abort(context, CODE, "the client certificate was revoked")
"""
PLANTED_REPLICA_OK = """
async def handler(spec, context, problems):
    problems.append(msg("spec.name", "name: {name!r} is not valid", name=spec.name))
    raise InvalidInput(msg_list("spec.invalid", "invalid:\\n{parts}", problems))
    raise ValueError("not for users")
    await abort(context, CODE, msg("auth.revoked", "the client certificate was revoked"))
"""


def test_the_scan_finds_unmarked_text() -> None:
    cli = tool.unmarked_source(PLANTED_CLI, "controlplane/cli/planted.py", replica=False)
    assert sorted(line.split(": ", 1)[1] for line in cli) == [
        "'(none given)'",
        "'cordoned'",
        "'deleted'",
        "'give a name'",
        "'no such workload'",
        "'uncordoned'",
    ]
    assert tool.unmarked_source(PLANTED_CLI_OK, "controlplane/cli/planted.py", replica=False) == []
    replica = tool.unmarked_source(PLANTED_REPLICA, "controlplane/api/planted.py", replica=True)
    assert sorted(line.split(": ", 1)[1] for line in replica) == [
        "'name:  is not valid'",
        "'the client certificate was revoked'",
        "'workload  not found'",
        "'x: required'",
    ]
    assert tool.unmarked_source(PLANTED_REPLICA_OK, "controlplane/api/planted.py", replica=True) == []


def test_a_planted_violation_in_the_tree_fails_the_scan(tmp_path: Path) -> None:
    """The whole-tree scan, on a copy of the real sources with one new unmarked line in each part."""
    for part in ("controlplane", "kunlun_common/modelpkg"):
        shutil.copytree(ROOT / part, tmp_path / part, ignore=shutil.ignore_patterns("__pycache__"))
    assert tool.unmarked(tmp_path) == []
    cli = tmp_path / "controlplane" / "cli" / "node_cmd.py"
    cli.write_text(cli.read_text() + '\n\ndef planted() -> None:\n    print("node drained")\n')
    spec = tmp_path / "controlplane" / "workloads" / "spec.py"
    spec.write_text(spec.read_text() + '\n\ndef planted() -> None:\n    raise SpecError(f"bad {1}")\n')
    found = tool.unmarked(tmp_path)
    assert len(found) == 2
    assert found[0].startswith("controlplane/cli/node_cmd.py:") and "'node drained'" in found[0]
    assert found[1].startswith("controlplane/workloads/spec.py:") and "'bad'" in found[1]


def test_a_list_of_problems_travels_and_each_is_translated(monkeypatch: pytest.MonkeyPatch) -> None:
    from controlplane.workloads.spec import SpecError, checked
    from kunlun_common.api import workload_pb2
    from kunlun_common.i18n import error_text

    with pytest.raises(SpecError) as err:
        checked(workload_pb2.WorkloadSpec(name="Bad_Name", model="m", replicas=5000))
    e = err.value
    english = (
        "invalid workload spec:\n"
        "  name: 'Bad_Name' is not a valid name; use lowercase letters, digits, '-' and '.', at most 63\n"
        "  replicas: expected 0..1000, found 5000"
    )
    assert str(e) == english  # the details text, as before message ids
    assert e.localizable is not None
    back = from_metadata(e.localizable.to_metadata())
    assert back == e.localizable and str(back) == english
    monkeypatch.setenv("LANGUAGE", "zh_CN")
    assert error_text(e) == (
        "无效的工作负载规格：\n"
        "  name：'Bad_Name' 不是有效的名称；请使用小写字母、数字、'-' 和 '.'，最多 63 个字符\n"
        "  replicas：应为 0..1000，实际为 5000"
    )
    # a part this catalog does not know stays English, the rest is translated
    unknown = Message("spec.future", "future: {x}", {"x": 1})
    mixed = Message(back.id, back.template, back.params, (back.parts[0], unknown), back.bullet)
    assert localize(mixed).endswith("\n  future: 1")
    assert from_metadata([("kunlun-msg", '{"id": "a", "template": "t", "parts": [{"id": 1}]}')]) is None


def test_command_output_in_chinese_english_otherwise(tmp_path: Path) -> None:
    zh = _cli(["model", "keygen", "--dir", str(tmp_path / "keys-zh")], {"LANG": "zh_CN.UTF-8"}, tmp_path)
    assert zh.returncode == 0, zh.stderr
    assert "（请保密；用 --sign-key 签名）" in zh.stdout
    assert "（交给验证方：--trusted-key，或在集群中使用 `model trust add`）" in zh.stdout
    # a package error raised with a message id, printed by the command itself
    bad = tmp_path / "bad.kunlunpkg"
    bad.write_bytes(b"\0" * 1024)
    zh = _cli(["model", "verify", "--package", str(bad)], {"LANG": "zh_CN.UTF-8"}, tmp_path)
    en = _cli(["model", "verify", "--package", str(bad)], {"LANG": "C"}, tmp_path)
    assert zh.returncode == en.returncode == 2, (zh.stderr, en.stderr)
    assert zh.stderr.startswith(f"kunlun-cli: {bad}：不是模型包：第一个成员是 "), zh.stderr
    assert en.stderr.startswith(f"kunlun-cli: {bad}: not a package: the first member is "), en.stderr
    # -o json stays English whatever the language
    js = _cli(["-o", "json", "model", "verify", "--package", str(bad)], {"LANG": "zh_CN.UTF-8"}, tmp_path)
    assert json.loads(js.stdout)["error"].startswith("not a package"), js.stdout


def test_a_message_reads_exactly_as_the_f_string_it_replaced() -> None:
    import datetime as dt

    when = dt.datetime(2026, 12, 1, 7, 0, tzinfo=dt.UTC)
    path, err, data = Path("/etc/x.yaml"), ValueError("bad"), b"2"
    m = msg(
        "t.x",
        "{path!r} at {when:%Y-%m-%d}: {err!r} {data!r} {n:.1f}",
        path=path,
        when=when,
        err=err,
        data=data,
        n=2,
    )
    assert str(m) == f"{path!r} at {when:%Y-%m-%d}: {err!r} {data!r} {2:.1f}"
    back = from_metadata(m.to_metadata())  # the values travel as plain JSON (str of each)
    assert back is not None and back.params["path"] == "/etc/x.yaml" and back.params["n"] == 2
    plain = msg("t.y", "{a} {b!r}", a=1, b="x")
    assert plain.english is None and str(plain) == "1 'x'"


def test_the_verify_report_in_chinese_its_json_in_english(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from controlplane.cli.verify import report
    from controlplane.cli.verify.command import TITLES, layer_evidence_lines
    from controlplane.cli.verify.model import LayerResult, Run, Series, evidence

    def run() -> Run:
        r = Run(1_700_000_000_000, ["127.0.0.1:7000"])
        one = LayerResult(2, TITLES[2])
        one.add("preparation time", "3.2 s", "< 60 s", True, evidence("kunlun-cli workload describe x", "ok"))
        one.add("first-token latency", "900 ms", "< 500 ms", False, note="the layer stopped here")
        one.utilization.append(Series("node-a/ascend:0", [(0.0, 10.0), (1.0, 80.0)]))
        one.marks.append((0.5, "burst start"))
        r.layers += [one, LayerResult(5, TITLES[5], skipped="layer 5 stops a replica: give --disruptive")]
        return r

    monkeypatch.setenv("LANGUAGE", "zh_CN")
    zh = run()
    report.write(zh, tmp_path / "zh")
    md = (tmp_path / "zh" / "report.md").read_text()
    assert md.startswith("# Kunlun Platform 验收报告\n")
    assert "| 层级 | 检查点 | 测量值 | 阈值 | 结果 |" in md
    assert "| 2 | 首 token 延迟 | 900 ms | < 500 ms | FAIL |" in md
    assert "## 第 2 层：单卡单模型" in md and "已跳过：第 5 层会停止一个副本：请指定 --disruptive" in md
    assert "- 备注：该层在此处停止" in md
    picture = (tmp_path / "zh" / "layer2-utilization.svg").read_text()
    assert "第 2 层：各卡利用率" in picture and "突发开始" in picture and "利用率 %" in picture
    assert layer_evidence_lines(zh)[0] == "\n-- 第 2 层 / 首 token 延迟：FAIL (该层在此处停止)"
    data = json.loads((tmp_path / "zh" / "report.json").read_text())
    assert data["layers"][0]["title"] == "One model on one card"
    assert [c["name"] for c in data["layers"][0]["checkpoints"]] == [
        "preparation time",
        "first-token latency",
    ]
    assert data["layers"][1]["skipped"] == "layer 5 stops a replica: give --disruptive"
    monkeypatch.setenv("LANGUAGE", "C")
    monkeypatch.setenv("LC_ALL", "C")
    report.write(run(), tmp_path / "en")
    md = (tmp_path / "en" / "report.md").read_text()
    assert md.startswith("# Kunlun Platform acceptance report\n")
    assert "| 2 | first-token latency | 900 ms | < 500 ms | FAIL |" in md
    assert (tmp_path / "en" / "report.json").read_text() == (tmp_path / "zh" / "report.json").read_text()


def test_certificate_warnings_read_as_before_and_in_chinese(monkeypatch: pytest.MonkeyPatch) -> None:
    from controlplane.cli.cluster_cmd import certificate_warnings
    from kunlun_common.api import security_pb2

    now = 1_800_000_000.0
    certs = [
        security_pb2.CertificateInfo(
            role="agent", name="node-a", serial="1f", not_after_unix_ms=int((now + 3 * 86400) * 1000)
        ),
        security_pb2.CertificateInfo(
            role="gateway", name="gw-1", serial="2e", not_after_unix_ms=int((now - 60) * 1000)
        ),
    ]
    monkeypatch.setenv("LANGUAGE", "C")
    monkeypatch.setenv("LC_ALL", "C")
    assert certificate_warnings(certs, now, 30) == [
        "certificate gateway:gw-1 (serial 2e) EXPIRED on 2027-01-15 07:59 UTC; renew it with "
        "`kunlun-cli certs rotate DIR --name gw-1` and reload the component (SIGHUP)",
        "certificate agent:node-a (serial 1f) expires in 3 days (2027-01-18 08:00 UTC); renew it with "
        "`kunlun-cli certs rotate DIR --name node-a` and reload the component (SIGHUP)",
    ]
    monkeypatch.setenv("LANGUAGE", "zh_CN")
    assert certificate_warnings(certs, now, 30)[1] == (
        "证书 agent:node-a（序列号 1f）将在 3 天后过期（2027-01-18 08:00 UTC）；请用 "
        "`kunlun-cli certs rotate DIR --name node-a` 续签并重新加载该组件（SIGHUP）"
    )


def test_table_titles_in_chinese_aligned_by_display_width(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], extracted: list[tool.Found]
) -> None:
    """Every column title of every kunlun-cli table is extracted (by its place) and printed in the
    reader's language; Chinese titles take two columns per character and the values stay aligned;
    English output is exactly as before."""
    from controlplane.cli.output import TABLE_HEADER, print_table, width

    titles = {f.msgid for f in extracted if f.context == TABLE_HEADER}
    assert {
        "NODE",
        "DEVICE",
        "STATUS",
        "AGENT PID",
        "P95 VS BASELINE",
        "TIME",
    } <= titles  # literal and ...HEADERS
    monkeypatch.setenv("LANGUAGE", "C")
    monkeypatch.setenv("LC_ALL", "C")
    print_table(["NAME", "STATUS"], [["node-a", "Ready"]])
    assert capsys.readouterr().out == "NAME    STATUS\nnode-a  Ready\n"
    monkeypatch.setenv("LANGUAGE", "zh_CN")
    print_table(["NAME", "STATUS", "DEVICES"], [["node-a", "Ready", 4], ["node-bb", "NotReady", 12]])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "名称     状态      设备数"
    assert [
        width(line[: line.index(v)]) for line, v in zip(lines, ("状态", "Ready", "NotReady"), strict=True)
    ] == [9] * 3
    assert width("名称") == 4 and width("node-a") == 6


def test_a_table_whose_titles_cannot_be_extracted_fails_the_scan() -> None:
    bad = "from controlplane.cli.output import print_table\n\ndef f(h):\n    print_table(h, [])\n"
    ok = 'COLUMN_HEADERS = ["NAME"]\n\ndef f():\n    print_table(COLUMN_HEADERS, [])\n    print_table(["AGE"], [])\n'
    places, flagged = tool._header_places(ast.parse(bad))
    assert places == [] and len(flagged) == 1
    places, flagged = tool._header_places(ast.parse(ok))
    assert len(places) == 2 and flagged == []
