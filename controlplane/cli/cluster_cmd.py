"""`kunlun-cli cluster status`: replicas (with health probed directly) and etcd members."""

from __future__ import annotations

import argparse
import datetime as dt
import time
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from controlplane.cli.client import Client
from controlplane.cli.output import print_json, print_table
from controlplane.cli.views import member_json, replica_json
from kunlun_common.api import cluster_pb2, security_pb2, security_pb2_grpc
from kunlun_common.i18n import _

EXPIRY_WARNING_DAYS = 30
"""`cluster status` warns about any certificate in use that expires within this many days."""


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    cl = sub.add_parser("cluster", help="the control plane itself", parents=[common])
    csub = cl.add_subparsers(dest="cmd", required=True)
    st = csub.add_parser("status", help="replicas, leader and etcd member health", parents=[common])
    st.set_defaults(handler=cluster_status)
    from controlplane.cli import backup_cmd, etcd_cmd, replica_cmd

    backup_cmd.register(csub, common)
    etcd_cmd.register(csub, common)
    replica_cmd.register(csub, common)


def probe_health(client: Client, address: str) -> bool:
    try:
        with client.channel(address) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2.0)
            return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)
    except grpc.RpcError:
        return False


def probe_gateway(address: str) -> bool:
    """GET /health on a gateway (plain HTTP or HTTPS without verification: only liveness matters)."""
    import ssl
    import urllib.request

    for scheme in ("http", "https"):
        try:
            ctx = ssl._create_unverified_context() if scheme == "https" else None
            with urllib.request.urlopen(f"{scheme}://{address}/health", timeout=2, context=ctx) as r:
                return bool(r.status == 200)
        except OSError:
            continue
    return False


def certificate_warnings(
    certs: list[security_pb2.CertificateInfo], now_s: float | None = None, days: int = EXPIRY_WARNING_DAYS
) -> list[str]:
    """One line per certificate in use that expires within `days` (or has expired)."""
    now = time.time() if now_s is None else now_s
    out = []
    for c in sorted(certs, key=lambda c: (c.not_after_unix_ms, c.role, c.name)):
        left = c.not_after_unix_ms / 1000 - now
        if left > days * 86400:
            continue
        when = dt.datetime.fromtimestamp(c.not_after_unix_ms / 1000, dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
        if left > 0:
            text = _(
                "certificate {role}:{name} (serial {serial}) expires in {days:.0f} days ({when}); renew it "
                "with `kunlun-cli certs rotate DIR --name {name}` and reload the component (SIGHUP)"
            )
        else:
            text = _(
                "certificate {role}:{name} (serial {serial}) EXPIRED on {when}; renew it "
                "with `kunlun-cli certs rotate DIR --name {name}` and reload the component (SIGHUP)"
            )
        out.append(text.format(role=c.role, name=c.name, serial=c.serial, days=left / 86400, when=when))
    return out


def certificate_json(c: security_pb2.CertificateInfo) -> dict[str, Any]:
    return {
        "role": c.role,
        "name": c.name,
        "serial": c.serial,
        "not_after_unix_ms": c.not_after_unix_ms,
        "seen_at_unix_ms": c.seen_at_unix_ms,
        "source": c.source,
    }


def cluster_status(args: argparse.Namespace) -> int:
    from controlplane.cli.main import make_client

    client = make_client(args)
    resp = client.call(lambda s: s.ClusterStatus, cluster_pb2.ClusterStatusRequest())
    replicas = [replica_json(r, probe_health(client, r.address)) for r in resp.replicas]
    members = [member_json(m) for m in resp.etcd_members]
    from controlplane.cli.gateway_cmd import live_gateways

    gateways = live_gateways(client)
    for g in gateways:
        g["healthy"] = probe_gateway(str(g.get("address", "")))
    certs = list(
        client.call_stub(
            security_pb2_grpc.SecurityServiceStub,
            lambda s: s.ListCertificates,
            security_pb2.ListCertificatesRequest(),
        ).certificates
    )
    warnings = certificate_warnings(certs)
    if args.output == "json":
        print_json(
            {
                "leader": resp.leader,
                "leader_epoch": resp.leader_epoch,
                "answered_by": resp.answered_by,
                "replicas": replicas,
                "etcd_members": members,
                "gateways": gateways,
                "certificates": [certificate_json(c) for c in certs],
                "warnings": warnings,
            }
        )
        return 0
    print_table(
        ["REPLICA", "ADDRESS", "PID", "HEALTHY", "LEADER"],
        [
            [r["name"], r["address"], r["pid"], "yes" if r["healthy"] else "NO", "*" if r["leader"] else ""]
            for r in replicas
        ],
    )
    print()
    print_table(
        ["ETCD MEMBER", "ENDPOINT", "HEALTHY", "LEADER", "DB SIZE", "ERROR"],
        [
            [
                m["name"] or "?",
                m["endpoint"],
                "yes" if m["healthy"] else "NO",
                "*" if m["leader"] else "",
                f"{m['db_size_bytes'] // 1024} KiB",
                m["error"],
            ]
            for m in members
        ],
    )
    if gateways:
        print()
        print_table(
            ["GATEWAY", "ADDRESS", "PID", "HEALTHY", "REPLICA"],
            [
                [
                    g.get("name", ""),
                    g.get("address", ""),
                    g.get("pid", ""),
                    "yes" if g["healthy"] else "NO",
                    g.get("replica", ""),
                ]
                for g in gateways
            ],
        )
    if warnings:
        print()
        for w in warnings:
            print(_("WARNING: {w}").format(w=w))
    return 0
