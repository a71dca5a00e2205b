"""`kunlun-cli node engines NODE`: the node's engine ledger (every engine start and stop)."""

from __future__ import annotations

import argparse
import time
from typing import Any

from controlplane.cli.client import CliError
from controlplane.cli.output import print_json, print_table
from kunlun_common.api import agent_pb2, agent_pb2_grpc
from kunlun_common.i18n import _

HEADERS = ("TIME", "EVENT", "INSTANCE", "PID", "DEVICES", "CAUSE")


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add `engines` under the `node` group (created by device_cmd)."""
    node = sub.choices["node"]
    nsub = next(a for a in node._actions if isinstance(a, argparse._SubParsersAction))
    p = nsub.add_parser(
        "engines",
        help="the node's engine ledger: every engine start and stop (instance, devices, pid, cause)",
        parents=[common],
    )
    p.add_argument("node")
    p.add_argument("--tail", type=int, default=0, help="only the last N events (default: all kept)")
    p.set_defaults(handler=node_engines)


def event_json(e: agent_pb2.EngineEvent) -> dict[str, Any]:
    """One ledger entry with the ledger file's own keys."""
    return {
        "event": e.event,
        "node": e.node,
        "instance": e.instance,
        "devices": list(e.devices),
        "pid": e.pid,
        "wall_ms": e.wall_ms,
        "mono_ns": e.mono_ns,
        "boot_id": e.boot_id,
        "cause": e.cause,
    }


def node_engines(args: argparse.Namespace) -> int:
    from controlplane.cli.main import make_client

    if args.tail < 0:
        raise CliError(_("--tail: expected a number >= 0, found {tail}").format(tail=str(args.tail)))
    client = make_client(args)
    resp = client.call_stub(
        agent_pb2_grpc.LedgerServiceStub,
        lambda s: s.NodeEngines,
        agent_pb2.EnginesRequest(node=args.node, tail=args.tail),
    )
    if args.output == "json":
        print_json({"items": [event_json(e) for e in resp.items]})
        return 0
    rows = [
        (
            time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(e.wall_ms / 1000)) + f".{e.wall_ms % 1000:03d}Z",
            e.event,
            e.instance,
            str(e.pid),
            ",".join(e.devices),
            e.cause,
        )
        for e in resp.items
    ]
    print_table(HEADERS, rows)
    return 0
