"""`kunlun-cli certs init DIR` and `kunlun-cli certs issue DIR --role R --name N`."""

from __future__ import annotations

import argparse
from typing import Any

from controlplane.cli.output import print_json
from kunlun_common.errors import ConfigError
from kunlun_common.pki import ROLES, ClusterCerts, init_cluster_certs, issue


def _csv(text: str | None, default: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip()) if text else default


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    c = sub.add_parser(
        "certs", help="certificates for a cluster (CA, servers, agents, operators)", parents=[common]
    )
    csub = c.add_subparsers(dest="cmd", required=True)
    i = csub.add_parser(
        "init", help="create a CA and every certificate of a cluster in DIR", parents=[common]
    )
    i.add_argument("dir")
    i.add_argument("--hosts", help="extra SANs for server certificates (addresses, host names)")
    i.add_argument("--nodes", help="node names for agent certificates (default node-a,node-b)")
    i.add_argument("--replicas", help="replica names (default replica-1,replica-2,replica-3)")
    i.add_argument(
        "--host",
        action="append",
        default=[],
        metavar="NAME=H1,H2",
        help="the real names and addresses of one server (replica-1, node-a, etcd-1, gateway-1): its "
        "certificate carries these instead of --hosts (repeat per server)",
    )
    i.set_defaults(handler=certs_init)
    s = csub.add_parser("issue", help="issue one more certificate from DIR's CA", parents=[common])
    s.add_argument("dir")
    s.add_argument("--role", required=True, choices=ROLES)
    s.add_argument("--name", required=True)
    s.add_argument("--hosts", help="SANs (addresses, host names)")
    s.set_defaults(handler=certs_issue)


def host_map(entries: list[str]) -> dict[str, tuple[str, ...]]:
    """`--host NAME=H1,H2` entries -> {NAME: (H1, H2)}; a malformed entry names the fix."""
    out: dict[str, tuple[str, ...]] = {}
    for e in entries:
        name, eq, hosts = e.partition("=")
        if not eq or not name.strip() or not _csv(hosts, ()):
            raise ConfigError(
                f"--host {e!r}: expected NAME=HOST[,HOST...], e.g. replica-1=10.0.0.11,cp1.example"
            )
        out[name.strip()] = _csv(hosts, ())
    return out


def certs_init(args: argparse.Namespace) -> int:
    base = ClusterCerts()
    spec = ClusterCerts(
        nodes=_csv(args.nodes, base.nodes),
        replicas=_csv(args.replicas, base.replicas),
        hosts=base.hosts + _csv(args.hosts, ()),
        host_map=host_map(args.host),
    )
    written = init_cluster_certs(args.dir, spec)
    if args.output == "json":
        print_json({"items": [str(p) for p in written]})
    else:
        print(f"certificates in {args.dir}: CA plus {len(written)} certificates")
    return 0


def certs_issue(args: argparse.Namespace) -> int:
    hosts = ("127.0.0.1", "localhost", *_csv(args.hosts, ()))
    paths = issue(args.dir, args.role, args.name, hosts=hosts, overwrite=True)
    if args.output == "json":
        print_json({"cert": str(paths.cert), "key": str(paths.key), "ca": str(paths.ca)})
    else:
        print(f"issued {paths.cert}")
    return 0
