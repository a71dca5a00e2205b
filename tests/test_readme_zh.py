"""README.zh-CN.md is a translation of README.md kept in step with it: the same headings (levels and
order), the same fenced code blocks in each section, the same inline code (commands, flags, paths,
fields) in each section, and Chinese prose. A change to one README without the other fails here."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EN = ROOT / "README.md"
ZH = ROOT / "README.zh-CN.md"
_FENCE = re.compile(r"^(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*)$")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.DOTALL)  # inline code may wrap onto the next line
_CJK = re.compile(r"[\u4e00-\u9fff]")
_LATIN_WORD = re.compile(r"[A-Za-z]{3,}")


@dataclass
class Section:
    level: int
    title: str
    line: int
    blocks: list[str] = field(default_factory=list)
    text: list[str] = field(default_factory=list)

    @property
    def spans(self) -> set[str]:
        """The inline code of the section (commands, flags, paths, fields), whitespace normalised."""
        return {" ".join(m.group(2).split()) for m in _CODE_SPAN.finditer("\n".join(self.text))}

    @property
    def prose(self) -> str:
        """The text without inline code and link targets."""
        text = _CODE_SPAN.sub(" ", "\n".join(self.text))
        return re.sub(r"\]\([^)]*\)", "]", text)


def sections(path: Path) -> list[Section]:
    """The document split at its headings (headings inside fenced code are code, not headings)."""
    out = [Section(0, "(top)", 0)]
    block: list[str] | None = None
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if _FENCE.match(line.strip()):
            if block is None:
                block = [line]
            else:
                block.append(line)
                out[-1].blocks.append("\n".join(block))
                block = None
            continue
        if block is not None:
            block.append(line)
            continue
        m = _HEADING.match(line)
        if m:
            out.append(Section(len(m.group(1)), m.group(2).strip(), n))
        else:
            out[-1].text.append(line)
    assert block is None, f"{path.name}: a fenced code block is not closed"
    return out


@pytest.fixture(scope="module")
def pair() -> list[tuple[Section, Section]]:
    en, zh = sections(EN), sections(ZH)
    shape_en = [(s.level, s.line) for s in en]
    assert [s.level for s in en] == [s.level for s in zh], (
        "README.zh-CN.md must have the same headings, at the same levels and in the same order, as "
        f"README.md; README.md has {[(s.level, s.title) for s in en]}, README.zh-CN.md has "
        f"{[(s.level, s.title) for s in zh]} (translate the new or changed sections)"
    )
    assert shape_en
    return list(zip(en, zh, strict=True))


def test_same_headings_with_the_same_code(pair: list[tuple[Section, Section]]) -> None:
    for en, zh in pair:
        en_code = set(_CODE_SPAN.findall(en.title))
        zh_code = set(_CODE_SPAN.findall(zh.title))
        assert en_code == zh_code, f"heading {en.title!r} (README.md:{en.line}) vs {zh.title!r}"


def test_same_code_blocks_in_every_section(pair: list[tuple[Section, Section]]) -> None:
    for en, zh in pair:
        assert en.blocks == zh.blocks, (
            f"section {en.title!r} (README.md:{en.line}, README.zh-CN.md:{zh.line}): the fenced code "
            "blocks must be identical in both READMEs (commands and flags are not translated)"
        )


def test_same_commands_and_flags_in_every_section(pair: list[tuple[Section, Section]]) -> None:
    for en, zh in pair:
        assert en.spans == zh.spans, (
            f"section {en.title!r} (README.md:{en.line}, README.zh-CN.md:{zh.line}): inline code differs; "
            f"only in README.md: {sorted(en.spans - zh.spans)}; only in README.zh-CN.md: "
            f"{sorted(zh.spans - en.spans)}"
        )


def test_the_translation_is_chinese(pair: list[tuple[Section, Section]]) -> None:
    for en, zh in pair:
        en_words = len(_LATIN_WORD.findall(en.prose))
        if en_words < 8:
            continue  # a heading with a code block and little prose
        cjk = len(_CJK.findall(zh.prose))
        assert cjk >= en_words, (
            f"section {zh.title!r} (README.zh-CN.md:{zh.line}) reads as untranslated: {cjk} Chinese "
            f"characters for {en_words} English words in README.md"
        )


def test_each_readme_points_to_the_other() -> None:
    assert "README.zh-CN.md" in EN.read_text(encoding="utf-8")
    assert "README.md" in ZH.read_text(encoding="utf-8")
