"""The reader's language for user-facing text: GNU gettext, domain `kunlun`.

The language comes from the environment in gettext's usual order (LANGUAGE, LC_ALL, LC_MESSAGES,
LANG; e.g. `LANG=zh_CN.UTF-8`), the catalogs from `kunlun_common/locale/<lang>/LC_MESSAGES/kunlun.mo`
(compiled from the .po files in the same folders by `make install`, scripts/i18n.py, and by the
wheel build, setup.py), or from the
folder named by `$KUNLUN_LOCALEDIR` (packagers: e.g. /usr/share/locale); a package imported from a
zip (kunlun-installer runs from the bundle's wheel) reads its catalog from inside it. A missing,
unreadable or corrupt catalog means English, never a failure.

What is translated: the CLI's help, messages and errors, the errors replicas send with a
message id (kunlun_common/messages.py), and the start-up errors kunlun-platform, kunlun-agent and
kunlun-gateway print (their settings and flag validators raise them with message ids), and each
problem of a device-plugin config (node_agent/plugins/config.py), every line of kunlun-device-probe and
the reasons agents give their devices (`status_reason_message` beside `status_reason`), the config
checks of kunlun-installer's install (kunlun_installer/host.py), kunlun-cli verify's measured values,
thresholds and evidence descriptions (report.md too), the describe commands' field labels, and the
reasons replicas store on instances and rollouts with a message beside them (`reason_message`,
kunlun_common/messages.py `to_stored`), the scheduler's per-node reasons (the code stays, its
explanation is translated: controlplane/scheduler/reasons.py) and `workload describe`'s spec labels. What is not: `-o json` output, table columns and values,
and log event names (scripts and log pipelines read them).

Mark a user-facing string with `_()` (or `ngettext`, `pgettext`) at the point of use, never at
import time, and keep the literal inside the call so that the AST scan of scripts/i18n.py (and the
catalog coverage test) finds it; put values in with `.format(name=...)` after translation.
"""

from __future__ import annotations

import functools
import gettext
import importlib.resources
import os
from collections.abc import Mapping
from pathlib import Path

from kunlun_common.messages import Message, render

DOMAIN = "kunlun"
"""The gettext domain of every catalog."""
PACKAGE_LOCALEDIR = Path(__file__).resolve().parent / "locale"
"""Where the catalogs (.po, and the .mo compiled from them) live inside the package."""
LOCALEDIR_ENV = "KUNLUN_LOCALEDIR"
"""Environment variable naming another catalog folder (<dir>/<lang>/LC_MESSAGES/kunlun.mo)."""


def localedir(env: Mapping[str, str] | None = None) -> Path:
    """The catalog folder in use: $KUNLUN_LOCALEDIR, else the package's."""
    value = (os.environ if env is None else env).get(LOCALEDIR_ENV, "")
    return Path(value) if value else PACKAGE_LOCALEDIR


def translations() -> gettext.NullTranslations:
    """The catalog for the environment's language; English (no translation) when there is none.

    Looked up on every call (gettext caches the parsed file), so a change of the environment takes
    effect at once; a catalog that cannot be read or parsed counts as missing.
    """
    where = localedir()
    try:
        if where == PACKAGE_LOCALEDIR and not where.is_dir():
            return _zipped(_languages())
        return gettext.translation(DOMAIN, str(where), fallback=True)
    except Exception:  # a corrupt or unreadable .mo must not stop the CLI: English instead
        return gettext.NullTranslations()


def _languages() -> tuple[str, ...]:
    """The catalog names to try, in gettext's order (`zh_CN.UTF-8` -> zh_CN, zh; up to C)."""
    for var in ("LANGUAGE", "LC_ALL", "LC_MESSAGES", "LANG"):
        value = os.environ.get(var)
        if value:
            break
    else:
        return ()
    out: list[str] = []
    for lang in value.split(":"):
        if lang in ("C", "POSIX") or lang.startswith(("C.", "POSIX.")):
            break
        base = lang.split(".")[0].split("@")[0]
        out += [base, base.split("_")[0]]
    return tuple(dict.fromkeys(x for x in out if x))


@functools.lru_cache(maxsize=8)
def _zipped(languages: tuple[str, ...]) -> gettext.NullTranslations:
    """The catalog read from inside the package when it is not a folder: kunlun-installer runs
    straight from the bundle's wheel (a zip file on PYTHONPATH), where gettext finds no file."""
    root = importlib.resources.files(__package__ or "kunlun_common").joinpath("locale")
    for lang in languages:
        mo = root.joinpath(lang, "LC_MESSAGES", f"{DOMAIN}.mo")
        if mo.is_file():
            with mo.open("rb") as f:
                return gettext.GNUTranslations(f)
    return gettext.NullTranslations()


def _(message: str) -> str:
    """`message` in the reader's language."""
    return translations().gettext(message)


def translate(text: str) -> str:
    """A text chosen at run time (a verify checkpoint's name, a layer's title) in the reader's
    language, when the catalog has it. The texts themselves are literals where they are made, which
    scripts/i18n.py extracts by their place (see its VERIFY_TEXTS), not by a `_()` around them."""
    return translations().gettext(text) if text else text


def ngettext(singular: str, plural: str, n: int) -> str:
    """The singular or plural form for `n`, in the reader's language."""
    return translations().ngettext(singular, plural, n)


def pgettext(context: str, message: str) -> str:
    """`message` in the reader's language, looked up under gettext context `context`."""
    return translations().pgettext(context, message)


def language() -> str:
    """The language of the catalog in use ("" for English, no catalog)."""
    info = translations().info()
    return str(info.get("language", "")) if info else ""


def localize(m: Message, english: str | None = None) -> str:
    """A message with an id in the reader's language: its translation (context = id, msgid = the
    English template) formatted with its values; `english` (default: the message's English text)
    when the catalog has no translation of that exact template or the translation does not fit. A
    message that is only a list (template `{parts}`) has nothing of its own to translate: its parts
    are translated one by one."""
    fallback = str(m) if english is None else english
    translated = pgettext(m.id, m.template)
    if translated == m.template and m.template != "{parts}":  # a bare list: only its parts to translate
        return fallback
    return render(translated, m.values(localize), fallback=fallback)


def bind_global_domain() -> None:
    """Make `kunlun` the process's default gettext domain, so that the standard library's own
    strings that go through `gettext.gettext` (argparse's "usage:", "options", its errors) come
    from our catalog too. For the CLI's entry point only: it changes process-wide state."""
    where = str(localedir())
    try:
        gettext.translation(DOMAIN, where, fallback=True)
    except Exception:  # corrupt catalog: leave the standard library in English
        return
    gettext.bindtextdomain(DOMAIN, where)
    gettext.textdomain(DOMAIN)


def error_text(e: BaseException) -> str:
    """An error's text in the reader's language: its message's translation when it was raised with
    a message id (kunlun_common/errors.py), else its text as is."""
    m = getattr(e, "localizable", None)
    return localize(m) if isinstance(m, Message) else str(e)
