"""kunlun-cli in the reader's language: its argparse tree translated in one pass.

Every help text, description and group title of the parser tree goes through the catalog
(`kunlun_common.i18n`) once the tree is built, so a command module writes its help in English as
usual and a new command is translated as soon as the catalog has its strings (scripts/i18n.py
extract lists them; tests/test_i18n.py fails while one is missing). argparse's own strings ("usage:",
"options", its error messages) come from the same catalog through the process's default gettext
domain (`bind_global_domain`).

Choices, option names, metavars and `-o json` output stay as they are: scripts depend on them.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator

from kunlun_common.i18n import _, bind_global_domain

ARGPARSE_STRINGS = (
    "usage: ",
    "positional arguments",
    "options",
    "show this help message and exit",
    "%(prog)s: error: %(message)s\n",
    "argument %(argument_name)s: %(message)s",
    "the following arguments are required: %s",
    "unrecognized arguments: %s",
    "invalid choice: %(value)r (choose from %(choices)s)",
    "invalid %(type)s value: %(value)r",
    "expected one argument",
    "expected at most one argument",
    "expected at least one argument",
    "ambiguous option: %(option)s could match %(matches)s",
    "one of the arguments %s is required",
    "not allowed with argument %s",
    "can't open '%(filename)s': %(error)s",
)
"""The standard library argparse strings a user can see; the catalog translates them too."""


def _parsers(root: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """Every parser of the tree once (aliases share a parser)."""
    seen: set[int] = set()
    todo = [root]
    while todo:
        p = todo.pop()
        if id(p) in seen:
            continue
        seen.add(id(p))
        yield p
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo.extend(action.choices.values())


def _texts(root: argparse.ArgumentParser) -> Iterator[tuple[str, object, str]]:
    """(where, holder, attribute) of every translatable text of the tree."""
    seen: set[int] = set()

    def once(obj: object) -> bool:
        if id(obj) in seen:
            return False
        seen.add(id(obj))
        return True

    for p in _parsers(root):
        yield p.prog, p, "description"
        yield p.prog, p, "epilog"
        for group in p._action_groups:
            if once(group):
                yield p.prog, group, "title"
                yield p.prog, group, "description"
        for action in p._actions:
            if once(action):
                yield f"{p.prog} {'/'.join(action.option_strings) or action.dest}", action, "help"
            if isinstance(action, argparse._SubParsersAction):
                for choice in action._choices_actions:
                    if once(choice):
                        yield f"{p.prog} {choice.dest}", choice, "help"


def help_texts(root: argparse.ArgumentParser) -> list[tuple[str, str]]:
    """(where, text) of every help text, description and group title of the tree, as written."""
    out = []
    for where, holder, attr in _texts(root):
        value = getattr(holder, attr, None)
        if isinstance(value, str) and value and value != argparse.SUPPRESS:
            out.append((where, value))
    return out


def translate_tree(root: argparse.ArgumentParser, tr: Callable[[str], str] = _) -> None:
    """Replace every help text, description and group title of the tree by its translation."""
    for _where, holder, attr in _texts(root):
        value = getattr(holder, attr, None)
        if isinstance(value, str) and value and value != argparse.SUPPRESS:
            setattr(holder, attr, tr(value))


def localized(build: Callable[[], argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """The parser `build` makes, in the reader's language."""
    bind_global_domain()
    parser = build()
    translate_tree(parser)
    return parser
