"""`kunlun-cli certs init DIR` and `kunlun-cli certs issue DIR --role R --name N`."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from controlplane.cli.client import Client, CliError
from controlplane.cli.output import print_json, print_table
from kunlun_common.api import security_pb2, security_pb2_grpc
from kunlun_common.errors import ConfigError
from kunlun_common.i18n import _, error_text
from kunlun_common.pki import (
    DEFAULT_DAYS,
    PRODUCTION_CRL,
    ROLES,
    ClusterCerts,
    certificate_serial,
    certificates,
    find_certificate,
    init_cluster_certs,
    issue,
    renew,
    write_crl,
)


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
    o = csub.add_parser(
        "rotate",
        help="renew certificates in DIR (new keys and serials, same names); then reload each component (SIGHUP)",
        parents=[common],
    )
    o.add_argument("dir")
    o.add_argument(
        "--name", action="append", default=[], help="only this certificate (ROLE/NAME or NAME; repeat)"
    )
    o.add_argument("--days", type=int, default=DEFAULT_DAYS, help=f"lifetime (default {DEFAULT_DAYS})")
    o.set_defaults(handler=certs_rotate)
    r = csub.add_parser(
        "revoke",
        help="revoke a certificate: replicas refuse it at once, agents and gateways within seconds",
        parents=[common],
    )
    r.add_argument(
        "target", metavar="SERIAL|NAME", help="serial in hex, or ROLE/NAME (e.g. viewer/viewer) or NAME"
    )
    r.add_argument(
        "--dir",
        help="the `certs init` folder: resolves NAME there, and rewrites DIR/crl/etcd.crl (etcd's "
        "--client-crl-file; needs DIR-ca-keys) with every revoked serial; copy it to "
        "/etc/kunlun/certs/crl/etcd.crl on every etcd host (where kunlun-etcd.service reads it)",
    )
    r.add_argument("--reason", default="", help="why (kept with the revocation)")
    r.set_defaults(handler=certs_revoke)


def host_map(entries: list[str]) -> dict[str, tuple[str, ...]]:
    """`--host NAME=H1,H2` entries -> {NAME: (H1, H2)}; a malformed entry names the fix."""
    out: dict[str, tuple[str, ...]] = {}
    for e in entries:
        name, eq, hosts = e.partition("=")
        if not eq or not name.strip() or not _csv(hosts, ()):
            raise ConfigError(
                _("--host {e!r}: expected NAME=HOST[,HOST...], e.g. replica-1=10.0.0.11,cp1.example").format(
                    e=e
                )
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
        print(
            _("certificates in {dir}: CA plus {count} certificates").format(dir=args.dir, count=len(written))
        )
    return 0


def certs_issue(args: argparse.Namespace) -> int:
    hosts = ("127.0.0.1", "localhost", *_csv(args.hosts, ()))
    paths = issue(args.dir, args.role, args.name, hosts=hosts, overwrite=True)
    if args.output == "json":
        print_json({"cert": str(paths.cert), "key": str(paths.key), "ca": str(paths.ca)})
    else:
        print(_("issued {cert}").format(cert=paths.cert))
    return 0


def _is_serial(text: str) -> bool:
    t = text.lower().removeprefix("0x").replace(":", "")
    return len(t) >= 8 and all(c in "0123456789abcdef" for c in t)


def resolve_target(client: Client, target: str, cert_dir: str | None) -> tuple[str, str]:
    """SERIAL|NAME -> (serial hex, "role/name" or ""): a name from DIR when given, else from the
    certificates the replicas have seen in use."""
    if cert_dir and not _is_serial(target):
        path = find_certificate(cert_dir, target)
        return f"{certificate_serial(path):x}", f"{path.parent.name}/{path.stem}"
    if _is_serial(target):
        return target, ""
    certs = client.call_stub(
        security_pb2_grpc.SecurityServiceStub,
        lambda s: s.ListCertificates,
        security_pb2.ListCertificatesRequest(),
    ).certificates
    role, _sep, name = target.rpartition("/")
    found = {(c.serial, f"{c.role}/{c.name}") for c in certs if c.name == name and role in ("", c.role)}
    if len(found) != 1:
        raise ConfigError(
            (
                _(
                    "{target!r}: no certificate of that name seen in use; give its serial, or the certificate folder with --dir"
                )
                if not found
                else _(
                    "{target!r}: more than one certificate of that name seen in use; give its serial, or the certificate folder with --dir"
                )
            ).format(target=target)
        )
    return next(iter(found))


def certs_revoke(args: argparse.Namespace) -> int:
    from controlplane.cli.main import make_client

    client = make_client(args)
    serial, name = resolve_target(client, args.target, args.dir)
    resp = client.call_stub(
        security_pb2_grpc.SecurityServiceStub,
        lambda s: s.RevokeCertificate,
        security_pb2.RevokeCertificateRequest(serial=serial, name=name, reason=args.reason),
    )
    crl = ""
    if args.dir:
        revoked = client.call_stub(
            security_pb2_grpc.SecurityServiceStub,
            lambda s: s.ListRevocations,
            security_pb2.ListRevocationsRequest(),
        ).revocations
        crl = str(write_crl(args.dir, (int(r.serial, 16) for r in revoked)))
    rev = resp.revocation
    if args.output == "json":
        print_json(
            {"serial": rev.serial, "name": rev.name, "by": rev.by, "at_unix_ms": rev.at_unix_ms, "crl": crl}
        )
        return 0
    print(
        _("revoked {name} serial {serial} (replicas refuse it now)").format(name=rev.name, serial=rev.serial)
        if rev.name
        else _("revoked certificate serial {serial} (replicas refuse it now)").format(serial=rev.serial)
    )
    if crl:
        print(
            _(
                "wrote {crl}: copy it to every etcd member's --client-crl-file ({production_crl} on hosts installed with kunlun-installer; etcd reads it on each new connection, no restart)"
            ).format(crl=crl, production_crl=PRODUCTION_CRL)
        )
    return 0


def _revoked_serials(args: argparse.Namespace) -> set[int] | None:
    """The cluster's revoked serials, or None when no replica can be asked."""
    from controlplane.cli.main import make_client

    try:
        client = make_client(args)
        revs = client.call_stub(
            security_pb2_grpc.SecurityServiceStub,
            lambda s: s.ListRevocations,
            security_pb2.ListRevocationsRequest(),
        ).revocations
    except (CliError, ConfigError) as e:
        print(
            _(
                "kunlun-cli: note: revocation list not read ({e}); revoked certificates in DIR are renewed too"
            ).format(e=error_text(e)),
            file=sys.stderr,
        )
        return None
    return {int(r.serial, 16) for r in revs}


def certs_rotate(args: argparse.Namespace) -> int:
    chosen = [find_certificate(args.dir, n) for n in args.name]
    todo = [(p.parent.name, p.stem) for p in chosen] if chosen else certificates(args.dir)
    if not todo:
        raise ConfigError(
            _("no certificates in {dir}; create them with `kunlun-cli certs init {dir}`").format(dir=args.dir)
        )
    revoked = _revoked_serials(args) or set()
    done, skipped = [], []
    for role, name in todo:
        if certificate_serial(find_certificate(args.dir, f"{role}/{name}")) in revoked:
            skipped.append(f"{role}/{name}")  # a revoked holder gets no fresh certificate
            continue
        done.append(renew(args.dir, role, name, days=args.days))
    items = [
        {
            "role": r.role,
            "name": r.name,
            "old_serial": f"{r.old_serial:x}",
            "new_serial": f"{r.new_serial:x}",
            "not_after": r.not_after.isoformat(),
        }
        for r in done
    ]
    if args.output == "json":
        print_json({"items": items, "skipped_revoked": skipped})
        return 0
    print_table(
        ["ROLE", "NAME", "NEW SERIAL", "NOT AFTER"],
        [[i["role"], i["name"], i["new_serial"], i["not_after"][:16]] for i in items],
    )
    for name in skipped:
        print(_("skipped {name}: revoked (issue a new identity instead)").format(name=name))
    print(
        _(
            "copy each component's new files to its host, then reload it: `kill -HUP PID` or `systemctl reload kunlun-...` (replicas, agents, gateways re-read their certificate; etcd does on each connection)"
        )
    )
    return 0
