"""`kunlun-cli scheduler config get|set`: the scheduler's settings, applied live.

`set -f FILE` replaces the whole config; `set KEY=VALUE ...` reads the stored config, changes those
fields and stores it (two operators changing fields at once: the later write wins whole)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from controlplane.cli.client import CliError
from controlplane.cli.output import print_json
from kunlun_common.api import workload_pb2
from kunlun_common.i18n import _


def make_client(args: argparse.Namespace) -> Any:
    from controlplane.cli.main import make_client as make

    return make(args)


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    s = sub.add_parser("scheduler", help="scheduler settings (applied live)", parents=[common])
    ss = s.add_subparsers(dest="cmd", required=True)
    c = ss.add_parser("config", help="get or set scheduler_config.yaml", parents=[common])
    cs = c.add_subparsers(dest="sub", required=True)
    g = cs.add_parser("get", help="print the scheduler config", parents=[common])
    g.set_defaults(handler=config_get)
    st = cs.add_parser(
        "set",
        help="replace the scheduler config from a file, or change fields KEY=VALUE (an invalid config is refused whole)",
        parents=[common],
    )
    st.add_argument("-f", "--file", help="the whole scheduler_config.yaml")
    st.add_argument(
        "fields",
        nargs="*",
        metavar="KEY=VALUE",
        help="fields to change in the stored config (VALUE in YAML: true, 50, [high]; KEY may be a.b)",
    )
    st.set_defaults(handler=config_set)


def config_get(args: argparse.Namespace) -> int:
    resp = make_client(args).workloads(lambda s: s.GetSchedulerConfig, workload_pb2.SchedulerConfigRequest())
    if args.output == "json":
        import yaml

        print_json(yaml.safe_load(resp.yaml))
    else:
        sys.stdout.write(resp.yaml)
    return 0


def apply_fields(text: str, pairs: list[str]) -> str:
    """`text` (scheduler config YAML) with the KEY=VALUE pairs set; the server validates the result."""
    import yaml

    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise CliError(_("scheduler config: not valid YAML ({e})").format(e=e)) from None
    if not isinstance(data, dict):
        raise CliError(_("scheduler config: expected a mapping at the top level"))
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise CliError(_("{pair!r}: expected KEY=VALUE, e.g. advanced_profiling=true").format(pair=pair))
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            raise CliError(
                _("{pair!r}: VALUE is not a YAML value; quote strings, e.g. policy=binpack").format(pair=pair)
            ) from None
        parts = key.strip().split(".")
        node = data
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise CliError(
                    _("{pair!r}: {part} is not a mapping; set it whole instead").format(pair=pair, part=part)
                )
            node = child
        node[parts[-1]] = value
    return str(yaml.safe_dump(data, sort_keys=False, default_flow_style=False))


def config_set(args: argparse.Namespace) -> int:
    if not args.file and not args.fields:
        raise CliError(_("give -f FILE (the whole config) or fields KEY=VALUE, e.g. advanced_profiling=true"))
    client = make_client(args)
    if args.file:
        try:
            text = Path(args.file).read_text()
        except OSError as e:
            raise CliError(
                _("{file}: cannot be read ({strerror})").format(file=args.file, strerror=e.strerror)
            ) from None
    else:
        text = client.workloads(lambda s: s.GetSchedulerConfig, workload_pb2.SchedulerConfigRequest()).yaml
    if args.fields:
        text = apply_fields(text, list(args.fields))
    resp = client.workloads(lambda s: s.SetSchedulerConfig, workload_pb2.SchedulerConfigText(yaml=text))
    if args.output == "json":
        import yaml

        print_json(yaml.safe_load(resp.yaml))
    else:
        print(_("scheduler config applied"))
    return 0
