"""The message catalogs: extract the user-facing strings, update the .po files, compile the .mo files.

    python scripts/i18n.py compile    # every kunlun_common/locale/*/LC_MESSAGES/kunlun.po -> .mo (make install)
    python scripts/i18n.py update     # add the strings the code has and the catalogs lack (empty msgstr),
                                      # drop the ones the code no longer has, refresh the #: locations
    python scripts/i18n.py missing    # list the strings a catalog does not translate; exit 1 if any

What counts as user-facing (`extract`): every `_()`, `ngettext()`, `pgettext()` and `msg()` call in the
packages, found by an AST scan (their text must be a literal); every help text, description and group
title of kunlun-cli's argparse tree; and the argparse strings a user can see (controlplane/cli/localize.py).
tests/test_i18n.py fails while a catalog misses one or a translation's placeholders differ.
"""

from __future__ import annotations

import ast
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from kunlun_common import po
from kunlun_common.i18n import DOMAIN, PACKAGE_LOCALEDIR

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = (
    "controlplane",
    "node_agent",
    "gateway",
    "kunlun_common",
    "devcluster",
    "kunlun_installer",
    "chaos",
)
"""Where the AST scan looks for marked strings."""
SKIP = ("kunlun_common/i18n.py",)
"""Modules that define the marks (their calls pass values through, not texts)."""
HEADER = (
    "Project-Id-Version: kunlun-platform\n"
    "Language: {lang}\n"
    "MIME-Version: 1.0\n"
    "Content-Type: text/plain; charset=UTF-8\n"
    "Content-Transfer-Encoding: 8bit\n"
    "Plural-Forms: nplurals=1; plural=0;\n"
)


@dataclass
class Found:
    """One extracted string and where it is used."""

    msgid: str
    context: str | None = None
    plural: str | None = None
    where: list[str] = field(default_factory=list)


def _literal(node: ast.expr) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def scan_source(text: str, source: str) -> tuple[list[Found], list[str]]:
    """The marked strings of one module, and the problems (a mark whose text is not a literal)."""
    found: list[Found] = []
    problems: list[str] = []
    for node in ast.walk(ast.parse(text, source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        name, args, where = node.func.id, node.args, f"{source}:{node.lineno}"
        want = {"_": 1, "ngettext": 2, "pgettext": 2, "msg": 2}.get(name)
        if want is None:
            continue
        texts = [_literal(a) for a in args[:want]]
        if len(texts) < want or any(t is None for t in texts):
            problems.append(f"{where}: {name}() needs literal text (put values in with .format afterwards)")
            continue
        t = [x for x in texts if x is not None]
        if name == "_":
            found.append(Found(t[0], where=[where]))
        elif name == "ngettext":
            found.append(Found(t[0], plural=t[1], where=[where]))
        else:  # pgettext(context, text) and msg(id, template)
            found.append(Found(t[1], context=t[0], where=[where]))
    return found, problems


def scan_code(root: Path = ROOT) -> tuple[list[Found], list[str]]:
    found: list[Found] = []
    problems: list[str] = []
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel in SKIP or rel.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            f, p = scan_source(path.read_text(encoding="utf-8"), rel)
            found += f
            problems += p
    return found, problems


def cli_texts() -> list[Found]:
    """kunlun-cli's help texts (as written, in English) and the argparse strings users see."""
    from controlplane.cli.localize import ARGPARSE_STRINGS, help_texts
    from controlplane.cli.main import build_parser

    out = [Found(text, where=[f"kunlun-cli: {where}"]) for where, text in help_texts(build_parser())]
    return out + [Found(s, where=["argparse"]) for s in ARGPARSE_STRINGS]


def extract() -> tuple[list[Found], list[str]]:
    """Every user-facing string (merged by context and text, in order of first use) and the problems."""
    code, problems = scan_code()
    merged: dict[tuple[str | None, str], Found] = {}
    for f in [*code, *cli_texts()]:
        have = merged.get((f.context, f.msgid))
        if have is None:
            merged[(f.context, f.msgid)] = Found(f.msgid, f.context, f.plural, list(f.where))
        else:
            have.where += f.where
            if have.plural is None:
                have.plural = f.plural
    return list(merged.values()), problems


def catalogs() -> list[Path]:
    return sorted(PACKAGE_LOCALEDIR.glob(f"*/LC_MESSAGES/{DOMAIN}.po"))


def update(path: Path, found: list[Found]) -> tuple[int, int]:
    """Bring one catalog in line with the code; returns (added, dropped)."""
    lang = path.parent.parent.name
    old = {e.key: e for e in po.load(path)} if path.exists() else {}
    header = old.pop((None, ""), None) or po.Entry("", [HEADER.format(lang=lang)])
    entries = [header]
    added = 0
    for f in found:
        e = old.pop((f.context, f.msgid), None)
        if e is None:
            added += 1
            e = po.Entry(f.msgid, [""], f.context, f.plural)
        e.plural = f.plural
        e.comments = [c for c in e.comments if not c.startswith("#:")]
        e.comments += [f"#: {w}" for w in sorted(set(f.where))[:3]]
        entries.append(e)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(po.dump(entries), encoding="utf-8")
    return added, len(old)


def compile_all() -> list[Path]:
    """Compile every catalog next to itself (atomically); returns the .mo files written."""
    out = []
    for src in catalogs():
        mo = src.with_suffix(".mo")
        tmp = mo.with_suffix(".mo.tmp")
        tmp.write_bytes(po.compile_mo(po.load(src)))
        os.replace(tmp, mo)
        out.append(mo)
    return out


def missing(path: Path, found: list[Found]) -> list[Found]:
    have = {e.key: e for e in po.load(path)}
    return [f for f in found if not (e := have.get((f.context, f.msgid))) or not e.translated]


def main(argv: list[str]) -> int:
    cmd = argv[0] if argv else ""
    if cmd == "compile":
        written = compile_all()
        print(
            f"i18n: compiled {len(written)} catalog(s): " + ", ".join(p.parent.parent.name for p in written)
        )
        return 0
    if cmd in ("update", "missing"):
        found, problems = extract()
        for p in problems:
            print(f"i18n: {p}", file=sys.stderr)
        bad = bool(problems)
        for path in catalogs():
            if cmd == "update":
                added, dropped = update(path, found)
                print(f"i18n: {path.relative_to(ROOT)}: {added} added, {dropped} dropped")
            else:
                for f in missing(path, found):
                    bad = True
                    print(
                        f"{path.parent.parent.name}: untranslated {f.context or ''} {f.msgid!r} ({f.where[0]})"
                    )
        return 1 if bad else 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
