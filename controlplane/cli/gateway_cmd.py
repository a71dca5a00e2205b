"""`kunlun-cli gateway keys create|list|revoke`, `gateway policy set|list`, `gateway list`."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

from controlplane.cli.client import Client, CliError
from controlplane.cli.output import print_json, print_table
from kunlun_common.api import gateway_pb2, gateway_pb2_grpc
from kunlun_common.i18n import _
from kunlun_common.traffic import ROUTING_POLICIES as POLICIES

T = TypeVar("T")


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    g = sub.add_parser("gateway", help="inference gateways: API keys, routing policies", parents=[common])
    gs = g.add_subparsers(dest="cmd", required=True)
    k = gs.add_parser("keys", help="client API keys (Authorization: Bearer)", parents=[common])
    ks = k.add_subparsers(dest="sub", required=True)
    c = ks.add_parser("create", help="create a key; its secret is printed once", parents=[common])
    c.add_argument("name", help="what the key is for, e.g. team-search")
    c.set_defaults(handler=keys_create)
    ls = ks.add_parser("list", help="ID NAME PREFIX CREATED BY", parents=[common])
    ls.add_argument("--all", action="store_true", help="also revoked keys")
    ls.set_defaults(handler=keys_list)
    r = ks.add_parser("revoke", help="revoke a key (gateways refuse it within a second)", parents=[common])
    r.add_argument("id", help="key id (or its name when unique)")
    r.set_defaults(handler=keys_revoke)
    p = gs.add_parser("policy", help="routing policy per workload", parents=[common])
    ps = p.add_subparsers(dest="sub", required=True)
    st = ps.add_parser("set", help="set a workload's routing policy", parents=[common])
    st.add_argument("workload")
    st.add_argument("policy", choices=[*POLICIES, "default"])
    st.add_argument("--balance-factor", type=float, default=0.0, help="prefix_affinity load bound (>= 1)")
    st.add_argument("--prefix-chars", type=int, default=0, help="prefix_affinity: prompt characters hashed")
    st.set_defaults(handler=policy_set)
    pl = ps.add_parser("list", help="workloads with a policy of their own", parents=[common])
    pl.set_defaults(handler=policy_list)
    gl = gs.add_parser("list", help="live gateways: NAME ADDRESS PID REPLICA AGE", parents=[common])
    gl.set_defaults(handler=gateways_list)


def _call(args: argparse.Namespace, fn: Callable[[Any], Callable[..., T]], request: Any) -> T:
    from controlplane.cli.main import make_client

    return make_client(args).call_stub(gateway_pb2_grpc.GatewayServiceStub, fn, request)


def _pages(
    args: argparse.Namespace, fn: Callable[[Any], Callable[..., Any]], request: Any, field: str
) -> list[Any]:
    """Every item of a paged GatewayService List call."""
    from controlplane.cli.main import make_client

    return make_client(args).pages(gateway_pb2_grpc.GatewayServiceStub, fn, request, field)


def _age(ms: int) -> str:
    if not ms:
        return ""
    s = max(0, int(time.time() - ms / 1000))
    return f"{s}s" if s < 120 else f"{s // 60}m" if s < 7200 else f"{s // 3600}h"


def key_json(k: gateway_pb2.ApiKey) -> dict[str, Any]:
    return {
        "id": k.id,
        "name": k.name,
        "prefix": k.prefix,
        "created_by": k.created_by,
        "created_at_unix_ms": k.created_at_unix_ms,
        "revoked": bool(k.revoked_at_unix_ms),
        "revoked_by": k.revoked_by,
        "revoked_at_unix_ms": k.revoked_at_unix_ms,
    }


def keys_create(args: argparse.Namespace) -> int:
    resp = _call(args, lambda s: s.CreateApiKey, gateway_pb2.CreateApiKeyRequest(name=args.name))
    if args.output == "json":
        print_json({**key_json(resp.key), "secret": resp.secret})
        return 0
    print_table(["ID", "NAME", "KEY"], [[resp.key.id, resp.key.name, resp.secret]])
    print(
        _("\nstore the key now: it is not shown again (clients send `Authorization: Bearer <key>`)"),
        file=sys.stderr,
    )
    return 0


def keys_list(args: argparse.Namespace) -> int:
    found = _pages(
        args, lambda s: s.ListApiKeys, gateway_pb2.ListApiKeysRequest(include_revoked=args.all), "keys"
    )
    found.sort(key=lambda k: (k.created_at_unix_ms, k.id))
    items = [key_json(k) for k in found]
    if args.output == "json":
        print_json({"items": items})
        return 0
    print_table(
        ["ID", "NAME", "PREFIX", "CREATED", "BY", "REVOKED"],
        [
            [
                k["id"],
                k["name"],
                k["prefix"] + "...",
                _age(k["created_at_unix_ms"]),
                k["created_by"],
                _("{age} ago by {who}").format(age=_age(k["revoked_at_unix_ms"]), who=k["revoked_by"])
                if k["revoked"]
                else "",
            ]
            for k in items
        ],
    )
    return 0


def keys_revoke(args: argparse.Namespace) -> int:
    resp = _call(args, lambda s: s.RevokeApiKey, gateway_pb2.RevokeApiKeyRequest(id=args.id))
    if args.output == "json":
        print_json(key_json(resp.key))
        return 0
    print(_("API key {id} ({name}) revoked").format(id=resp.key.id, name=resp.key.name))
    return 0


def policy_json(p: gateway_pb2.RoutingPolicy) -> dict[str, Any]:
    return {
        "workload": p.workload,
        "policy": p.policy,
        "balance_factor": p.balance_factor,
        "prefix_chars": p.prefix_chars,
        "updated_by": p.updated_by,
        "updated_at_unix_ms": p.updated_at_unix_ms,
    }


def policy_set(args: argparse.Namespace) -> int:
    req = gateway_pb2.SetRoutingPolicyRequest(
        policy=gateway_pb2.RoutingPolicy(
            workload=args.workload,
            policy=args.policy,
            balance_factor=args.balance_factor,
            prefix_chars=args.prefix_chars,
        )
    )
    resp = _call(args, lambda s: s.SetRoutingPolicy, req)
    if args.output == "json":
        print_json(policy_json(resp))
        return 0
    print(
        _("workload {workload}: routing policy {policy}").format(workload=resp.workload, policy=resp.policy)
    )
    return 0


def policy_list(args: argparse.Namespace) -> int:
    items = [
        policy_json(p)
        for p in _pages(
            args, lambda s: s.ListRoutingPolicies, gateway_pb2.ListRoutingPoliciesRequest(), "policies"
        )
    ]
    if args.output == "json":
        print_json({"items": items})
        return 0
    print_table(
        ["WORKLOAD", "POLICY", "BALANCE FACTOR", "PREFIX CHARS", "BY", "AGE"],
        [
            [
                p["workload"],
                p["policy"],
                p["balance_factor"] or "default",
                p["prefix_chars"] or "default",
                p["updated_by"],
                _age(p["updated_at_unix_ms"]),
            ]
            for p in items
        ],
    )
    return 0


def gateway_json(g: gateway_pb2.GatewayInfo) -> dict[str, Any]:
    return {
        "name": g.name,
        "address": g.address,
        "pid": g.pid,
        "replica": g.replica,
        "version": g.version,
        "started_at_unix_ms": g.started_at_unix_ms,
    }


def live_gateways(client: Client) -> list[dict[str, Any]]:
    """Gateways with a live registration, for `cluster status` ([] if the replicas predate them)."""
    try:
        found = client.pages(
            gateway_pb2_grpc.GatewayServiceStub,
            lambda s: s.ListGateways,
            gateway_pb2.ListGatewaysRequest(),
            "gateways",
        )
    except CliError as e:
        if "unimplemented" in str(e):
            return []
        raise
    return [gateway_json(g) for g in found]


def gateways_list(args: argparse.Namespace) -> int:
    items = [
        gateway_json(g)
        for g in _pages(args, lambda s: s.ListGateways, gateway_pb2.ListGatewaysRequest(), "gateways")
    ]
    if args.output == "json":
        print_json({"items": items})
        return 0
    print_table(
        ["NAME", "ADDRESS", "PID", "REPLICA", "VERSION", "AGE"],
        [
            [g["name"], g["address"], g["pid"], g["replica"], g["version"], _age(g["started_at_unix_ms"])]
            for g in items
        ],
    )
    return 0
