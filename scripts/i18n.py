"""The message catalogs: extract the user-facing strings, update the .po files, compile the .mo files.

    python scripts/i18n.py compile    # every kunlun_common/locale/*/LC_MESSAGES/kunlun.po -> .mo (make install;
                                      # a wheel build compiles them itself, setup.py)
    python scripts/i18n.py update     # add the strings the code has and the catalogs lack (empty msgstr),
                                      # drop the ones the code no longer has, refresh the #: locations
    python scripts/i18n.py missing    # list the strings a catalog does not translate; exit 1 if any
    python scripts/i18n.py unmarked   # list user-facing text not marked for translation; exit 1 if any

What counts as user-facing (`extract`): every `_()`, `ngettext()`, `pgettext()` and `msg()` call in the
packages, found by an AST scan (their text must be a literal); every help text, description and group
title of kunlun-cli's argparse tree; and the argparse strings a user can see (controlplane/cli/localize.py).
tests/test_i18n.py fails while a catalog misses one or a translation's placeholders differ.

kunlun-cli verify's checkpoint names, notes, layer titles and skip reasons are extracted by their
place (VERIFY_PACKAGE), without a mark.

What must be marked (`unmarked`, also an AST scan): in kunlun-cli (controlplane/cli), every text (a
literal or f-string with a word in it) given to print(), a stream's write(), parser.error(), an
error's constructor or a helper that shows it (SHOWN_ARGS), and every text passed as a value into a
marked string's .format() (verify's texts must be literals where they are made); in the
modules whose errors replicas send to clients (REPLICA_MODULES) and in the settings validators
whose errors the servers print when they cannot start (STARTUP_MODULES), every error raised with a
text instead of a `msg(...)`/`msg_list(...)` message, and every problem text appended to a problem
list; in the servers' entry points (STARTUP_MAINS: kunlun-platform, kunlun-agent, kunlun-gateway),
every text printed or given to an error, as in kunlun-cli; in the device-plugin config loader
(CONFIG_MODULES), every part of a problem: the texts given to Fault(...) and Problem(...), assigned to
`expected`, `found`, `hint` or `fix`, or returned; in the modules that say why a device cannot be used
(DEVICE_MODULES: vendor tool errors, cross-checks, health notes, a plugin gone; the agent sends these
reasons to the replicas with their message), every text given to a tool error, a reason or a verdict
(DEVICE_ARGS), appended to `reasons` or `notes`, or put into a message (msg's values); in
kunlun-device-probe (PROBE_MODULES), every text it says (`say`), prints or puts into a message; in the
config checks kunlun-installer's `install` runs (INSTALLER_CHECKS), every text given to InstallError or
to a step line (`say`), or put into a message.
UNMARKED_OK lists the few deliberate exceptions.
"""

from __future__ import annotations

import ast
import os
import re
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
CLI_PACKAGE = "controlplane/cli"
"""kunlun-cli: every text it shows must be marked."""
REPLICA_MODULES = (
    "controlplane/api",  # agent_service.py too: its refusals carry ids like every other error
    "controlplane/nodes.py",  # the registration checks behind those refusals
    "controlplane/gateways",
    "controlplane/workloads",
    "controlplane/store",
    "controlplane/scheduler/config.py",
    "controlplane/telemetry.py",
    "controlplane/fencing.py",
    "controlplane/paging.py",
    "controlplane/certs_state.py",
    "controlplane/package_pull.py",
    "controlplane/package_store.py",
    "controlplane/package_policy.py",
    "kunlun_common/modelpkg",
)
"""Modules whose errors reach clients through the replicas' @rpc wrapper (or kunlun-cli's own package
checks): each must carry a message id. Process start-up is in STARTUP_MAINS and STARTUP_MODULES."""
STARTUP_MAINS = ("controlplane/main.py", "node_agent/main.py", "gateway/main.py")
"""The servers' entry points: what they print to stderr (start-up errors, warnings) is marked with
`_()` and errors they raise carry a message id, checked as kunlun-cli's texts are."""
STARTUP_MODULES = (
    "kunlun_common/settings.py",
    "controlplane/settings.py",
    "gateway/settings.py",
    "node_agent/declaration_trust.py",
    "kunlun_common/metrics_http.py",
    "kunlun_common/tls.py",
    "controlplane/replica.py",
    "controlplane/election.py",
    "node_agent/agent.py",
    "gateway/https.py",
)
"""The settings and flag validators whose ConfigErrors the entry points print when a server cannot
start (in the reader's language, `error_text`): each must carry a message id, as replica errors do."""
CONFIG_MODULES = (
    "node_agent/plugins/config.py",
    "node_agent/plugins/config_schema.py",
    "node_agent/plugins/config_devices.py",
    "node_agent/plugins/config_yaml.py",
)
"""The device-plugin config loader: every part of a problem (`Fault(...)`, `Problem(...)`, a name
`expected`, `found`, `hint` or `fix` given a text, a text a function returns) carries a message id, so
that kunlun-agent prints its ConfigFileError in the reader's language."""
CONFIG_PARTS = ("expected", "found", "hint", "fix")
DEVICE_MODULES = (
    "node_agent/vendors",
    "node_agent/plugins/vendor_plugin.py",
    "node_agent/plugins/remote.py",
    "node_agent/devices.py",
)
"""Where the agent says why a device cannot be used (the reasons it sends the replicas, which
kunlun-cli and kunlun-device-probe show in the reader's language): each reason is a message."""
DEVICE_ARGS = {
    "ToolError": 0,
    "ToolFailed": 0,
    "ToolTimeout": 0,
    "CnmonFormatError": 0,
    "SmiFormatError": 0,
    "PluginGone": 0,
    "_unparsable": 1,
    "Verdict": 1,
    "set_reason": 1,
}
"""Device modules: the calls whose argument (by index) is a text shown as a device's reason."""
DEVICE_LISTS = ("reasons", "notes")
PROBE_MODULES = ("node_agent/probe.py",)
"""kunlun-device-probe: every line it says is a message, printed in the reader's language (`-o json`
keeps the English text); its help is marked with `_()`."""
VERIFY_PACKAGE = "controlplane/cli/verify"
"""kunlun-cli verify: its checkpoint names, notes, layer titles and skip reasons are plain literals
where the layers make them (report.json keeps them in English) and are translated where they are
shown (`kunlun_common.i18n.translate`); `verify_texts` extracts them by their place: the name and
note of `result.add(NAME, ..., note=NOTE)`, the title and `skipped=` of `LayerResult(N, TITLE)`, and
the values of the TITLES table, and the label of `sampler.mark(LABEL)` (a moment on a picture)."""
VERIFY_SHOWN = {"add": (1, 2), "evidence": (0, 1), "poll": (0,)}
"""kunlun-cli verify: what is shown of a checkpoint (`result.add(NAME, MEASURED, THRESHOLD, ...)`), of
its evidence (`evidence(COMMAND, OUTPUT)`) and of a wait (`poll(WHAT, ...)`), by argument index: a
text with words there must be a message (`msg(...)`, translated where it is shown; report.json keeps
its English text), as must every text appended to a list of problems (`bad`, `problems`, `lines`,
`log`). An evidence command that is only a command (`kunlun-cli ...`, `POST ...`, an RPC's name,
without a description in parentheses or a `, N concurrent`) is shown as it is."""
VERIFY_LISTS = ("bad", "problems", "lines", "log", "cleanup")
_COMMAND = re.compile(r"^(kunlun-cli |POST |kunlun\.v1\.)[^(,]*$")
REASON_MODULES = (
    "controlplane/scheduler/actions.py",
    "controlplane/scheduler/reconcile.py",
    "controlplane/scheduler/rolling.py",
    "controlplane/rollout.py",
    "controlplane/workloads/rollouts.py",
    "controlplane/feeds.py",
    "node_agent/executor/instance.py",  # the reasons a node reports for its instances (reason_message)
    "node_agent/executor/manager.py",
    "node_agent/executor/prepare.py",
    "node_agent/executor/packages.py",
    "node_agent/executor/package_cache.py",
    "node_agent/executor/package_pull.py",
)
"""Where the replica writes the reasons it stores on instances and rollouts (and their history
events): each is a message (`reason_message` beside the English `reason`), which kunlun-cli shows
in its reader's language. A text given as a reason (the `reason` argument of `event`,
`release_instance`, `retire_instance`, `_event`, a `reason=` keyword, an assignment to `reason` or
`.reason`, a check appended to `failed`) must be a `msg(...)`."""
REASON_ARGS = {
    "event": 3,
    "release_instance": 4,
    "retire_instance": 3,
    "_event": 3,
    "request_stop": 0,
    "Ended": 0,
    "PrepareError": 0,
    "PackageRefused": 0,
    "CacheFull": 0,
    "PullFailed": 0,
    "PullRefused": 0,
}
SHOWN_ARGS = {"_say": 1, "_show": 2, "progress_printer": 0}
"""kunlun-cli helpers that show one of their arguments to the user (name: argument index)."""
UNMARKED_OK = {
    ("controlplane/cli/verify/load.py", "the gateway closed the connection before the answer was complete"),
    # YAML values as the config loader shows them (`found string "x"`), and a sentinel's repr
    ("node_agent/plugins/config_yaml.py", "null"),
    ("node_agent/plugins/config_yaml.py", "true"),
    ("node_agent/plugins/config_yaml.py", "false"),
    ("node_agent/plugins/config_schema.py", "NO_DEFAULT"),
}
"""(module, text) pairs that are deliberately not marked (none should be user-facing)."""
_WORD = re.compile(r"[A-Za-z]{3,}")
_NOT_TEXT_ERRORS = {
    "ValueError",
    "TypeError",
    "RuntimeError",
    "AssertionError",
    "KeyError",
    "OSError",
    "PoError",
    "ImportError",  # a broken vendor module: for whoever wrote it
}
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
        want = {"_": 1, "ngettext": 2, "pgettext": 2, "msg": 2, "msg_list": 2}.get(name)
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
        else:  # pgettext(context, text), msg(id, template) and msg_list(id, template, ...)
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


TABLE_HEADER = "table header"
"""The gettext context of kunlun-cli's table column titles (controlplane/cli/output.print_table)."""


def _header_places(tree: ast.AST) -> tuple[list[ast.expr], list[ast.Call]]:
    """The column-title lists of one kunlun-cli module: the first argument of every print_table()
    call and every module-level `...HEADERS = [...]`; and the calls whose titles are neither a literal
    list nor such a name (unmarked: their titles could not be extracted)."""
    places: list[ast.expr] = []
    bad: list[ast.Call] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id.endswith("HEADERS") for t in node.targets
        ):
            places.append(node.value)
        if isinstance(node, ast.Call) and _name(node.func) == "print_table" and node.args:
            first = node.args[0]
            if isinstance(first, ast.List | ast.Tuple):
                places.append(first)
            elif not (isinstance(first, ast.Name) and first.id.endswith("HEADERS")):
                bad.append(node)
    return places, bad


def header_texts(root: Path = ROOT) -> list[Found]:
    """kunlun-cli's table column titles, extracted by their place (see _header_places), under the
    context TABLE_HEADER: print_table translates them when it prints."""
    out = []
    for path in sorted((root / CLI_PACKAGE).rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        places, _bad = _header_places(ast.parse(path.read_text(encoding="utf-8"), rel))
        for place in places:
            if isinstance(place, ast.List | ast.Tuple):
                for e in place.elts:
                    if isinstance(e, ast.Constant) and isinstance(e.value, str) and e.value:
                        out.append(Found(e.value, context=TABLE_HEADER, where=[f"{rel}:{e.lineno}"]))
    return out


def extract() -> tuple[list[Found], list[str]]:
    """Every user-facing string (merged by context and text, in order of first use) and the problems."""
    code, problems = scan_code()
    merged: dict[tuple[str | None, str], Found] = {}
    for f in [*code, *cli_texts(), *verify_texts(), *header_texts()]:
        have = merged.get((f.context, f.msgid))
        if have is None:
            merged[(f.context, f.msgid)] = Found(f.msgid, f.context, f.plural, list(f.where))
        else:
            have.where += f.where
            if have.plural is None:
                have.plural = f.plural
    return list(merged.values()), problems


def _text_of(node: ast.expr) -> str | None:
    """The words of a text expression (a literal, an f-string, a + of them), or None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value if _WORD.search(node.value) else None
    if isinstance(node, ast.JoinedStr):
        words = "".join(
            v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str)
        )
        return words if _WORD.search(words) else None
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Mod):
        return _text_of(node.left) or _text_of(node.right)
    if isinstance(node, ast.IfExp):
        return _text_of(node.body) or _text_of(node.orelse)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "format":
        return _text_of(node.func.value)
    return None


def _marked(node: ast.expr) -> bool:
    if isinstance(node, ast.Call):
        f = node.func
        if isinstance(f, ast.Name) and f.id in ("_", "ngettext", "pgettext", "msg", "msg_list"):
            return True
        if isinstance(f, ast.Attribute) and f.attr == "format":
            return _marked(f.value)
    if isinstance(node, ast.IfExp):
        return _marked(node.body) and _marked(node.orelse)
    return False


def _name(f: ast.expr) -> str:
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def _is_error(name: str) -> bool:
    return name.endswith(("Error", "Refused", "Input", "Change", "NotFound", "Conflict", "Exceeded", "Exit"))


def _verify_places(node: ast.AST) -> list[ast.expr]:
    """The expressions of a verify module that are shown as texts (see VERIFY_PACKAGE)."""
    out: list[ast.expr] = []
    if isinstance(node, ast.Call):
        name = _name(node.func)
        if name == "add" and isinstance(node.func, ast.Attribute) and len(node.args) >= 4:  # not set.add
            out.append(node.args[0])
            out += [k.value for k in node.keywords if k.arg == "note"]
        elif name == "mark" and isinstance(node.func, ast.Attribute):  # a moment on a picture's time axis
            out += node.args[:1]
        elif name == "LayerResult":
            out += node.args[1:2]
            out += [k.value for k in node.keywords if k.arg in ("title", "skipped")]
    elif isinstance(node, ast.Assign) and any(
        isinstance(t, ast.Name) and t.id == "TITLES" for t in node.targets
    ):
        if isinstance(node.value, ast.Dict):
            out += [v for v in node.value.values if v is not None]
    return out


def _verify_literal(node: ast.expr) -> bool:
    """A text `verify_texts` can extract: a literal, either literal of `a if c else b`, or TITLES[n]."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return True
    if isinstance(node, ast.IfExp):
        return _verify_literal(node.body) and _verify_literal(node.orelse)
    return isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "TITLES"


def verify_texts(root: Path = ROOT) -> list[Found]:
    """The checkpoint names, notes, layer titles and skip reasons of kunlun-cli verify."""
    out = []
    for path in sorted((root / VERIFY_PACKAGE).glob("*.py")):
        rel = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), rel)):
            for place in _verify_places(node):
                for leaf in _leaves(place):
                    if isinstance(leaf, ast.Constant) and isinstance(leaf.value, str) and leaf.value:
                        out.append(Found(leaf.value, where=[f"{rel}:{leaf.lineno}"]))
    return out


def _verify_sinks(node: ast.AST) -> list[ast.expr]:
    """The shown texts of a verify module (VERIFY_SHOWN, VERIFY_LISTS), besides kunlun-cli's own."""
    if not isinstance(node, ast.Call):
        return []
    name = _name(node.func)
    if name == "append" and isinstance(node.func, ast.Attribute):
        target = node.func.value
        target_name = _name(target) if isinstance(target, ast.Name | ast.Attribute) else ""
        return list(node.args[:1]) if target_name in VERIFY_LISTS else []
    if name == "extend" and isinstance(node.func, ast.Attribute) and _name(node.func.value) in VERIFY_LISTS:
        arg = node.args[0] if node.args else None
        return [arg.elt] if isinstance(arg, ast.GeneratorExp | ast.ListComp) else []
    if name not in VERIFY_SHOWN or (name == "add" and not isinstance(node.func, ast.Attribute)):
        return []
    if name == "add" and len(node.args) < 4:  # not a checkpoint (a set's add)
        return []
    out = []
    for i in VERIFY_SHOWN[name]:
        if i >= len(node.args):
            continue
        arg = node.args[i]
        if name == "evidence" and i == 0 and _is_command(arg):
            continue
        out.append(arg)
    return out


def _is_command(node: ast.expr) -> bool:
    """A bare command (see VERIFY_SHOWN): a literal or f-string whose text reads as one."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return bool(_COMMAND.match(node.value))
    if isinstance(node, ast.JoinedStr):
        text = "".join(
            v.value if isinstance(v, ast.Constant) and isinstance(v.value, str) else "X" for v in node.values
        )
        return bool(_COMMAND.match(text))
    return False


def _reason_sinks(node: ast.AST) -> list[ast.expr]:
    """The reasons a stored-reason module writes (REASON_MODULES)."""
    out: list[ast.expr] = []
    if isinstance(node, ast.Call):
        i = REASON_ARGS.get(_name(node.func))
        if i is not None:
            out += node.args[i : i + 1]
        out += [k.value for k in node.keywords if k.arg == "reason"]
        if _name(node.func) == "append" and isinstance(node.func, ast.Attribute):
            if _name(node.func.value) == "failed":  # an analysis' failed checks, joined into its reason
                out += node.args[:1]
    elif isinstance(node, ast.Assign):
        if any(isinstance(t, ast.Attribute | ast.Name) and _name(t) == "reason" for t in node.targets):
            out.append(node.value)
    return out


def _cli_sinks(node: ast.AST) -> list[ast.expr]:
    if not isinstance(node, ast.Call):
        return []
    name = _name(node.func)
    if name in SHOWN_ARGS:
        i = SHOWN_ARGS[name]
        return list(node.args[i : i + 1])
    if name == "print":
        return list(node.args)
    if isinstance(node.func, ast.Attribute) and name in ("write", "error"):
        receiver = node.func.value
        if isinstance(receiver, ast.Name) and receiver.id in ("log", "logger"):
            return []  # a log event name: logs stay English (log pipelines read them)
        return list(node.args[:1])
    if _is_error(name) and name not in _NOT_TEXT_ERRORS:
        return list(node.args[:1])
    if name == "format" and _marked(node):  # values put into a marked text must not be English words
        return [k.value for k in node.keywords] + list(node.args)
    return []


def _replica_sinks(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
        name = _name(node.exc.func)
        if _is_error(name) and name not in _NOT_TEXT_ERRORS:
            return list(node.exc.args[:1])
    if isinstance(node, ast.Call) and _name(node.func) == "abort":  # abort(context, code, text)
        return list(node.args[2:3])
    if isinstance(node, ast.Call) and _name(node.func) == "append":
        target = node.func.value if isinstance(node.func, ast.Attribute) else None
        if isinstance(target, ast.Name) and target.id in ("p", "problems"):
            return list(node.args[:1])
    return []


def _config_sinks(node: ast.AST) -> list[ast.expr]:
    out = _replica_sinks(node)
    if isinstance(node, ast.Call) and _name(node.func) == "Fault":
        out += node.args
    elif isinstance(node, ast.Call) and _name(node.func) == "Problem":
        out += node.args[3:]
    elif isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for t in targets:
            names = t.elts if isinstance(t, ast.Tuple) else [t]
            values = (
                node.value.elts if isinstance(node.value, ast.Tuple) and isinstance(t, ast.Tuple) else None
            )
            for k, n in enumerate(names):
                if isinstance(n, ast.Name) and n.id in CONFIG_PARTS:
                    out.append(values[k] if values is not None else node.value)
    elif isinstance(node, ast.Return) and node.value is not None:
        out.append(node.value)
    return out


INSTALLER_CHECKS = {"kunlun_installer/host.py": ("check_config", "check_etcd_env", "check_etcd_crl")}
"""kunlun-installer's config checks (module: functions): the step, what happened and the fix of each
refusal, and each step line, are messages, which the installer prints in the reader's language."""


def _installer_sinks(node: ast.AST) -> list[ast.expr]:
    out = _msg_values(node)
    if isinstance(node, ast.Call) and _name(node.func) == "InstallError":
        out += node.args
    elif isinstance(node, ast.Call) and _name(node.func) in ("say", "print"):
        out += node.args
    return out


def _installer_unmarked(text: str, source: str, functions: tuple[str, ...]) -> list[str]:
    out = []
    for fn in ast.walk(ast.parse(text, source)):
        if not (isinstance(fn, ast.FunctionDef) and fn.name in functions):
            continue
        for node in ast.walk(fn):
            for arg in _installer_sinks(node):
                for b in _leaves(arg):
                    words = None if _marked(b) else _text_of(b)
                    if words is not None and (source, words.strip()) not in UNMARKED_OK:
                        out.append(f"{source}:{b.lineno}: {words.strip()[:80]!r}")
    return out


def _msg_values(node: ast.AST) -> list[ast.expr]:
    """The values put into a message (`msg(ID, TEMPLATE, name=VALUE)`): a text there must be one too."""
    if isinstance(node, ast.Call) and _name(node.func) in ("msg", "msg_list"):
        return [k.value for k in node.keywords if k.arg not in ("bullet", "sep")]
    return []


def _device_sinks(node: ast.AST) -> list[ast.expr]:
    out = _replica_sinks(node) + _msg_values(node)
    if isinstance(node, ast.Call):
        i = DEVICE_ARGS.get(_name(node.func))
        if i is not None:
            out += node.args[i : i + 1]
        if _name(node.func) == "append" and isinstance(node.func, ast.Attribute):
            if _name(node.func.value) in DEVICE_LISTS:
                out += node.args[:1]
    elif isinstance(node, ast.Assign):
        if any(isinstance(t, ast.Attribute) and t.attr == "status_reason" for t in node.targets):
            out.append(node.value)
    return out


def _probe_sinks(node: ast.AST) -> list[ast.expr]:
    out = _cli_sinks(node) + _msg_values(node)
    if isinstance(node, ast.Call) and _name(node.func) == "say":
        out += node.args[:1]
    return out


def _leaves(node: ast.expr) -> list[ast.expr]:
    """The expressions a value can come from: both branches of `a if c else b`, each of `a or b`."""
    if isinstance(node, ast.IfExp):
        return _leaves(node.body) + _leaves(node.orelse)
    if isinstance(node, ast.BoolOp):
        return [x for v in node.values for x in _leaves(v)]
    return [node]


def unmarked_source(text: str, source: str, replica: bool, config: bool = False, kind: str = "") -> list[str]:
    """The unmarked user-facing texts of one module, as 'file:line: text' (`config`: a module of the
    device-plugin config loader, CONFIG_MODULES; `kind` "verify": kunlun-cli verify's shown texts,
    VERIFY_SHOWN; "reason": a module that stores reasons, REASON_MODULES; "device": DEVICE_MODULES;
    "probe": PROBE_MODULES)."""
    out = []
    sinks = (
        _device_sinks
        if kind == "device"
        else _probe_sinks
        if kind == "probe"
        else _verify_sinks
        if kind == "verify"
        else _reason_sinks
        if kind == "reason"
        else _config_sinks
        if config
        else _replica_sinks
        if replica
        else _cli_sinks
    )
    for node in ast.walk(ast.parse(text, source)):
        for arg in sinks(node):
            for b in _leaves(arg):
                words = None if _marked(b) else _text_of(b)
                if words is not None and (source, words.strip()) not in UNMARKED_OK:
                    out.append(f"{source}:{b.lineno}: {words.strip()[:80]!r}")
    return out


def unmarked(root: Path = ROOT) -> list[str]:
    """Every user-facing text of kunlun-cli, of the replicas' client errors and of the servers'
    start-up errors that is not marked."""
    out: list[str] = []
    for path in sorted((root / CLI_PACKAGE).rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        out += unmarked_source(path.read_text(encoding="utf-8"), rel, False)
        _places, bad = _header_places(ast.parse(path.read_text(encoding="utf-8"), rel))
        out += [
            f"{rel}:{c.lineno}: {ast.unparse(c)[:80]} (column titles must be a literal list or a ...HEADERS "
            "name: they are extracted where written and translated where printed)"
            for c in bad
        ]
    for path in sorted((root / VERIFY_PACKAGE).glob("*.py")):
        rel = path.relative_to(root).as_posix()
        out += unmarked_source(path.read_text(encoding="utf-8"), rel, False, kind="verify")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), rel)):
            out += [
                f"{rel}:{p.lineno}: {ast.unparse(p)[:80]} (a verify text must be a literal: it is translated where shown)"
                for p in _verify_places(node)
                if not _verify_literal(p)
            ]
    for where in STARTUP_MAINS:
        if (root / where).exists():
            out += unmarked_source((root / where).read_text(encoding="utf-8"), where, False)
    for where in (*REPLICA_MODULES, *STARTUP_MODULES):
        paths = [root / where] if where.endswith(".py") else sorted((root / where).rglob("*.py"))
        for path in paths:
            if not path.exists():
                continue
            out += unmarked_source(path.read_text(encoding="utf-8"), path.relative_to(root).as_posix(), True)
    for where in CONFIG_MODULES:
        if (root / where).exists():
            out += unmarked_source((root / where).read_text(encoding="utf-8"), where, True, config=True)
    for where in REASON_MODULES:
        if (root / where).exists():
            out += unmarked_source((root / where).read_text(encoding="utf-8"), where, True, kind="reason")
    for where, functions in INSTALLER_CHECKS.items():
        if (root / where).exists():
            out += _installer_unmarked((root / where).read_text(encoding="utf-8"), where, functions)
    for kind, modules in (("device", DEVICE_MODULES), ("probe", PROBE_MODULES)):
        for where in modules:
            paths = [root / where] if where.endswith(".py") else sorted((root / where).rglob("*.py"))
            for path in paths:
                if path.exists():
                    rel = path.relative_to(root).as_posix()
                    out += unmarked_source(path.read_text(encoding="utf-8"), rel, True, kind=kind)
    return out


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
    if cmd == "unmarked":
        lines = unmarked()
        for line in lines:
            print(line)
        return 1 if lines else 0
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
