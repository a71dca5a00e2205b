"""`kunlun-cli device list|describe`."""

from __future__ import annotations

import argparse
from typing import Any

from controlplane.cli.output import print_json, print_table
from controlplane.cli.views import (
    DEVICE_HEADERS,
    describe_lines,
    device_json,
    device_row,
    shown_status_reason,
)
from kunlun_common.api import cluster_pb2
from kunlun_common.i18n import _
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


def device_list(args: argparse.Namespace) -> int:
    from controlplane.cli.main import make_client

    client = make_client(args)
    devices = client.cluster_pages(
        lambda s: s.ListDevices, cluster_pb2.ListDevicesRequest(node=args.node or ""), "devices"
    )
    if args.output == "json":
        print_json({"items": [device_json(d) for d in devices]})
    else:
        print_table(DEVICE_HEADERS, [device_row(d) for d in devices])
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
    reason = shown_status_reason(resp.device)  # in the reader's language (JSON above: as stored)
    d["status_reason"] = reason
    for line in describe_lines(d):
        print(line)
    state = DeviceState.of(resp.device.status)
    if state is not DeviceState.READY:
        print("\n" + _("{state}: {reason}").format(state=state, reason=reason))
    return 0
