"""Strict loading of settings dataclasses from YAML mappings.

Every problem is reported at once, each naming the file, the field, what was expected and what was
found; unknown fields get a "did you mean" suggestion.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml

from kunlun_common.errors import ConfigError
from kunlun_common.messages import Message, msg, msg_list, of_error, plain

T = TypeVar("T")


def _type_ok(value: Any, tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is bool:
        return isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if origin is tuple:
        args = typing.get_args(tp)
        return isinstance(value, list | tuple) and all(_type_ok(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    if dataclasses.is_dataclass(tp):
        return isinstance(value, dict)
    return True


def _describe_msg(tp: Any) -> Message:
    """The type's description as a message, its English text `_describe`'s (the simple types, lists
    and alternatives translated; `null` and class names as they are)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        first, *rest = typing.get_args(tp)
        out = _describe_msg(first)
        for other in rest:
            out = msg("settings.type.either", "{first} or {second}", first=out, second=_describe_msg(other))
        return out
    if origin is tuple:
        return msg("settings.type.list", "a list of {item}", item=_describe_msg(typing.get_args(tp)[0]))
    if tp is int:
        return msg("settings.type.int", "an integer")
    if tp is float:
        return msg("settings.type.float", "a number")
    if tp is bool:
        return msg("settings.type.bool", "true or false")
    if tp is str:
        return msg("settings.type.str", "a string")
    return plain(_describe(tp))


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if origin is tuple:
        return f"a list of {_describe(typing.get_args(tp)[0])}"
    if tp is type(None):
        return "null"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


def from_mapping(cls: type[T], data: Mapping[str, Any], source: str, prefix: str = "") -> T:
    """Build dataclass `cls` from `data`, refusing unknown fields and wrong types (all at once)."""
    problems: list[Message] = []
    obj = _build(cls, data, source, prefix, problems)
    if problems:
        raise ConfigError(msg_list("settings.invalid", "invalid settings:\n{parts}", problems))
    return typing.cast(T, obj)


def _field_problem(source: str, where: str, e: Exception) -> Message:
    """`source: where: e` with the error's own message (translated on its own) when it has one."""
    return msg_list(
        "settings.field_problem",
        "{source}: {where}: {parts}",
        [of_error(e)],
        bullet="",
        source=source,
        where=where,
    )


def _build(cls: Any, data: Mapping[str, Any], source: str, prefix: str, problems: list[Message]) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in fields:
            guess = difflib.get_close_matches(str(key), list(fields), n=1)
            if guess:
                problems.append(
                    msg(
                        "settings.unknown_field_guess",
                        "{source}: {path}: unknown field; did you mean {guess!r}?",
                        source=source,
                        path=path,
                        guess=guess[0],
                    )
                )
            else:
                problems.append(
                    msg(
                        "settings.unknown_field",
                        "{source}: {path}: unknown field; known fields: {known}",
                        source=source,
                        path=path,
                        known=", ".join(fields),
                    )
                )
            continue
        tp = hints[key]
        if dataclasses.is_dataclass(tp) and isinstance(value, dict):
            kwargs[key] = _build(tp, value, source, path + ".", problems)
            continue
        if not _type_ok(value, tp):
            problems.append(
                msg_list(
                    "settings.wrong_type",
                    "{source}: {path}: expected {parts}, found {found}",
                    [_describe_msg(tp)],
                    bullet="",
                    source=source,
                    path=path,
                    found=repr(value),
                )
            )
            continue
        if typing.get_origin(tp) is tuple and isinstance(value, list):
            value = tuple(value)
        if tp is float and isinstance(value, int):
            value = float(value)
        kwargs[key] = value
    for name, f in fields.items():
        if (
            name not in kwargs
            and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        ):
            if not any(str(p).startswith(f"{source}: {prefix}{name}:") for p in problems):
                problems.append(
                    msg(
                        "settings.missing_field",
                        "{source}: {path}: required field is missing",
                        source=source,
                        path=f"{prefix}{name}",
                    )
                )
    if any(str(p).startswith(f"{source}: {prefix}") for p in problems):
        return None
    try:
        return cls(**kwargs)
    except (ValueError, ConfigError) as e:
        problems.append(_field_problem(source, prefix.rstrip(".") or cls.__name__, e))
        return None


def load_yaml_mapping(path: str | Path) -> dict[str, Any]:
    """Read a YAML file that must hold a mapping; ConfigError naming the file otherwise."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(
            msg(
                "settings.unreadable",
                "{path}: cannot be read ({reason}); check the path",
                path=str(p),
                reason=e.strerror,
            )
        ) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        raise ConfigError(
            msg(
                "settings.bad_yaml",
                "{path}{where}: not valid YAML ({problem}); fix the syntax",
                path=str(p),
                where=where,
                problem=str(getattr(e, "problem", e)),
            )
        ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            msg(
                "settings.not_mapping",
                "{path}: expected a YAML mapping at the top level, found {kind}",
                path=str(p),
                kind=type(data).__name__,
            )
        )
    return data
