"""`kunlun-cli cluster replica drain NAME`: drain one control-plane replica and let its service
manager restart it (systemd `Restart=always`; `make demo`'s supervisor, devcluster/supervise.py).

The drain goes to the named replica's own registered address (a replica drains only itself): it
stops campaigning, hands leadership over, ends its agent and gateway streams (they reconnect to
another replica), answers, and exits 0. With `--wait` the command then waits, bounded, until a new
process of that replica serves (another pid, health SERVING)."""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from controlplane.cli.client import Client, CliError
from controlplane.cli.output import print_json
from kunlun_common.api import cluster_pb2
from kunlun_common.i18n import _

DRAIN_CALL_TIMEOUT_S = 40.0
"""The drain answers after the handover (at most two leader lease TTLs) and the streams closing."""


def register(csub: Any, common: argparse.ArgumentParser) -> None:
    rp = csub.add_parser("replica", help="one control-plane replica", parents=[common])
    rsub = rp.add_subparsers(dest="replica_cmd", required=True)
    d = rsub.add_parser(
        "drain",
        help="hand over leadership, move agents and gateways to other replicas, exit (to be restarted)",
        parents=[common],
        description="The replica stops campaigning, hands leadership to another replica, tells its "
        "agents and gateways to reconnect elsewhere, then exits 0; its service manager starts it again.",
    )
    d.add_argument("name", help="the replica (see `kunlun-cli cluster status`)")
    d.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="then wait up to SECONDS until the replica serves again with a new process",
    )
    d.set_defaults(handler=drain_cmd)


def replicas(client: Client) -> dict[str, cluster_pb2.ReplicaInfo]:
    resp = client.call(lambda s: s.ClusterStatus, cluster_pb2.ClusterStatusRequest())
    return {r.name: r for r in resp.replicas}


def serving(client: Client, address: str) -> bool:
    try:
        with client.channel(address) as ch:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2.0)
            return bool(r.status == health_pb2.HealthCheckResponse.SERVING)
    except grpc.RpcError:
        return False


def drain(client: Client, name: str) -> tuple[cluster_pb2.ReplicaInfo, cluster_pb2.DrainReplicaResponse]:
    """Drain replica `name` through its own address: (its registration before, the answer)."""
    found = replicas(client)
    if name not in found:
        raise CliError(
            _(
                "replica {name} is not registered (registered: {names}); see `kunlun-cli cluster status`"
            ).format(name=name, names=", ".join(sorted(found)) or "-")
        )
    if len(found) < 2:
        raise CliError(
            _("replica {name} is the only one registered: draining it would stop the API").format(name=name)
        )
    before = found[name]
    direct = Client(replace(client.cfg, endpoints=(before.address,)), timeout_s=DRAIN_CALL_TIMEOUT_S)
    resp: cluster_pb2.DrainReplicaResponse = direct.call(
        lambda s: s.DrainReplica, cluster_pb2.DrainReplicaRequest(name=name)
    )
    return before, resp


def wait_restarted(client: Client, name: str, old_pid: int, timeout_s: float) -> cluster_pb2.ReplicaInfo:
    """Poll (bounded) until replica `name` is registered by another process than `old_pid` and its
    health answers SERVING; CliError when it does not within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            info = replicas(client).get(name)
        except CliError:
            info = None
        if info is not None and info.pid != old_pid and serving(client, info.address):
            return info
        if time.monotonic() > deadline:
            raise CliError(
                _(
                    "replica {name} did not serve again with a new process within {seconds:.0f} s; "
                    "check its service manager (systemctl status kunlun-platform) and its log"
                ).format(name=name, seconds=timeout_s)
            )
        time.sleep(0.5)


def drain_cmd(args: argparse.Namespace) -> int:
    from controlplane.cli.main import make_client

    if args.wait < 0 or args.wait > 3600:
        raise CliError(_("--wait: expected 0..3600 seconds, found {value}").format(value=args.wait))
    client = make_client(args)
    started = time.monotonic()
    before, resp = drain(client, args.name)
    after = wait_restarted(client, args.name, resp.pid or before.pid, args.wait) if args.wait else None
    if args.output == "json":
        print_json(
            {
                "name": resp.name,
                "pid": resp.pid,
                "was_leader": resp.was_leader,
                "leader": resp.leader,
                "handover_ms": resp.handover_ms,
                "streams_ended": resp.streams_ended,
                "restarted_pid": after.pid if after else None,
                "seconds": round(time.monotonic() - started, 2),
            }
        )
        return 0
    if resp.was_leader:
        print(
            _("replica {name} (pid {pid}) drained: leadership handed to {leader} in {ms} ms").format(
                name=resp.name, pid=resp.pid, leader=resp.leader or "?", ms=resp.handover_ms
            )
        )
    else:
        print(_("replica {name} (pid {pid}) drained (it did not lead)").format(name=resp.name, pid=resp.pid))
    print(
        _(
            "{count} agent and gateway streams told to reconnect to another replica; the process exits now"
        ).format(count=resp.streams_ended)
    )
    if after is not None:
        print(
            _("replica {name} serves again as pid {pid} after {seconds:.1f} s").format(
                name=args.name, pid=after.pid, seconds=time.monotonic() - started
            )
        )
    return 0
