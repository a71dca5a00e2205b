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
    problems: list[str] = []
    obj = _build(cls, data, source, prefix, problems)
    if problems:
        raise ConfigError("invalid settings:\n" + "\n".join(f"  {p}" for p in problems))
    return typing.cast(T, obj)


def _build(cls: Any, data: Mapping[str, Any], source: str, prefix: str, problems: list[str]) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in fields:
            guess = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"; did you mean {guess[0]!r}?" if guess else f"; known fields: {', '.join(fields)}"
            problems.append(f"{source}: {path}: unknown field{hint}")
            continue
        tp = hints[key]
        if dataclasses.is_dataclass(tp) and isinstance(value, dict):
            kwargs[key] = _build(tp, value, source, path + ".", problems)
            continue
        if not _type_ok(value, tp):
            problems.append(f"{source}: {path}: expected {_describe(tp)}, found {value!r}")
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
            if not any(p.startswith(f"{source}: {prefix}{name}:") for p in problems):
                problems.append(f"{source}: {prefix}{name}: required field is missing")
    if any(p.startswith(f"{source}: {prefix}") for p in problems):
        return None
    try:
        return cls(**kwargs)
    except (ValueError, ConfigError) as e:
        problems.append(f"{source}: {prefix.rstrip('.') or cls.__name__}: {e}")
        return None


def load_yaml_mapping(path: str | Path) -> dict[str, Any]:
    """Read a YAML file that must hold a mapping; ConfigError naming the file otherwise."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"{p}: cannot be read ({e.strerror}); check the path") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        raise ConfigError(
            f"{p}{where}: not valid YAML ({getattr(e, 'problem', e)}); fix the syntax"
        ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: expected a YAML mapping at the top level, found {type(data).__name__}")
    return data
