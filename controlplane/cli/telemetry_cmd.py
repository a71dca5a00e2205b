"""`kunlun-cli telemetry metrics [--filter EXPR] [--watch]`, `telemetry top`, `telemetry targets`."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from controlplane.cli.client import Client, CliError
from controlplane.cli.output import print_json, print_table
from kunlun_common.api import telemetry_pb2, telemetry_pb2_grpc
from kunlun_common.i18n import _

GIB = 1024**3
FILTER_HELP = (
    "comma-separated conditions, all must hold: device_type==cambricon, node=~node-a|node-b, "
    "utilization>0.8, temperature>=70, status!=Ready (fields: node device device_type vendor model "
    "status health workload instance utilization temperature power memory_used_bytes "
    "memory_total_bytes memory_used_ratio)"
)


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    t = sub.add_parser("telemetry", help="device metrics, a live top, Prometheus targets", parents=[common])
    ts = t.add_subparsers(dest="cmd", required=True)
    m = ts.add_parser(
        "metrics", help="every device's latest sample (from the agents' heartbeats)", parents=[common]
    )
    m.add_argument("--filter", default="", help=FILTER_HELP)
    m.add_argument("--watch", action="store_true", help="print again every --interval seconds")
    m.add_argument("--interval", type=float, default=2.0, help="seconds between --watch refreshes")
    m.add_argument("--count", type=int, default=0, help="with --watch: stop after N refreshes (0: never)")
    m.set_defaults(handler=metrics)
    top = ts.add_parser("top", help="live per-device view, busiest first (Ctrl-C stops)", parents=[common])
    top.add_argument("--filter", default="", help=FILTER_HELP)
    top.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    top.add_argument("--count", type=int, default=0, help="stop after N refreshes (0: never)")
    top.set_defaults(handler=top_cmd)
    tg = ts.add_parser(
        "targets",
        help="Prometheus file-based service discovery JSON of every exporter (replicas, agents, gateways)",
        parents=[common],
    )
    tg.add_argument("--write", metavar="FILE", help="write the JSON to FILE atomically instead of stdout")
    tg.set_defaults(handler=targets)


def _fetch(args: argparse.Namespace, flt: str) -> telemetry_pb2.DeviceMetricsResponse:
    from controlplane.cli.main import make_client

    return fetch_metrics(make_client(args), flt)


def fetch_metrics(client: Client, flt: str) -> telemetry_pb2.DeviceMetricsResponse:
    """Every device's row matching `flt`, page by page, as one answer (`total`: all devices)."""
    out = telemetry_pb2.DeviceMetricsResponse()
    for resp in client.responses(
        telemetry_pb2_grpc.TelemetryServiceStub,
        lambda s: s.DeviceMetrics,
        telemetry_pb2.DeviceMetricsRequest(filter=flt),
        "devices",
    ):
        out.devices.extend(resp.devices)
        out.total += resp.total
        out.answered_by = resp.answered_by
        out.revision = resp.revision
    return out


def metric_json(d: telemetry_pb2.DeviceMetric) -> dict[str, Any]:
    return {
        "node": d.node,
        "device": d.device,
        "device_type": d.device_type,
        "vendor": d.vendor,
        "model": d.model,
        "status": d.status,
        "health": d.health,
        "utilization": round(d.utilization, 4),
        "memory_used_bytes": d.memory_used_bytes,
        "memory_total_bytes": d.memory_total_bytes,
        "temperature_c": round(d.temperature_c, 1),
        "power_w": round(d.power_w, 1),
        "sampled_at_unix_ms": d.sampled_at_unix_ms,
        "instance": d.instance,
        "workload": d.workload,
    }


def _age(ms: int) -> str:
    if not ms:
        return "-"
    return f"{max(0.0, time.time() - ms / 1000):.0f}s"


def _table(devices: list[telemetry_pb2.DeviceMetric]) -> None:
    print_table(
        ["NODE", "DEVICE", "TYPE", "STATUS", "UTIL", "MEMORY", "TEMP", "POWER", "WORKLOAD", "AGE"],
        [
            [
                d.node,
                d.device,
                d.device_type,
                d.status,
                f"{d.utilization * 100:.0f}%",
                f"{d.memory_used_bytes / GIB:.1f}/{d.memory_total_bytes / GIB:.1f} GiB",
                f"{d.temperature_c:.0f}C",
                f"{d.power_w:.0f}W",
                d.workload or "-",
                _age(d.sampled_at_unix_ms),
            ]
            for d in devices
        ],
    )


def _show(args: argparse.Namespace, resp: telemetry_pb2.DeviceMetricsResponse) -> None:
    if args.output == "json":
        print_json(
            {
                "items": [metric_json(d) for d in resp.devices],
                "total": resp.total,
                "answered_by": resp.answered_by,
            }
        )
    else:
        _table(list(resp.devices))
        print(
            _("{count} of {total} devices").format(count=len(resp.devices), total=resp.total), file=sys.stderr
        )


def _loop(args: argparse.Namespace, draw: Any) -> int:
    if args.interval <= 0:
        raise CliError(
            _("--interval: expected a positive number of seconds, found {interval}").format(
                interval=args.interval
            )
        )
    n = 0
    try:
        while True:
            draw()
            sys.stdout.flush()
            n += 1
            if args.count and n >= args.count:
                return 0
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0


def metrics(args: argparse.Namespace) -> int:
    if not args.watch:
        _show(args, _fetch(args, args.filter))
        return 0

    def draw() -> None:
        resp = _fetch(args, args.filter)
        if args.output == "json":
            sys.stdout.write(json.dumps({"items": [metric_json(d) for d in resp.devices]}) + "\n")
        else:
            print(
                _("-- {strftime}  {count} of {total} devices").format(
                    strftime=time.strftime("%H:%M:%S"), count=len(resp.devices), total=resp.total
                )
            )
            _table(list(resp.devices))

    return _loop(args, draw)


def top_cmd(args: argparse.Namespace) -> int:
    tty = sys.stdout.isatty()

    def draw() -> None:
        resp = _fetch(args, args.filter)
        devices = sorted(resp.devices, key=lambda d: (-d.utilization, d.device))
        if tty:
            sys.stdout.write("\x1b[H\x1b[2J")  # home + clear
        print(
            _("kunlun top  {strftime}  devices {count}/{total}  (from {answered_by}; Ctrl-C stops)").format(
                strftime=time.strftime("%H:%M:%S"),
                count=len(devices),
                total=resp.total,
                answered_by=resp.answered_by,
            )
        )
        _table(devices)

    return _loop(args, draw)


def targets_json(resp: telemetry_pb2.TargetsResponse) -> list[dict[str, Any]]:
    """file_sd groups: one per target, labels `job` and `kunlun_name`."""
    return [{"targets": [t.address], "labels": {"job": t.job, "kunlun_name": t.name}} for t in resp.targets]


def targets(args: argparse.Namespace) -> int:
    from controlplane.cli.main import make_client

    resp = make_client(args).call_stub(
        telemetry_pb2_grpc.TelemetryServiceStub, lambda s: s.Targets, telemetry_pb2.TargetsRequest()
    )
    text = json.dumps(targets_json(resp), indent=2) + "\n"
    if args.write:
        import os
        import tempfile
        from pathlib import Path

        dest = Path(args.write)
        fd, tmp = tempfile.mkstemp(dir=dest.parent or ".", prefix=".targets-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, dest)  # Prometheus never reads a half-written file
        print(
            _("{count} targets written to {dest}").format(count=len(resp.targets), dest=dest), file=sys.stderr
        )
    else:
        sys.stdout.write(text)
    return 0
