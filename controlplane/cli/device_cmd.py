"""`kunlun-cli device list|describe` and `kunlun-cli node list`."""

from __future__ import annotations

import argparse
from typing import Any

from controlplane.cli.output import print_json, print_table
from controlplane.cli.views import DEVICE_HEADERS, device_json, device_row, node_json
from kunlun_common.api import cluster_pb2
from kunlun_common.states import DeviceState


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    dev = sub.add_parser("device", help="accelerators in the Device Resource Graph", parents=[common])
    dsub = dev.add_subparsers(dest="cmd", required=True)
    ls = dsub.add_parser(
        "list", help="every device with status, memory, utilization, temperature", parents=[common]
    )
    ls.add_argument("--node", help="only this node's devices")
    ls.set_defaults(handler=device_list)
    de = dsub.add_parser("describe", help="one device in full (NODE/TYPE:INDEX)", parents=[common])
    de.add_argument("name", help="device name, e.g. node-a/ascend:0")
    de.set_defaults(handler=device_describe)
    node = sub.add_parser("node", help="nodes (machines running an agent)", parents=[common])
    nsub = node.add_subparsers(dest="cmd", required=True)
    nl = nsub.add_parser("list", help="every node with readiness and agent", parents=[common])
    nl.set_defaults(handler=node_list)
    nd = nsub.add_parser("describe", help="one node: agent, devices, sandbox protections", parents=[common])
    nd.add_argument("node")
    nd.set_defaults(handler=node_describe)
    from controlplane.cli.workload_cmd import register_node_ops

    register_node_ops(nsub, common)


def device_list(args: argparse.Namespace) -> int:
    from controlplane.cli.main import make_client

    client = make_client(args)
    resp = client.call(lambda s: s.ListDevices, cluster_pb2.ListDevicesRequest(node=args.node or ""))
    if args.output == "json":
        print_json({"items": [device_json(d) for d in resp.devices]})
    else:
        print_table(DEVICE_HEADERS, [device_row(d) for d in resp.devices])
    return 0


def device_describe(args: argparse.Namespace) -> int:
    from controlplane.cli.main import make_client

    client = make_client(args)
    resp = client.call(lambda s: s.DescribeDevice, cluster_pb2.DescribeDeviceRequest(name=args.name))
    d = device_json(resp.device)
    d["node_ready"] = resp.node.ready
    d["node_address"] = resp.node.address
    if args.output == "json":
        print_json(d)
        return 0
    width = max(len(k) for k in d)
    for k, v in d.items():
        if isinstance(v, list):
            v = ", ".join(str(x) for x in v) or "-"
        print(f"{k.replace('_', ' ').capitalize():<{width}}  {v}")
    state = DeviceState.of(resp.device.status)
    if state is not DeviceState.READY:
        print(f"\n{state}: {resp.device.status_reason}")
    return 0


def node_list(args: argparse.Namespace) -> int:
    from controlplane.cli.main import make_client

    client = make_client(args)
    resp = client.call(lambda s: s.ListNodes, cluster_pb2.ListNodesRequest())
    items = [node_json(n) for n in resp.nodes]
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
    from controlplane.cli.main import make_client

    client = make_client(args)
    resp = client.call(lambda s: s.ListNodes, cluster_pb2.ListNodesRequest())
    node = next((n for n in resp.nodes if n.name == args.node), None)
    if node is None:
        from controlplane.cli.client import CliError

        raise CliError(f"node {args.node!r} is not registered; see `kunlun-cli node list`")
    d = node_json(node)
    d["protections"] = list(node.protections)
    d["note"] = node.note
    d["device_names"] = [x.name for x in node.devices]
    if args.output == "json":
        print_json(d)
        return 0
    for k, v in d.items():
        if isinstance(v, list):
            v = ", ".join(str(x) for x in v) or "-"
        print(f"{k.replace('_', ' ').capitalize():<22} {v}")
    return 0
