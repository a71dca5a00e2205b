"""`kunlun-cli node list|describe|cordon|uncordon|drain`."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from controlplane.cli.client import CliError
from controlplane.cli.output import print_json, print_table
from controlplane.cli.views import describe_lines, node_json, shown_reason
from kunlun_common.api import cluster_pb2, cluster_pb2_grpc, workload_pb2
from kunlun_common.i18n import _
from kunlun_common.states import InstancePhase


def make_client(args: argparse.Namespace) -> Any:
    from controlplane.cli.main import make_client as make

    return make(args)


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    node = sub.add_parser("node", help="nodes (machines running an agent)", parents=[common])
    nsub = node.add_subparsers(dest="cmd", required=True)
    nl = nsub.add_parser("list", help="every node with readiness and agent", parents=[common])
    nl.set_defaults(handler=node_list)
    nd = nsub.add_parser("describe", help="one node: agent, devices, sandbox protections", parents=[common])
    nd.add_argument("node")
    nd.set_defaults(handler=node_describe)
    for cmd, helptext in (
        ("cordon", "no new instances on this node"),
        ("uncordon", "allow new instances again"),
        ("drain", "cordon and move its instances elsewhere (reports those that cannot move)"),
    ):
        p = nsub.add_parser(cmd, help=helptext, parents=[common])
        p.add_argument("node")
        if cmd == "drain":
            p.add_argument(
                "--wait",
                dest="drain_timeout",
                type=float,
                default=60.0,
                help="seconds to wait for the moves",
            )
        p.set_defaults(handler=node_op, op=cmd)


def node_list(args: argparse.Namespace) -> int:
    client = make_client(args)
    items = [
        node_json(n)
        for n in client.cluster_pages(lambda s: s.ListNodes, cluster_pb2.ListNodesRequest(), "nodes")
    ]
    if args.output == "json":
        print_json({"items": items})
    else:
        print_table(
            ["NAME", "STATUS", "ADDRESS", "DEVICES", "AGENT PID", "REPLICA", "SIMULATED"],
            [
                [
                    n["name"],
                    n["status"],
                    n["address"],
                    n["devices"],
                    n["pid"],
                    n["connected_replica"] or "-",
                    n["simulated"],
                ]
                for n in items
            ],
        )
    return 0


def node_describe(args: argparse.Namespace) -> int:
    client = make_client(args)
    listed = client.iter_pages(
        cluster_pb2_grpc.ClusterServiceStub, lambda s: s.ListNodes, cluster_pb2.ListNodesRequest(), "nodes"
    )
    node = next((n for n in listed if n.name == args.node), None)
    if node is None:
        raise CliError(
            _("node {node!r} is not registered; see `kunlun-cli node list`").format(node=args.node)
        )
    d = node_json(node)
    d["protections"] = list(node.protections)
    d["note"] = node.note
    d["device_names"] = [x.name for x in node.devices]
    if args.output == "json":
        print_json(d)
        return 0
    for line in describe_lines(d, width=22):
        print(line)
    return 0


def node_op(args: argparse.Namespace) -> int:
    client = make_client(args)
    req = workload_pb2.CordonNodeRequest(
        node=args.node, cordon=args.op != "uncordon", drain=args.op == "drain"
    )
    resp = client.workloads(lambda s: s.CordonNode, req)
    stuck: list[dict[str, Any]] = []
    shown: list[str] = []
    if args.op == "drain":
        end = time.monotonic() + args.drain_timeout
        while True:
            summaries = client.all_workloads()
            left = [
                (s.workload.spec.name, i)
                for s in summaries
                for i in s.instances
                if i.node == args.node and i.phase != InstancePhase.PENDING
            ]
            stuck = [{"workload": n, "instance": i.id, "reason": i.reason} for n, i in left]
            shown = [shown_reason(i) for _n, i in left]
            blocked = bool(left) and all(i.reason.startswith("DrainBlocked") for _, i in left)
            if not left or blocked or time.monotonic() > end:
                break
            time.sleep(0.5)
    if args.output == "json":
        print_json(
            {"node": resp.node, "cordoned": resp.cordoned, "draining": resp.draining, "cannot_move": stuck}
        )
    else:
        print(
            (
                (_("node {node} cordoned, drained") if resp.draining else _("node {node} cordoned"))
                if resp.cordoned
                else (_("node {node} uncordoned, drained") if resp.draining else _("node {node} uncordoned"))
            ).format(node=resp.node)
        )
        for s, why in zip(stuck, shown, strict=True):
            print(
                _("  cannot move {instance} ({workload}): {reason}").format(
                    instance=s["instance"], workload=s["workload"], reason=why
                ),
                file=sys.stdout,
            )
    return 0
