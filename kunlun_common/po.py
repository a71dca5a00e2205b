"""Reading gettext .po catalogs and compiling them to .mo, with nothing but the standard library.

`make install` compiles every kunlun_common/locale/*/LC_MESSAGES/kunlun.po (scripts/i18n.py
compile); the .mo files are build output, never committed. The subset of the .po format read here
is what scripts/i18n.py writes and what translators' tools keep: comments (`#`, `#.`, `#:`, `#,`),
`msgctxt`, `msgid`, `msgid_plural`, `msgstr`, `msgstr[N]`, strings continued over several lines, and
C escapes. Entries flagged `fuzzy` and entries with an empty translation are left out of the .mo
(gettext then shows the English text).
"""

from __future__ import annotations

import ast
import struct
from dataclasses import dataclass, field
from pathlib import Path


class PoError(ValueError):
    """The .po text cannot be read; the message names the file and line."""


@dataclass
class Entry:
    """One catalog entry."""

    msgid: str
    """The English text (for `msg()` messages: the template)."""
    msgstr: list[str] = field(default_factory=lambda: [""])
    """The translation; one string per plural form when `plural` is set."""
    context: str | None = None
    """gettext context (`msgctxt`): the stable message id of replica messages."""
    plural: str | None = None
    """The English plural (`msgid_plural`), for ngettext entries."""
    flags: set[str] = field(default_factory=set)
    """`#,` flags, e.g. fuzzy, python-brace-format."""
    comments: list[str] = field(default_factory=list)
    """Every other comment line, kept as written (`#.`, `#:`, `# ...`)."""

    @property
    def key(self) -> tuple[str | None, str]:
        return (self.context, self.msgid)

    @property
    def translated(self) -> bool:
        return "fuzzy" not in self.flags and all(self.msgstr) and bool(self.msgstr)


def _unquote(token: str, where: str) -> str:
    token = token.strip()
    if len(token) < 2 or token[0] != '"' or token[-1] != '"':
        raise PoError(f"{where}: expected a double-quoted string, found {token[:40]!r}")
    try:
        value = ast.literal_eval(token)
    except (ValueError, SyntaxError) as e:
        raise PoError(f"{where}: bad string {token[:40]!r} ({e})") from None
    if not isinstance(value, str):  # pragma: no cover - a quoted literal is a str
        raise PoError(f"{where}: bad string {token[:40]!r}")
    return value


def parse(text: str, source: str = "<po>") -> list[Entry]:
    """The entries of a .po text (the header entry, msgid "", included), in file order."""
    entries: list[Entry] = []
    fields: dict[str, str] = {}
    comments: list[str] = []
    flags: set[str] = set()
    current: str | None = None

    def finish(line_no: int) -> None:
        nonlocal fields, comments, flags, current
        if fields:
            if "msgid" not in fields:
                raise PoError(f"{source}:{line_no}: entry without msgid")
            plural = fields.get("msgid_plural")
            if plural is not None:
                n = len([k for k in fields if k.startswith("msgstr[")])
                msgstr = [fields.get(f"msgstr[{i}]", "") for i in range(max(n, 1))]
            else:
                msgstr = [fields.get("msgstr", "")]
            entries.append(Entry(fields["msgid"], msgstr, fields.get("msgctxt"), plural, flags, comments))
        fields, comments, flags, current = {}, [], set(), None

    lines = text.splitlines()
    for n, raw in enumerate(lines, start=1):
        line = raw.strip()
        where = f"{source}:{n}"
        if not line:
            finish(n)
            continue
        if line.startswith("#~"):
            continue  # obsolete entry
        if line.startswith("#"):
            if any(k.startswith("msgstr") for k in fields):
                finish(n)
            if line.startswith("#,"):
                flags |= {f.strip() for f in line[2:].split(",") if f.strip()}
            else:
                comments.append(raw)
            continue
        if line.startswith('"'):
            if current is None:
                raise PoError(f"{where}: a continued string outside an entry")
            fields[current] += _unquote(line, where)
            continue
        keyword, _, rest = line.partition(" ")
        if keyword not in ("msgctxt", "msgid", "msgid_plural", "msgstr") and not (
            keyword.startswith("msgstr[") and keyword.endswith("]")
        ):
            raise PoError(f"{where}: unknown keyword {keyword!r}")
        if keyword in ("msgctxt", "msgid") and any(k.startswith("msgstr") for k in fields):
            finish(n)  # a new entry without a blank line before it
        if keyword in fields:
            raise PoError(f"{where}: {keyword} twice in one entry")
        fields[keyword] = _unquote(rest, where)
        current = keyword
    finish(len(lines) + 1)
    seen: set[tuple[str | None, str]] = set()
    for e in entries:
        if e.key in seen:
            raise PoError(f"{source}: duplicate entry msgctxt={e.context!r} msgid={e.msgid[:60]!r}")
        seen.add(e.key)
    return entries


def load(path: Path) -> list[Entry]:
    return parse(path.read_text(encoding="utf-8"), str(path))


def _quote(s: str) -> str:
    out = s.replace("\\", "\\\\").replace('"', '\\"').replace("\t", "\\t").replace("\r", "\\r")
    return '"' + out.replace("\n", "\\n") + '"'


def _field(keyword: str, value: str) -> list[str]:
    if "\n" in value.rstrip("\n"):
        parts = value.splitlines(keepends=True)
        return [f'{keyword} ""', *(_quote(p) for p in parts)]
    return [f"{keyword} {_quote(value)}"]


def dump(entries: list[Entry]) -> str:
    """The .po text of `entries` (what `parse` reads back identically)."""
    blocks: list[str] = []
    for e in entries:
        lines = list(e.comments)
        if e.flags:
            lines.append("#, " + ", ".join(sorted(e.flags)))
        if e.context is not None:
            lines += _field("msgctxt", e.context)
        lines += _field("msgid", e.msgid)
        if e.plural is not None:
            lines += _field("msgid_plural", e.plural)
            for i, s in enumerate(e.msgstr):
                lines += _field(f"msgstr[{i}]", s)
        else:
            lines += _field("msgstr", e.msgstr[0] if e.msgstr else "")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n"


def compile_mo(entries: list[Entry]) -> bytes:
    """The GNU .mo bytes of the translated entries (and the header), keys sorted, no hash table."""
    pairs: dict[bytes, bytes] = {}
    for e in entries:
        if e.msgid == "" and e.context is None:
            pairs[b""] = e.msgstr[0].encode()
            continue
        if not e.translated:
            continue
        key = e.msgid if e.plural is None else e.msgid + "\0" + e.plural
        if e.context is not None:
            key = e.context + "\x04" + key
        pairs[key.encode()] = "\0".join(e.msgstr).encode()
    keys = sorted(pairs)
    ids = b""
    strs = b""
    offsets: list[tuple[int, int, int, int]] = []
    for k in keys:
        v = pairs[k]
        offsets.append((len(ids), len(k), len(strs), len(v)))
        ids += k + b"\0"
        strs += v + b"\0"
    n = len(keys)
    key_table = 7 * 4
    value_table = key_table + n * 8
    ids_start = value_table + n * 8
    strs_start = ids_start + len(ids)
    out = struct.pack("<7I", 0x950412DE, 0, n, key_table, value_table, 0, ids_start)
    for o_id, l_id, _, _ in offsets:
        out += struct.pack("<2I", l_id, ids_start + o_id)
    for _, _, o_s, l_s in offsets:
        out += struct.pack("<2I", l_s, strs_start + o_s)
    return out + ids + strs
