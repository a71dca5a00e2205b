"""`kunlun-cli audit [--since DURATION|TIME] [--identity X] [--object Y] [--limit N]`."""

from __future__ import annotations

import argparse
import datetime as dt
import re
import time
from typing import Any

from controlplane.cli.client import CliError
from controlplane.cli.output import print_json, print_table
from kunlun_common.api import security_pb2, security_pb2_grpc
from kunlun_common.i18n import _

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    a = sub.add_parser(
        "audit", help="who changed what: the audit log of operator calls (oldest first)", parents=[common]
    )
    a.add_argument("--since", help="only entries newer than a duration (30m, 2h, 7d) or a time (ISO 8601)")
    a.add_argument("--identity", help="only this caller: role:name, or a name")
    a.add_argument("--object", help="only calls about this object (workload, node, key id, serial...)")
    a.add_argument("--limit", type=int, default=1000, help="at most the newest N entries (default 1000)")
    a.set_defaults(handler=audit_list)


def since_ms(text: str, now: float | None = None) -> int:
    """`--since`: a duration back from now (90s, 30m, 2h, 7d) or an ISO 8601 time (UTC if no zone)."""
    t = text.strip()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd])", t)
    if m:
        return int(((now if now is not None else time.time()) - float(m[1]) * _UNITS[m[2]]) * 1000)
    try:
        when = dt.datetime.fromisoformat(t.replace("Z", "+00:00"))
    except ValueError:
        raise CliError(
            _(
                "--since {text!r}: expected a duration such as 30m, 2h or 7d, or a time such as 2026-12-01T04:00:00Z"
            ).format(text=text)
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return int(when.timestamp() * 1000)


def entry_json(e: security_pb2.AuditEntry) -> dict[str, Any]:
    return {
        "at_unix_ms": e.at_unix_ms,
        "at": dt.datetime.fromtimestamp(e.at_unix_ms / 1000, dt.UTC).isoformat(timespec="milliseconds"),
        "identity": e.identity,
        "action": e.action,
        "object": e.object,
        "result": e.result,
        "replica": e.replica,
        "serial": e.serial,
    }


def audit_list(args: argparse.Namespace) -> int:
    from controlplane.cli.main import make_client

    req = security_pb2.ListAuditRequest(
        since_unix_ms=since_ms(args.since) if args.since else 0,
        identity=args.identity or "",
        object=args.object or "",
        limit=args.limit,
    )
    client = make_client(args)
    resp = client.call_stub(security_pb2_grpc.SecurityServiceStub, lambda s: s.ListAudit, req)
    items = [entry_json(e) for e in resp.entries]
    if args.output == "json":
        print_json({"items": items})
        return 0
    print_table(
        ["TIME (UTC)", "IDENTITY", "ACTION", "OBJECT", "RESULT", "REPLICA"],
        [[i["at"][:23], i["identity"], i["action"], i["object"], i["result"], i["replica"]] for i in items],
    )
    return 0
