"""`kunlun-cli cluster etcd member list|add|remove`: etcd membership, and `cluster etcd auth enable`:
etcd's own RBAC, both with the administrator's `kunlun-admin` etcd certificate (see
controlplane/store/members.py for why not through replicas)."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import grpc

from controlplane.cli.backup_cmd import add_etcd_args, admin_target
from controlplane.cli.client import CliError
from controlplane.cli.output import print_json, print_table
from controlplane.store.admin import CLUSTER_PREFIX, enable_auth_async
from controlplane.store.members import Member, add_member, list_members, remove_member
from kunlun_common.errors import InvalidInput
from kunlun_common.i18n import _
from kunlun_common.names import valid_node_name


def register(csub: Any, common: argparse.ArgumentParser) -> None:
    e = csub.add_parser("etcd", help="the etcd cluster under the control plane", parents=[common])
    esub = e.add_subparsers(dest="etcd_cmd", required=True)
    m = esub.add_parser("member", help="etcd members: list, add, remove", parents=[common])
    msub = m.add_subparsers(dest="member_cmd", required=True)
    ls = msub.add_parser("list", help="every member with its health", parents=[common])
    add_etcd_args(ls)
    ls.set_defaults(handler=member_list)
    a = msub.add_parser(
        "add", help="add a member (then start it with the printed settings)", parents=[common]
    )
    a.add_argument("name", help="the new member's name (its etcd certificate's CN, e.g. etcd-4)")
    a.add_argument("--peer-urls", required=True, help="the new member's peer URLs, comma-separated")
    add_etcd_args(a)
    a.set_defaults(handler=member_add)
    r = msub.add_parser("remove", help="remove a member by name or hex id", parents=[common])
    r.add_argument("member", help="name or hex id (see `member list`)")
    add_etcd_args(r)
    r.set_defaults(handler=member_remove)
    au = esub.add_parser("auth", help="etcd's own authentication (RBAC)", parents=[common])
    ausub = au.add_subparsers(dest="auth_cmd", required=True)
    en = ausub.add_parser(
        "enable",
        help="create the etcd users and roles (kunlun: read/write /kunlun/ only) and turn etcd "
        "authentication on; idempotent (once, after the members first form a cluster)",
        parents=[common],
    )
    add_etcd_args(en)
    en.set_defaults(handler=auth_enable)


def member_json(m: Member) -> dict[str, Any]:
    return {
        "id": m.id_hex,
        "name": m.name,
        "peer_urls": list(m.peer_urls),
        "client_urls": list(m.client_urls),
        "started": m.started,
        "learner": m.learner,
        "healthy": m.healthy,
        "leader": m.leader,
        "db_size_bytes": m.db_size_bytes,
        "error": m.error,
    }


def member_list(args: argparse.Namespace) -> int:
    cid, members = asyncio.run(list_members(admin_target(args, ask_replicas=True)))
    if args.output == "json":
        print_json({"cluster_id": cid, "items": [member_json(m) for m in members]})
        return 0
    print_table(
        ["ID", "NAME", "PEER URLS", "CLIENT URLS", "HEALTHY", "LEADER", "DB SIZE", "ERROR"],
        [
            [
                m.id_hex,
                m.name or "(not started)",
                ",".join(m.peer_urls),
                ",".join(m.client_urls),
                "yes" if m.healthy else "NO",
                "*" if m.leader else "",
                f"{m.db_size_bytes // 1024} KiB",
                m.error,
            ]
            for m in members
        ],
    )
    return 0


def initial_cluster(new: Member, members: list[Member]) -> str:
    """ETCD_INITIAL_CLUSTER for the new member: every member's name=peer URL (the new one's own)."""
    parts = []
    for m in members:
        name = new.name if m.id == new.id else m.name
        parts += [f"{name}={u}" for u in m.peer_urls if name]
    return ",".join(parts)


def member_add(args: argparse.Namespace) -> int:
    if not valid_node_name(args.name):
        raise InvalidInput(
            _("name: {name!r} is not a valid member name (lowercase letters, digits, '-')").format(
                name=args.name
            )
        )
    urls = tuple(u.strip() for u in args.peer_urls.split(",") if u.strip())
    new, members = asyncio.run(add_member(admin_target(args, ask_replicas=True), args.name, urls))
    settings = {
        "ETCD_NAME": new.name,
        "ETCD_INITIAL_CLUSTER": initial_cluster(new, members),
        "ETCD_INITIAL_CLUSTER_STATE": "existing",
    }
    if args.output == "json":
        print_json({"member": member_json(new), "settings": settings})
        return 0
    print(
        _("added etcd member {name} (id {id_hex}); start it with these settings in its etcd.env:").format(
            name=new.name, id_hex=new.id_hex
        )
    )
    for k, v in settings.items():
        print(f"{k}={v}")
    return 0


def member_remove(args: argparse.Namespace) -> int:
    gone, left = asyncio.run(remove_member(admin_target(args, ask_replicas=True), args.member))
    if args.output == "json":
        print_json({"removed": member_json(gone), "items": [member_json(m) for m in left]})
        return 0
    print(
        _("removed etcd member {value} (id {id_hex}); {count} members left: {items}").format(
            value=gone.name or _("(not started)"),
            id_hex=gone.id_hex,
            count=len(left),
            items=", ".join(m.name or m.id_hex for m in left),
        )
    )
    return 0


def auth_enable(args: argparse.Namespace) -> int:
    """Through the first member that answers (etcd replicates the users, roles and the switch)."""
    target = admin_target(args, ask_replicas=False)
    last: Exception | None = None
    for ep in target.endpoints:
        try:
            asyncio.run(enable_auth_async(ep, target.cert_dir))
        except grpc.aio.AioRpcError as e:
            last = e
            continue
        if args.output == "json":
            print_json({"enabled": True, "endpoint": ep, "prefix": CLUSTER_PREFIX})
        else:
            print(
                _("etcd authentication enabled through {endpoint}: user kunlun may use {prefix} only").format(
                    endpoint=ep, prefix=CLUSTER_PREFIX
                )
            )
        return 0
    raise CliError(
        _("no etcd member accepted the change ({endpoints}): {error}").format(
            endpoints=", ".join(target.endpoints), error=last
        )
    )
