"""YAML reading for the device-plugin config: node trees with line numbers, YAML 1.2 core typing.

PyYAML's own loaders build plain Python objects and lose where each value came from; they also follow
YAML 1.1, where `yes`, `on`, `0755` or `1:30` silently become booleans and numbers. This module composes
the document into PyYAML nodes (which keep `start_mark`) with a resolver for the YAML 1.2 core schema,
the one editors (yaml-language-server) use, so that what the loader accepts is what the JSON Schema
accepts. Values are typed here, on demand, by `scalar_value`.

The node graph can be shared (anchors and aliases) or even cyclic; nothing here walks it without a bound.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TypeAlias

from yaml.composer import Composer
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode
from yaml.parser import Parser
from yaml.reader import Reader
from yaml.resolver import BaseResolver
from yaml.scanner import Scanner, ScannerError
from yaml.tokens import Token

from kunlun_common.messages import Message, msg

__all__ = [
    "MappingNode",
    "Node",
    "ScalarNode",
    "SequenceNode",
    "Unsupported",
    "compose",
    "describe",
    "is_mapping",
    "is_sequence",
    "line_of",
    "render",
    "scalar_value",
]

_T = "tag:yaml.org,2002:"
NULL_TAG, BOOL_TAG, INT_TAG, FLOAT_TAG, STR_TAG = (_T + t for t in ("null", "bool", "int", "float", "str"))
MAP_TAG, SEQ_TAG = _T + "map", _T + "seq"


MAX_DEPTH = 64  # a config needs 5 levels; PyYAML's scanner is quadratic in flow depth


class _Loader(Reader, Scanner, Parser, Composer, BaseResolver):
    """Reader, scanner, parser and composer only: no constructor, so nothing is built but nodes."""

    def __init__(self, stream: str) -> None:
        Reader.__init__(self, stream)
        Scanner.__init__(self)
        Parser.__init__(self)
        Composer.__init__(self)
        BaseResolver.__init__(self)

    def _too_deep(self) -> None:
        if self.flow_level + len(self.indents) >= MAX_DEPTH:
            raise ScannerError(
                None, None, f"found collections nested over {MAX_DEPTH} levels", self.get_mark()
            )

    def fetch_flow_collection_start(self, TokenClass: type[Token]) -> None:
        self._too_deep()
        super().fetch_flow_collection_start(TokenClass)

    def add_indent(self, column: int) -> bool:
        self._too_deep()
        return bool(super().add_indent(column))


# YAML 1.2 core schema (https://yaml.org/spec/1.2.2/#1032-tag-resolution); ints before floats.
_NULL_RE = re.compile(r"^(?:~|null|Null|NULL|)$")
_BOOL_RE = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
_INT_RE = re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$")
_FLOAT_RE = re.compile(
    r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
)
_Loader.add_implicit_resolver(NULL_TAG, _NULL_RE, ["~", "n", "N", ""])
_Loader.add_implicit_resolver(BOOL_TAG, _BOOL_RE, list("tTfF"))
_Loader.add_implicit_resolver(INT_TAG, _INT_RE, list("-+0123456789"))
_Loader.add_implicit_resolver(FLOAT_TAG, _FLOAT_RE, list("-+.0123456789"))


def compose(text: str) -> Node | None:
    """The single document of `text` as a node tree (None if empty).

    Raises yaml.YAMLError for text that is not YAML (or holds several documents) and RecursionError
    for absurdly deep nesting; the caller turns both into problems.
    """
    loader = _Loader(text)
    try:
        node: Node | None = loader.get_single_node()
        return node
    finally:
        loader.dispose()


_SURROGATE_RE = re.compile("[\ud800-\udfff]")
INVALID_UNICODE = "!invalid-unicode"


@dataclass(frozen=True)
class Unsupported:
    """A scalar whose explicit tag (`!!binary`, `!custom`, `!!int abc`...) this loader does not read."""

    tag: str
    text: str


Scalar: TypeAlias = bool | int | float | str | Unsupported | None


def scalar_value(node: ScalarNode) -> Scalar:
    """The typed value of a scalar node under the YAML 1.2 core schema."""
    tag, text = node.tag, str(node.value)
    if _SURROGATE_RE.search(text):  # "\ud800" escapes: not Unicode, cannot be sent anywhere
        return Unsupported(INVALID_UNICODE, text.encode("utf-8", "backslashreplace").decode())
    try:
        if tag == STR_TAG:
            return text
        if tag == NULL_TAG and _NULL_RE.match(text):
            return None
        if tag == BOOL_TAG and _BOOL_RE.match(text):
            return text.lower() == "true"
        if tag == INT_TAG and _INT_RE.match(text):
            if text.startswith(("0o", "0x")):
                return int(text[2:], 8 if text[1] == "o" else 16)
            return int(text)
        if tag == FLOAT_TAG and _FLOAT_RE.match(text):
            low = text.lower()
            if low.endswith(".inf"):
                return -math.inf if low.startswith("-") else math.inf
            if low == ".nan":
                return math.nan
            return float(text)
    except ValueError:  # e.g. an integer longer than Python's int/str conversion limit
        pass
    return Unsupported(tag, text)


def line_of(node: Node) -> int:
    """1-based line where the node starts."""
    return int(node.start_mark.line) + 1


def is_mapping(node: Node | None) -> bool:
    return isinstance(node, MappingNode) and node.tag == MAP_TAG


def is_sequence(node: Node | None) -> bool:
    return isinstance(node, SequenceNode) and node.tag == SEQ_TAG


def _render_scalar(value: Scalar) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Unsupported):
        return f"{value.tag} {value.text!r}"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


def render(node: Node, limit: int = 80) -> str:
    """Compact flow-style text of a node, cut at about `limit` characters (safe on cyclic graphs)."""
    out: list[str] = []
    size = 0

    def emit(text: str) -> bool:
        nonlocal size
        out.append(text)
        size += len(text)
        return size < limit

    def walk(n: Node, depth: int) -> bool:
        if isinstance(n, ScalarNode):
            return emit(_render_scalar(scalar_value(n)))
        if depth > 4:
            return emit("...")
        is_map = isinstance(n, MappingNode)
        if not emit("{" if is_map else "["):
            return False
        for i, item in enumerate(n.value):
            if i and not emit(", "):
                return False
            if is_map:
                if not (walk(item[0], depth + 1) and emit(": ") and walk(item[1], depth + 1)):
                    return False
            elif not walk(item, depth + 1):
                return False
        return emit("}" if is_map else "]")

    if not walk(node, 0):
        text = "".join(out)
        return text[:limit] + "..."
    return "".join(out)


def describe(node: Node | None) -> Message:
    """What a value is, for the `found` part of a problem: 'integer -1', 'string "32GB"', 'a list [...]'."""
    if node is None:
        return msg("config.found.missing", "nothing (the key is missing)")
    if isinstance(node, ScalarNode):
        value = scalar_value(node)
        if value is None:
            return msg("config.found.null", "null")
        if isinstance(value, Unsupported) and value.tag == INVALID_UNICODE:
            return msg(
                "config.found.surrogate",
                "text with a lone UTF-16 surrogate (not Unicode): {text}",
                text=repr(value.text[:60]),
            )
        if isinstance(value, Unsupported):
            return msg(
                "config.found.tagged",
                "a value tagged {tag}: {text}",
                tag=value.tag,
                text=repr(value.text[:60]),
            )
        shown = _render_scalar(value)[:80]
        if isinstance(value, bool):
            return msg("config.found.boolean", "boolean {value}", value=shown)
        if isinstance(value, int):
            return msg("config.found.integer", "integer {value}", value=shown)
        if isinstance(value, float):
            return msg("config.found.number", "number {value}", value=shown)
        return msg("config.found.string", "string {value}", value=shown)
    if node.tag not in (MAP_TAG, SEQ_TAG):
        return msg("config.found.tagged_collection", "a collection tagged {tag}", tag=node.tag)
    if isinstance(node, SequenceNode):
        return msg("config.found.list", "a list {value}", value=render(node))
    return msg("config.found.mapping", "a mapping {value}", value=render(node))
