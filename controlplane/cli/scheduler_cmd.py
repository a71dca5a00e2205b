"""`kunlun-cli scheduler config get|set`: the scheduler's settings, applied live."""

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
        "set", help="replace the scheduler config (an invalid file is refused whole)", parents=[common]
    )
    st.add_argument("-f", "--file", required=True)
    st.set_defaults(handler=config_set)


def config_get(args: argparse.Namespace) -> int:
    resp = make_client(args).workloads(lambda s: s.GetSchedulerConfig, workload_pb2.SchedulerConfigRequest())
    if args.output == "json":
        import yaml

        print_json(yaml.safe_load(resp.yaml))
    else:
        sys.stdout.write(resp.yaml)
    return 0


def config_set(args: argparse.Namespace) -> int:
    try:
        text = Path(args.file).read_text()
    except OSError as e:
        raise CliError(
            _("{file}: cannot be read ({strerror})").format(file=args.file, strerror=e.strerror)
        ) from None
    resp = make_client(args).workloads(
        lambda s: s.SetSchedulerConfig, workload_pb2.SchedulerConfigText(yaml=text)
    )
    if args.output == "json":
        import yaml

        print_json(yaml.safe_load(resp.yaml))
    else:
        print(_("scheduler config applied"))
    return 0
