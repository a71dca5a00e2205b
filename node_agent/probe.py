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
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from google.protobuf import json_format

from kunlun_common.api import types_pb2
from kunlun_common.logs import setup_logging
from node_agent.devices import DeviceManager
from node_agent.plugins.config import ConfigFileError, DeviceDecl, NodeConfig, load_config
from node_agent.plugins.contract import status_name
from node_agent.plugins.vendor_plugin import ToolSample, VendorPlugin
from node_agent.simulation import simulated_mode
from node_agent.vendors.base import format_command

EXIT_OK, EXIT_UNUSABLE, EXIT_INVALID = 0, 1, 2
REASON_WIDTH = 100  # the table shortens reasons to this (not with --verbose); the summary has them whole
Say = Callable[[str], None]
MEMORY_UNAVAILABLE = "memory unavailable (declared size unchecked)"


def _indent(text: str, prefix: str = "      | ") -> str:
    return "\n".join(prefix + line for line in text.rstrip("\n").splitlines()) or prefix + "(no output)"


def _decl_line(config: NodeConfig, d: DeviceDecl) -> str:
    memory = d.hbm_memory_mb or d.total_memory_mb
    row = "[" + ", ".join(str(x) for x in d.topology_distance) + "]" if d.topology_distance else "none"
    return (
        f"{config.device_name(d)}: declared at {config.path}:{d.line}: type {d.device_type}, index "
        f"{d.device_id}, model {d.model or '?'}, {memory} MB, p2p {'on' if d.p2p_enabled else 'off'}, "
        f"topology row {row}"
    )


def _describe_run(plugin: VendorPlugin, run: ToolSample, verbose: bool, say: Say) -> None:
    where = run.executable or "not found on PATH"
    say(f"  {plugin.device_type}: running `{format_command(run.command)}` ({where})")
    if run.tool != plugin.adapter.tool:
        say(f"    ({plugin.adapter.tool} is not on PATH: {run.tool} runs instead)")
    if run.error is not None:
        say(f"    -> failed after {run.duration_s:.2f} s: {run.error}")
    else:
        say(f"    -> ok in {run.duration_s:.2f} s: {len(run.observed)} device(s) reported")
        for o in sorted(run.observed, key=lambda o: o.index):
            memory = MEMORY_UNAVAILABLE if o.memory_total_mb is None else f"{o.memory_total_mb} MB"
            say(f"       index {o.index}: model {o.model!r}, {memory}, health {o.health}")
    if verbose:
        say("    raw output:")
        say(_indent(run.raw_output))


def _describe_device(manager: DeviceManager, d: DeviceDecl, dev: types_pb2.Device, say: Say) -> None:
    say(f"  {dev.name}: built from the declaration at {manager.config.path}:{d.line}")
    plugin = manager.plugins.get(d.device_type)
    verdict = plugin.verdicts.get(dev.name) if plugin is not None else None
    if verdict is not None and verdict.observed is not None:
        o = verdict.observed
        memory = MEMORY_UNAVAILABLE if o.memory_total_mb is None else f"{o.memory_total_mb} MB"
        say(
            f"    {plugin.tool if plugin else '?'} index {o.index}: model {o.model!r}, {memory}, "
            f"health {o.health}, {o.utilization_pct or 0:g}% busy, {o.memory_used_mb or 0} MB used"
        )
    for problem in d.errors:
        say(f"    problem: {problem}")
    reason = dev.status_reason
    if d.errors:
        reason = f"its declaration has {len(d.errors)} problem(s), listed above"
    elif reason and reason == manager.tool_errors.get(d.device_type):
        reason = f"{plugin.tool if plugin else 'the tool'} could not be used, see step 3"
    say(f"    -> {status_name(dev.status)}" + (f" ({reason})" if reason else ""))


def _short(text: str, verbose: bool) -> str:
    return text if verbose or len(text) <= REASON_WIDTH else text[: REASON_WIDTH - 3] + "..."


def _table(devices: list[types_pb2.Device], verbose: bool) -> list[str]:
    rows = [("DEVICE", "TYPE", "MODEL", "STATUS", "REASON")]
    rows += [
        (d.name, d.device_type, d.model, status_name(d.status), _short(d.status_reason, verbose))
        for d in devices
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return [("  ".join(r[i].ljust(widths[i]) for i in range(4)) + "  " + r[4]).rstrip() for r in rows]


def _why_unusable(manager: DeviceManager, devices: list[types_pb2.Device]) -> list[str]:
    bad = [d for d in devices if d.status != types_pb2.DEVICE_STATUS_READY]
    if not bad:
        return []
    config_path = os.path.abspath(manager.config.path)
    if len(bad) == len(devices):
        head = f"no usable device on node {manager.config.node_name} (config file {config_path}):"
    else:
        head = f"{len(bad)} of {len(devices)} devices unusable (config file {config_path}):"
    lines = [head]
    for device_type, error in manager.tool_errors.items():
        lines.append(f"  {device_type}: {error}")
    for d in bad:
        if d.device_type not in manager.tool_errors:
            lines.append(f"  {d.name}: {status_name(d.status)}: {d.status_reason}")
    return lines


def _sim_setup(config: NodeConfig, state_dir: str | None, say: Say) -> tuple[dict[str, str], str | None]:
    """The environment the tools run in; the temporary directory to remove afterwards, if any."""
    if not config.simulated:
        say("  mode: real hardware: the vendor tools are looked up on this process's PATH")
        return dict(os.environ), None
    temporary = None if state_dir else tempfile.mkdtemp(prefix="kunlun-probe-")
    directory = Path(state_dir or temporary or ".")
    env = simulated_mode(config, directory).env
    state = config.simulator_state or str(directory / "sim-state.json")
    say(f"  mode: simulated (node.simulated: true): stand-in vendor tools, shims in {directory / 'sim-bin'}")
    note = " (a fresh one seeded from the declaration)" if temporary and not config.simulator_state else ""
    say(f"  stand-in state file: {state}{note}; give --state-dir to see an agent's own state")
    return env, temporary


def probe(config_path: str, verbose: bool, state_dir: str | None, say: Say) -> tuple[int, dict[str, Any]]:
    """Run the probe; returns the exit status and the JSON report."""
    report: dict[str, Any] = {"config": os.path.abspath(config_path)}
    say(f"step 1: reading {os.path.abspath(config_path)}")
    try:
        config = load_config(config_path)
    except ConfigFileError as e:
        say(f"  the file cannot be used ({len(e.problems)} problem(s)):")
        for p in e.problems:
            say(f"    {p}")
        report.update(valid=False, problems=[str(p) for p in e.problems], exit_code=EXIT_INVALID)
        return EXIT_INVALID, report
    types = list(dict.fromkeys(d.device_type for d in config.devices))
    say(
        f"  ok: node {config.node_name}, address {config.address}, simulated {str(config.simulated).lower()}, "
        f"health every {config.health_interval_seconds:g} s, {len(config.devices)} device(s) of "
        f"type {', '.join(types)}"
    )
    for d in config.devices:
        say("  " + _decl_line(config, d))
        for problem in d.errors:
            say(f"    problem: {problem}")
    report.update(valid=True, node=config.node_name, problems=[str(p) for p in config.problems])
    say("step 2: tool environment")
    env, temporary = _sim_setup(config, state_dir, say)
    try:
        manager = DeviceManager(config, env)
        say("step 3: running the vendor tools")
        runs = manager.sample_blocking()
        if not runs:
            say("  no known device type declared: no tool to run")
        tools = []
        for device_type, run in runs.items():
            _describe_run(manager.plugins[device_type], run, verbose, say)
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
    say("step 4: building the devices")
    devices = manager.devices()
    for d, dev in zip(config.devices, devices, strict=True):
        _describe_device(manager, d, dev, say)
    say("step 5: result")
    for line in _table(devices, verbose):
        say("  " + line)
    why = _why_unusable(manager, devices)
    for line in why:
        say(line)
    code = EXIT_UNUSABLE if why else EXIT_OK
    if code == EXIT_OK:
        say(f"all {len(devices)} declared device(s) are usable")
    report.update(
        tools=tools,
        devices=[
            {
                **json_format.MessageToDict(dev, preserving_proto_field_name=True),
                "status": status_name(dev.status),
            }
            for dev in devices
        ],
        usable=code == EXIT_OK,
        why=why,
        exit_code=code,
    )
    return code, report


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="kunlun-device-probe",
        description="Show step by step how a node agent would find its devices, without starting it.",
    )
    p.add_argument("--config", required=True, help="the node's device-plugin-config.yaml")
    p.add_argument("--verbose", "-v", action="store_true", help="print each tool's raw output")
    p.add_argument("-o", "--output", choices=("text", "json"), default="text", help="output format")
    p.add_argument(
        "--state-dir", help="simulated mode: the agent's state dir (default: a fresh temporary one)"
    )
    args = p.parse_args(argv)
    setup_logging("kunlun-device-probe", "warning")  # logs go to stderr; stdout is the report
    lines: list[str] = []
    say: Say = print if args.output == "text" else lines.append
    code, report = probe(args.config, args.verbose, args.state_dir, say)
    if args.output == "json":
        report["log"] = lines
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    sys.exit(code)


if __name__ == "__main__":
    main()
