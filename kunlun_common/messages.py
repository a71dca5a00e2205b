"""Messages with a stable id, so that a client can show them in its reader's language.

A replica forms a user-facing error as `msg(ID, TEMPLATE, **params)`: ID is stable across versions
(`"workload.not_found"`), TEMPLATE is the English text with `{name}` placeholders, params are the
values. `str()` of the message is the English text, which stays the gRPC status details (what older
clients and logs show). Next to it, `to_metadata` gives one trailing-metadata entry,
`kunlun-msg: {"id": ..., "template": ..., "args": {...}}` (JSON, ASCII only, as gRPC wants for text
metadata), which `from_metadata` reads back on the client. The client translates with the gettext
context ID and the template as msgid (`pgettext(ID, TEMPLATE)`), then formats with the args; with no
translation, or a template its catalog does not know (another version), it shows the English details.

A reason the replica stores on a record (an instance's, a rollout's) travels the same way at rest:
`reason` is the English text, `reason_message` the message as JSON (`to_stored`), which a client reads
back with `from_stored` only while its English text still equals `reason`.

The catalogs (kunlun_common/locale) hold these as entries with `msgctxt ID`; scripts/i18n.py finds
every `msg(...)` call by an AST scan, and a test checks that each has a translation.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

METADATA_KEY = "kunlun-msg"
"""Trailing-metadata key carrying a message's id, template and args."""
MAX_METADATA_BYTES = 4096
"""Larger messages travel without their id (gRPC's default header list limit is 8 KiB)."""

Param = str | int | float | bool | None


@dataclass(frozen=True)
class Message:
    """One user-facing message: a stable id, the English template and its named values."""

    id: str
    """Stable dotted id, e.g. "workload.not_found"; the gettext context of the translation."""
    template: str
    """English text with `{name}` placeholders (str.format syntax); the gettext msgid."""
    params: Mapping[str, Param] = field(default_factory=dict)
    """The placeholders' values: plain JSON values, so that the client formats exactly the same."""
    parts: tuple[Message, ...] = ()
    """Messages listed inside this one (one problem each, e.g. every problem of a spec): they fill
    the template's `{parts}` placeholder, one per line, each after `bullet`; each is translated on
    its own."""
    bullet: str = "  "
    """What each part starts with."""
    sep: str = "\n"
    """What comes between two parts."""
    english: str | None = field(default=None, compare=False)
    """The English text as formatted with the values as given (before they were made plain JSON
    values), so that the text is exactly what an f-string would have made; None: format the template."""
    named: Mapping[str, Message] = field(default_factory=dict)
    """Placeholders whose values are messages themselves (a config problem's `expected`, `found` and
    `hint`): each is shown by `each`, i.e. translated on its own."""

    def __hash__(self) -> int:
        return hash((self.id, self.template, str(self)))

    def __str__(self) -> str:
        return self.english if self.english is not None else self.text(str)

    def text(self, each: Callable[[Message], str]) -> str:
        """The English text, with every part shown by `each` (the client passes its translator)."""
        return render(self.template, self.values(each), fallback=self.template)

    def values(self, each: Callable[[Message], str]) -> dict[str, Param]:
        """The params, plus `parts` (each part shown by `each`; empty when the list is)."""
        out: dict[str, Param] = {**self.params, **{k: each(m) for k, m in self.named.items()}}
        if self.parts or "parts" not in out:
            out["parts"] = self.sep.join(self.bullet + each(p) for p in self.parts)
        return out

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "template": self.template, "args": dict(self.params)}
        if self.parts:
            out["parts"] = [p.to_json() for p in self.parts]
            out["bullet"] = self.bullet
            out["sep"] = self.sep
        if self.named:
            out["named"] = {k: m.to_json() for k, m in self.named.items()}
        return out

    def to_metadata(self) -> tuple[tuple[str, str], ...]:
        """The trailing metadata that carries this message (empty when too large to carry)."""
        text = json.dumps(self.to_json(), ensure_ascii=True, separators=(",", ":"))
        if len(text) > MAX_METADATA_BYTES:
            return ()
        return ((METADATA_KEY, text),)


def _plain(v: object) -> Param:
    if v is None or isinstance(v, str | int | float | bool):
        return v
    return str(v)


def msg(msg_id: str, template: str, /, **params: object) -> Message:
    """A message with stable id `msg_id`; non-JSON values are carried as their str() (its English
    text is formatted with the values as given, so `{when:%Y-%m-%d}` or `{path!r}` read as usual); a
    value that is a Message is translated on its own (`Message.named`)."""
    named = {k: v for k, v in params.items() if isinstance(v, Message)}
    plain = {k: _plain(v) for k, v in params.items() if k not in named}
    english = render(template, params, fallback=template)
    formatted = render(template, {**plain, **{k: str(m) for k, m in named.items()}}, template)
    return Message(msg_id, template, plain, english=None if english == formatted else english, named=named)


def msg_list(
    msg_id: str,
    template: str,
    parts: Iterable[Message],
    /,
    bullet: str = "  ",
    sep: str = "\n",
    **params: object,
) -> Message:
    """A message that lists others (`parts`, each after `bullet`, `sep` between them) in its
    `{parts}` placeholder."""
    return Message(msg_id, template, {k: _plain(v) for k, v in params.items()}, tuple(parts), bullet, sep)


def plain(text: str) -> Message:
    """A text without an id (a library's error, a value): shown as is in every language."""
    return Message("text", "{text}", {"text": text})


def of_error(e: BaseException) -> Message:
    """An error's message: the one it was raised with (kunlun_common/errors.py), else its text as is."""
    m = getattr(e, "localizable", None)
    return m if isinstance(m, Message) else plain(str(e))


def render(template: str, params: Mapping[str, Any], fallback: str) -> str:
    """`template.format(**params)`, or `fallback` when the template does not fit the values."""
    try:
        return template.format(**params)
    except (KeyError, IndexError, ValueError, TypeError, AttributeError):
        return fallback


def to_stored(m: Message) -> str:
    """The message as a record field (`reason_message` beside a stored `reason`): JSON of its id,
    template and args (ASCII, compact)."""
    return json.dumps(m.to_json(), ensure_ascii=True, separators=(",", ":"))


def stored_reason(m: Message) -> dict[str, str]:
    """`reason` and `reason_message` of a record (a PhaseEvent's keyword arguments)."""
    return {"reason": str(m), "reason_message": to_stored(m)}


def from_stored(text: str, english: str) -> Message | None:
    """The message of a stored `reason_message`, when it is one and its English text is `english`
    (the stored `reason`): a reason another writer replaced without its message stays English."""
    if not text:
        return None
    try:
        m = _from_json(json.loads(text))
    except (ValueError, TypeError):
        return None
    return m if m is not None and str(m) == english else None


def from_metadata(metadata: Iterable[Any] | None) -> Message | None:
    """The message carried in trailing metadata, or None (an older server, or bad metadata)."""
    for item in metadata or ():
        key, value = item  # (key, value) pairs, or grpc's _Metadatum namedtuples
        if key != METADATA_KEY:
            continue
        try:
            data = json.loads(value)
        except (ValueError, TypeError):
            return None
        return _from_json(data)
    return None


def _from_json(data: object, depth: int = 0) -> Message | None:
    if not isinstance(data, dict) or depth > 4:
        return None
    mid, template, args = data.get("id"), data.get("template"), data.get("args", {})
    parts, bullet, sep = data.get("parts", []), data.get("bullet", "  "), data.get("sep", "\n")
    named_json = data.get("named", {})
    if not isinstance(named_json, dict):
        return None
    named = {str(k): _from_json(v, depth + 1) for k, v in named_json.items()}
    if not isinstance(mid, str) or not isinstance(template, str) or not isinstance(args, dict):
        return None
    if not isinstance(parts, list) or not isinstance(bullet, str) or not isinstance(sep, str):
        return None
    inner = [_from_json(p, depth + 1) for p in parts]
    if any(p is None for p in inner) or any(m is None for m in named.values()):
        return None
    return Message(
        mid,
        template,
        {str(k): _plain(v) for k, v in args.items()},
        tuple(p for p in inner if p is not None),
        bullet,
        sep,
        named={k: m for k, m in named.items() if m is not None},
    )
