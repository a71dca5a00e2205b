"""`kunlun-device-probe`: do what the agent does to find its devices, say every step, start nothing.

    kunlun-device-probe --config device-plugin-config.yaml [--verbose] [-o json] [--state-dir D]

Steps, each printed: (1) read and check the config file (every problem when it cannot be used);
(2) in simulated mode, set up the stand-in vendor tools exactly like the agent (`node_agent.simulation`: the
state file and shims in the state directory, a fresh temporary one unless --state-dir names the
agent's); (3) run each declared vendor's tool once, printing the command line, where it was found and
what it reported (its raw output with --verbose); (4) build each device from its declaration and the
tool's report, with the same plugins and rules as the agent (`DeviceManager`); (5) a table DEVICE,
TYPE, MODEL, STATUS, REASON and, when devices are unusable, exactly why (tool missing, device declared
but not found, which config file).

Exit status: 0 when every declared device is Ready, 1 when some are not (Error, Unhealthy), 2 when
the file cannot be used (or the arguments are wrong). `-o json` prints one JSON document instead.

Every line is a message (`kunlun_common.messages`): printed in the reader's language (`LANG=zh_CN.UTF-8`:
Chinese; the help and argparse's own errors too), while `-o json` keeps every text in English (its `log`,
`problems`, `why`, the devices' `status_reason`), as scripts read it. The table's titles and reasons are
translated (as kunlun-cli's tables), its values and statuses stay as they are.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import unicodedata
from pathlib import Path
from typing import Any

from google.protobuf import json_format

from kunlun_common.api import types_pb2
from kunlun_common.i18n import _, bind_global_domain, localize, pgettext
from kunlun_common.logs import setup_logging
from kunlun_common.messages import Message, from_stored, msg, of_error, plain
from node_agent.devices import DeviceManager
from node_agent.plugins.config import ConfigFileError, DeviceDecl, NodeConfig, load_config
from node_agent.plugins.contract import status_name
from node_agent.plugins.vendor_plugin import ToolSample, VendorPlugin
from node_agent.simulation import simulated_mode
from node_agent.vendors.base import format_command

EXIT_OK, EXIT_UNUSABLE, EXIT_INVALID = 0, 1, 2
REASON_WIDTH = 100  # the table shortens reasons to this (not with --verbose); the summary has them whole


class Report:
    """Where the probe's lines go: printed at once in the reader's language (text output), or kept in
    English for `-o json`'s `log`."""

    def __init__(self, english: bool) -> None:
        self.english = english
        self.lines: list[str] = []

    def text(self, m: Message) -> str:
        return str(m) if self.english else localize(m)

    def say(self, m: Message, indent: str = "") -> None:
        """One line: `m` after `indent`."""
        self.raw(indent + self.text(m))

    def raw(self, line: str) -> None:
        """A line that is not a sentence (a tool's output, a table row made of values and texts)."""
        if self.english:
            self.lines.append(line)
        else:
            print(line)


def _memory(mb: int | None) -> Message:
    if mb is None:
        return msg("probe.memory_unavailable", "memory unavailable (declared size unchecked)")
    return msg("probe.memory_mb", "{mb} MB", mb=mb)


def _reason(dev: types_pb2.Device) -> Message | None:
    """A device's reason as the message its plugin set (its text as is when it set none)."""
    if not dev.status_reason:
        return None
    return from_stored(dev.status_reason_message, dev.status_reason) or plain(dev.status_reason)


def _raw_output(text: str, out: Report) -> None:
    lines = text.rstrip("\n").splitlines()
    for line in lines:
        out.raw("      | " + line)
    if not lines:
        out.say(msg("probe.no_output", "(no output)"), "      | ")


def _decl_line(config: NodeConfig, d: DeviceDecl) -> Message:
    row = "[" + ", ".join(str(x) for x in d.topology_distance) + "]" if d.topology_distance else None
    return msg(
        "probe.declared",
        "{device}: declared at {path}:{line}: type {device_type}, index {index}, model {model}, {memory} MB, "
        "p2p {p2p}, topology row {row}",
        device=config.device_name(d),
        path=config.path,
        line=d.line,
        device_type=d.device_type,
        index=d.device_id,
        model=d.model or "?",
        memory=d.hbm_memory_mb or d.total_memory_mb,
        p2p=msg("probe.on", "on") if d.p2p_enabled else msg("probe.off", "off"),
        row=row or msg("probe.no_row", "none"),
    )


def _describe_run(plugin: VendorPlugin, run: ToolSample, verbose: bool, out: Report) -> None:
    out.say(
        msg(
            "probe.running",
            "{device_type}: running `{command}` ({where})",
            device_type=plugin.device_type,
            command=format_command(run.command),
            where=run.executable or msg("probe.not_on_path", "not found on PATH"),
        ),
        "  ",
    )
    if run.tool != plugin.adapter.tool:
        out.say(
            msg(
                "probe.fallback",
                "({tool} is not on PATH: {ran} runs instead)",
                tool=plugin.adapter.tool,
                ran=run.tool,
            ),
            "    ",
        )
    if run.error is not None:
        out.say(
            msg(
                "probe.tool_failed",
                "-> failed after {seconds:.2f} s: {error}",
                seconds=run.duration_s,
                error=of_error(run.error),
            ),
            "    ",
        )
    else:
        out.say(
            msg(
                "probe.tool_ok",
                "-> ok in {seconds:.2f} s: {count} device(s) reported",
                seconds=run.duration_s,
                count=len(run.observed),
            ),
            "    ",
        )
        for o in sorted(run.observed, key=lambda o: o.index):
            out.say(
                msg(
                    "probe.reported",
                    "index {index}: model {model!r}, {memory}, health {health}",
                    index=o.index,
                    model=o.model,
                    memory=_memory(o.memory_total_mb),
                    health=o.health,
                ),
                "       ",
            )
    if verbose:
        out.say(msg("probe.raw_output", "raw output:"), "    ")
        _raw_output(run.raw_output, out)


def _describe_device(manager: DeviceManager, d: DeviceDecl, dev: types_pb2.Device, out: Report) -> None:
    out.say(
        msg(
            "probe.built",
            "{device}: built from the declaration at {path}:{line}",
            device=dev.name,
            path=manager.config.path,
            line=d.line,
        ),
        "  ",
    )
    plugin = manager.plugins.get(d.device_type)
    verdict = plugin.verdicts.get(dev.name) if plugin is not None else None
    if verdict is not None and verdict.observed is not None:
        o = verdict.observed
        out.say(
            msg(
                "probe.observed",
                "{tool} index {index}: model {model!r}, {memory}, health {health}, {busy:g}% busy, "
                "{used} MB used",
                tool=plugin.tool if plugin else "?",
                index=o.index,
                model=o.model,
                memory=_memory(o.memory_total_mb),
                health=o.health,
                busy=o.utilization_pct or 0,
                used=o.memory_used_mb or 0,
            ),
            "    ",
        )
    for problem in d.errors:
        out.say(msg("probe.problem", "problem: {problem}", problem=problem.message()), "    ")
    reason = _reason(dev)
    tool_error = manager.tool_error_messages.get(d.device_type)
    if d.errors:
        reason = msg(
            "probe.declaration_problems",
            "its declaration has {count} problem(s), listed above",
            count=len(d.errors),
        )
    elif reason is not None and tool_error is not None and dev.status_reason == str(tool_error):
        reason = msg(
            "probe.tool_unusable",
            "{tool} could not be used, see step 3",
            tool=plugin.tool if plugin else msg("probe.the_tool", "the tool"),
        )
    status = status_name(dev.status)
    if reason is None:
        out.say(msg("probe.status", "-> {status}", status=status), "    ")
    else:
        out.say(msg("probe.status_reason", "-> {status} ({reason})", status=status, reason=reason), "    ")


def _short(text: str, verbose: bool) -> str:
    return text if verbose or len(text) <= REASON_WIDTH else text[: REASON_WIDTH - 3] + "..."


def _width(text: str) -> int:
    """Terminal columns of `text` (a wide, CJK, character takes two)."""
    return sum(2 if unicodedata.east_asian_width(c) in ("W", "F") else 1 for c in text)


def _titles(out: Report) -> tuple[str, ...]:
    """The table's column titles: as kunlun-cli's tables, in the reader's language (`-o json`'s log: English)."""
    titles = (
        pgettext("table header", "DEVICE"),
        pgettext("table header", "TYPE"),
        pgettext("table header", "MODEL"),
        pgettext("table header", "STATUS"),
        pgettext("table header", "REASON"),
    )
    return ("DEVICE", "TYPE", "MODEL", "STATUS", "REASON") if out.english else titles


def _table(devices: list[types_pb2.Device], verbose: bool, out: Report) -> list[str]:
    """The result table: column titles and reasons in the reader's language, values and statuses as they are."""
    rows = [_titles(out)]
    for d in devices:
        reason = _reason(d)
        shown = "" if reason is None else out.text(reason)
        rows.append((d.name, d.device_type, d.model, status_name(d.status), _short(shown, verbose)))
    widths = [max(_width(r[i]) for r in rows) for i in range(4)]
    return [
        ("  ".join(r[i] + " " * (widths[i] - _width(r[i])) for i in range(4)) + "  " + r[4]).rstrip()
        for r in rows
    ]


def _why_unusable(manager: DeviceManager, devices: list[types_pb2.Device]) -> list[tuple[str, Message]]:
    """Why devices cannot be used: (indent, message) lines, none when every device is Ready."""
    bad = [d for d in devices if d.status != types_pb2.DEVICE_STATUS_READY]
    if not bad:
        return []
    config_path = os.path.abspath(manager.config.path)
    if len(bad) == len(devices):
        head = msg(
            "probe.none_usable",
            "no usable device on node {node} (config file {path}):",
            node=manager.config.node_name,
            path=config_path,
        )
    else:
        head = msg(
            "probe.some_unusable",
            "{bad} of {total} devices unusable (config file {path}):",
            bad=len(bad),
            total=len(devices),
            path=config_path,
        )
    lines = [("", head)]
    for device_type, error in manager.tool_error_messages.items():
        lines.append(
            ("  ", msg("probe.type_error", "{device_type}: {error}", device_type=device_type, error=error))
        )
    for d in bad:
        if d.device_type not in manager.tool_errors:
            lines.append(
                (
                    "  ",
                    msg(
                        "probe.device_error",
                        "{device}: {status}: {reason}",
                        device=d.name,
                        status=status_name(d.status),
                        reason=_reason(d) or "",
                    ),
                )
            )
    return lines


def _sim_setup(config: NodeConfig, state_dir: str | None, out: Report) -> tuple[dict[str, str], str | None]:
    """The environment the tools run in; the temporary directory to remove afterwards, if any."""
    if not config.simulated:
        out.say(
            msg(
                "probe.mode_real",
                "mode: real hardware: the vendor tools are looked up on this process's PATH",
            ),
            "  ",
        )
        return dict(os.environ), None
    temporary = None if state_dir else tempfile.mkdtemp(prefix="kunlun-probe-")
    directory = Path(state_dir or temporary or ".")
    env = simulated_mode(config, directory).env
    state = config.simulator_state or str(directory / "sim-state.json")
    out.say(
        msg(
            "probe.mode_simulated",
            "mode: simulated (node.simulated: true): stand-in vendor tools, shims in {shims}",
            shims=str(directory / "sim-bin"),
        ),
        "  ",
    )
    if temporary and not config.simulator_state:
        state_line = msg(
            "probe.state_file_fresh",
            "stand-in state file: {state} (a fresh one seeded from the declaration); give --state-dir to "
            "see an agent's own state",
            state=state,
        )
    else:
        state_line = msg(
            "probe.state_file",
            "stand-in state file: {state}; give --state-dir to see an agent's own state",
            state=state,
        )
    out.say(state_line, "  ")
    return env, temporary


def probe(config_path: str, verbose: bool, state_dir: str | None, out: Report) -> tuple[int, dict[str, Any]]:
    """Run the probe; returns the exit status and the JSON report."""
    report: dict[str, Any] = {"config": os.path.abspath(config_path)}
    out.say(msg("probe.step1", "step 1: reading {path}", path=os.path.abspath(config_path)))
    try:
        config = load_config(config_path)
    except ConfigFileError as e:
        out.say(
            msg(
                "probe.unusable_file",
                "the file cannot be used ({count} problem(s)):",
                count=len(e.problems),
            ),
            "  ",
        )
        for p in e.problems:
            out.say(p.message(), "    ")
        report.update(valid=False, problems=[str(p) for p in e.problems], exit_code=EXIT_INVALID)
        return EXIT_INVALID, report
    types = list(dict.fromkeys(d.device_type for d in config.devices))
    out.say(
        msg(
            "probe.config_ok",
            "ok: node {node}, address {address}, simulated {simulated}, health every {interval:g} s, "
            "{count} device(s) of type {types}",
            node=config.node_name,
            address=config.address,
            simulated=str(config.simulated).lower(),
            interval=config.health_interval_seconds,
            count=len(config.devices),
            types=", ".join(types),
        ),
        "  ",
    )
    for d in config.devices:
        out.say(_decl_line(config, d), "  ")
        for problem in d.errors:
            out.say(msg("probe.problem", "problem: {problem}", problem=problem.message()), "    ")
    report.update(valid=True, node=config.node_name, problems=[str(p) for p in config.problems])
    out.say(msg("probe.step2", "step 2: tool environment"))
    env, temporary = _sim_setup(config, state_dir, out)
    try:
        manager = DeviceManager(config, env)
        out.say(msg("probe.step3", "step 3: running the vendor tools"))
        runs = manager.sample_blocking()
        if not runs:
            out.say(msg("probe.no_tool", "no known device type declared: no tool to run"), "  ")
        tools = []
        for device_type, run in runs.items():
            _describe_run(manager.plugins[device_type], run, verbose, out)
            tools.append(
                {
                    "device_type": device_type,
                    "command": run.command,
                    "executable": run.executable,
                    "ok": run.error is None,
                    "error": None if run.error is None else str(run.error),
                    "reported_indexes": sorted(o.index for o in run.observed),
                    "output": run.raw_output,
                }
            )
    finally:
        if temporary is not None:
            shutil.rmtree(temporary, ignore_errors=True)
    out.say(msg("probe.step4", "step 4: building the devices"))
    devices = manager.devices()
    for d, dev in zip(config.devices, devices, strict=True):
        _describe_device(manager, d, dev, out)
    out.say(msg("probe.step5", "step 5: result"))
    for line in _table(devices, verbose, out):
        out.raw("  " + line)
    why = _why_unusable(manager, devices)
    for indent, m in why:
        out.say(m, indent)
    code = EXIT_UNUSABLE if why else EXIT_OK
    if code == EXIT_OK:
        out.say(msg("probe.all_usable", "all {count} declared device(s) are usable", count=len(devices)))
    report.update(
        tools=tools,
        devices=[_device_json(dev) for dev in devices],
        usable=code == EXIT_OK,
        why=[indent + str(m) for indent, m in why],
        exit_code=code,
    )
    return code, report


def _device_json(dev: types_pb2.Device) -> dict[str, Any]:
    """A device as `-o json` shows it: its fields, the status by name, the reason in English only."""
    out = json_format.MessageToDict(dev, preserving_proto_field_name=True)
    out.pop("status_reason_message", None)
    return {**out, "status": status_name(dev.status)}


def parser() -> argparse.ArgumentParser:
    """The probe's arguments, their help in the reader's language (argparse's own words too)."""
    bind_global_domain()
    p = argparse.ArgumentParser(
        prog="kunlun-device-probe",
        description=_("Show step by step how a node agent would find its devices, without starting it."),
    )
    p.add_argument("--config", required=True, help=_("the node's device-plugin-config.yaml"))
    p.add_argument("--verbose", "-v", action="store_true", help=_("print each tool's raw output"))
    p.add_argument("-o", "--output", choices=("text", "json"), default="text", help=_("output format"))
    p.add_argument(
        "--state-dir", help=_("simulated mode: the agent's state dir (default: a fresh temporary one)")
    )
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    setup_logging("kunlun-device-probe", "warning")  # logs go to stderr; stdout is the report
    out = Report(english=args.output == "json")
    code, report = probe(args.config, args.verbose, args.state_dir, out)
    if args.output == "json":
        report["log"] = out.lines
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    sys.exit(code)


if __name__ == "__main__":
    main()
