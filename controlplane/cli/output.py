"""Output: aligned tables for people, `-o json` for scripts.

The JSON contract, the same in every command: lists are {"items": [...]}, keys are snake_case,
numbers are JSON numbers, booleans are booleans, every process object carries `pid`.
"""

from __future__ import annotations

import json
import sys
import unicodedata
from collections.abc import Sequence
from typing import Any

from kunlun_common import i18n

TABLE_HEADER = "table header"
"""The gettext context of column titles (scripts/i18n.py extracts every print_table title list)."""


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def width(text: str) -> int:
    """Columns `text` takes in a terminal: East Asian wide and full-width characters take two."""
    return sum(2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1 for ch in text)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Aligned columns under titles in the reader's language (the values as given)."""
    cells = [[i18n.pgettext(TABLE_HEADER, str(h)) for h in headers]]
    cells += [["" if c is None else str(c) for c in r] for r in rows]
    widths = [max(width(r[i]) for r in cells) for i in range(len(headers))]
    for r in cells:
        line = "  ".join(c + " " * (w - width(c)) for c, w in zip(r, widths, strict=True))
        sys.stdout.write(line.rstrip() + "\n")
